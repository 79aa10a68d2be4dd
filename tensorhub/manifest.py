"""Manifests: the ordered list of tensors of a version, and its fingerprint.

Every replica of a version shares one manifest. Readers compare it with their
destination tensors before any byte moves.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from tensorhub.errors import ManifestMismatch
from tensorhub.shard import Entry, Part, Shard, parts_of

# dtypes a manifest may name. Keys are torch's own names without "torch.".
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16",
        "float8_e4m3fn", "float8_e5m2",
        "int64", "int32", "int16", "int8", "uint8", "bool",
    )
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ITEMSIZES = {name: dtype.itemsize for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported; supported: {sorted(DTYPES)}") from None


def itemsize(dtype: str) -> int:
    return _ITEMSIZES[dtype]  # a lookup: a pull asks once per tensor, and a layer has hundreds


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape), tensor.numel() * tensor.element_size())

    def describe(self) -> str:
        return f"{self.name}: {self.dtype}{list(self.shape)}"


@dataclass(frozen=True, slots=True)
class Manifest:
    tensors: tuple[TensorSpec, ...]
    _fingerprint: list[str] = field(default_factory=list, compare=False, repr=False)  # computed once

    @classmethod
    def of(cls, tensors: Mapping[str, Entry]) -> Manifest:
        """The manifest of whole tensors, or of the full tensors Shards are part of."""
        specs = []
        for name, value in tensors.items():
            first = value[0] if isinstance(value, (list, tuple)) and value else value
            if isinstance(first, Shard):
                dtype = dtype_name(first.tensor.dtype)
                specs.append(TensorSpec(name, dtype, first.full_shape, math.prod(first.full_shape) * itemsize(dtype)))
            else:
                specs.append(TensorSpec.of(name, first))
        return cls(tuple(specs))

    def index(self) -> dict[str, int]:
        return {t.name: i for i, t in enumerate(self.tensors)}

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def fingerprint(self) -> str:
        if not self._fingerprint:  # hashed once: a manifest of an MoE model has 10^4-10^5 tensors
            canon = [[t.name, t.dtype, list(t.shape), t.nbytes] for t in self.tensors]
            self._fingerprint.append(hashlib.sha256(json.dumps(canon, separators=(",", ":")).encode()).hexdigest())
        return self._fingerprint[0]

    def validate(self) -> None:
        """Raise ValueError unless every entry is self-consistent."""
        seen: set[str] = set()
        for t in self.tensors:
            if not t.name:
                raise ValueError("a manifest tensor has an empty name")
            if t.name in seen:
                raise ValueError(f"tensor name {t.name!r} appears twice in the manifest")
            seen.add(t.name)
            if t.dtype not in DTYPES:
                raise ValueError(f"tensor {t.name!r} has unknown dtype {t.dtype!r}")
            if any(d < 0 for d in t.shape):
                raise ValueError(f"tensor {t.name!r} has a negative dimension {list(t.shape)}")
            expected = math.prod(t.shape) * itemsize(t.dtype)
            if t.nbytes != expected:
                raise ValueError(
                    f"tensor {t.name!r}: nbytes {t.nbytes} != {expected} implied by "
                    f"{t.dtype}{list(t.shape)}"
                )

    def parts(self, entries: Mapping[str, Entry], *, model: str, version: int | str,
              whole_model: bool = True, nothing: str = "Nothing was transferred.") -> list[Part]:
        """Check ``entries`` (tensors, Shards) against this manifest; the parts in
        manifest order. InvalidRequest for an entry that is wrong on its own,
        ManifestMismatch listing every disagreement with the manifest.
        ``whole_model``: every tensor of the manifest must appear."""
        parts = parts_of(entries)
        problems: list[str] = []
        wanted = {t.name: t for t in self.tensors}
        missing = [n for n in wanted if n not in entries] if whole_model else []
        extra = [n for n in entries if n not in wanted]
        if missing:
            problems.append(f"missing {_few(missing)}")
        if extra:
            problems.append(f"not in the version {_few(extra)}")
        reported: set[str] = set()
        for part in parts:
            spec = wanted.get(part.name)
            if spec is None or part.name in reported:
                continue
            dtype = _DTYPE_NAMES.get(part.tensor.dtype, str(part.tensor.dtype))
            if dtype != spec.dtype or part.full_shape != spec.shape:
                reported.add(part.name)
                problems.append(f"{part.name}: version has {spec.dtype}{list(spec.shape)}, "
                                f"destination {part.tensor.dtype}{list(part.full_shape)}")
        if problems:
            raise ManifestMismatch(
                f"tensors do not match {model!r} version {version} "
                f"(fingerprint {self.fingerprint[:12]}): " + "; ".join(problems[:8])
                + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
                + f". {nothing}"
            )
        order = self.index()
        return sorted(parts, key=lambda p: (order[p.name], p.region.first_element(p.full_shape)))

    def check_destination(self, into: Mapping[str, Entry], *, model: str, version: int) -> None:
        """Raise ManifestMismatch unless ``into`` holds exactly these tensors (or
        regions of them), contiguous, with the same shapes and dtypes."""
        self.parts(into, model=model, version=version)


def _few(names: list[str], n: int = 5) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" (+{len(names) - n} more)" if len(names) > n else "")
