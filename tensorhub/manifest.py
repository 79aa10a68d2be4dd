"""Manifests: the ordered list of tensors of a version, and its fingerprint.

Every replica of a version shares one manifest. Readers compare it with their
destination tensors before any byte moves.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tensorhub.errors import ManifestMismatch

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


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported; supported: {sorted(DTYPES)}") from None


def itemsize(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


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

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> Manifest:
        return cls(tuple(TensorSpec.of(name, t) for name, t in tensors.items()))

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def fingerprint(self) -> str:
        canon = [[t.name, t.dtype, list(t.shape), t.nbytes] for t in self.tensors]
        return hashlib.sha256(json.dumps(canon, separators=(",", ":")).encode()).hexdigest()

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

    def check_destination(self, into: Mapping[str, torch.Tensor], *, model: str, version: int) -> None:
        """Raise ManifestMismatch unless ``into`` holds exactly these tensors,
        contiguous, with the same shapes and dtypes."""
        problems: list[str] = []
        wanted = {t.name: t for t in self.tensors}
        missing = [n for n in wanted if n not in into]
        extra = [n for n in into if n not in wanted]
        if missing:
            problems.append(f"missing {_few(missing)}")
        if extra:
            problems.append(f"not in the version {_few(extra)}")
        for name, tensor in into.items():
            spec = wanted.get(name)
            if spec is None:
                continue
            got = TensorSpec.of(name, tensor) if tensor.dtype in _DTYPE_NAMES else None
            if got is None or got.dtype != spec.dtype or got.shape != spec.shape:
                have = f"{tensor.dtype}{list(tensor.shape)}"
                problems.append(f"{name}: version has {spec.dtype}{list(spec.shape)}, destination {have}")
            elif not tensor.is_contiguous():
                problems.append(f"{name}: destination is not contiguous")
        if problems:
            raise ManifestMismatch(
                f"destination tensors do not match {model!r} version {version} "
                f"(fingerprint {self.fingerprint[:12]}): " + "; ".join(problems[:8])
                + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
                + ". Nothing was transferred."
            )


def _few(names: list[str], n: int = 5) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" (+{len(names) - n} more)" if len(names) > n else "")
