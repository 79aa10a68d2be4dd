"""``Shard``: part of one tensor of a model, held contiguously in local memory,
and ``Part``: one checked (tensor, region, local memory) triple.

Publish and pull take ``{name: tensor | Shard | [Shard, ...]}``: a plain tensor
means the whole tensor. ``parts_of`` checks such a mapping on its own (regions
inside the full shape, element counts, contiguity, no overlaps) and raises
``InvalidRequest`` naming the tensor and the region before anything is
registered or read; ``Manifest.parts`` then checks it against a manifest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tensorhub.errors import InvalidRequest
from tensorhub.regions import Bounds, Region


class Shard:
    """``tensor`` holds one region of a tensor whose full shape is ``full_shape``:
    ``rows=(a, b)`` (dim 0), ``cols=(a, b)`` (dim 1), ``box=((a0, b0), ...)``
    (one range per dimension) or ``flat=(a, b)`` (row-major elements, as ZeRO-3
    partitions a parameter); none of them means the whole tensor.

    >>> Shard(w[0:500], (1000, 64), rows=(0, 500))
    """

    __slots__ = ("full_shape", "region", "tensor")

    def __init__(self, tensor: torch.Tensor, full_shape: Sequence[int], *, rows: tuple[int, int] | None = None,
                 cols: tuple[int, int] | None = None, box: Bounds | None = None,
                 flat: tuple[int, int] | None = None) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise InvalidRequest(f"Shard needs a torch.Tensor, not {type(tensor).__name__}")
        self.tensor = tensor
        self.full_shape = tuple(int(d) for d in full_shape)
        try:
            self.region = Region.of(self.full_shape, rows=rows, cols=cols, box=box, flat=flat)
        except (ValueError, TypeError) as e:
            raise InvalidRequest(f"Shard of full shape {list(self.full_shape)}: {e}") from None

    @classmethod
    def of(cls, full: torch.Tensor, *, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
           box: Bounds | None = None, flat: tuple[int, int] | None = None) -> Shard:
        """The region of ``full`` as a Shard: a view where the region is contiguous
        in ``full`` (rows, flat ranges), else a contiguous copy (columns)."""
        shape = tuple(full.shape)
        try:
            region = Region.of(shape, rows=rows, cols=cols, box=box, flat=flat)
        except (ValueError, TypeError) as e:
            raise InvalidRequest(f"Shard of full shape {list(shape)}: {e}") from None
        problem = region.problem(shape)
        if problem:
            raise InvalidRequest(f"Shard.of {list(shape)} {region.describe()}: {problem}")
        if region.flat is not None:
            local = full.reshape(-1)[region.flat[0]:region.flat[1]]
        else:
            local = full[tuple(slice(a, b) for a, b in region.bounds(shape))]
        shard = cls.__new__(cls)
        shard.tensor, shard.full_shape, shard.region = local.contiguous(), shape, region
        return shard

    def __repr__(self) -> str:
        return f"Shard({self.tensor.dtype}{list(self.tensor.shape)} of {list(self.full_shape)} {self.region.describe()})"


Entry = torch.Tensor | Shard | Sequence[Shard]


@dataclass(frozen=True, slots=True)
class Part:
    """Region ``region`` of tensor ``name`` (full shape ``full_shape``), held in ``tensor``."""

    name: str
    full_shape: tuple[int, ...]
    region: Region
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def parts_of(entries: Mapping[str, Entry]) -> list[Part]:
    """Check every entry on its own; every problem is listed in one InvalidRequest."""
    parts: list[Part] = []
    problems: list[str] = []
    for name, value in entries.items():
        if not isinstance(name, str) or not name:
            problems.append(f"tensor name {name!r} is not a non-empty string")
            continue
        if isinstance(value, torch.Tensor):
            items: list[Shard | torch.Tensor] = [value]
        elif isinstance(value, Shard):
            items = [value]
        elif isinstance(value, Sequence) and value and all(isinstance(v, Shard) for v in value):
            items = list(value)
        else:
            problems.append(f"{name}: expected a tensor, a Shard or a list of Shards, not {type(value).__name__}")
            continue
        mine: list[Part] = []
        for item in items:
            if isinstance(item, torch.Tensor):
                part = Part(name, tuple(item.shape), Region(), item)
            else:
                part = Part(name, item.full_shape, item.region, item.tensor)
            problem = part.region.problem(part.full_shape)
            where = name if part.region.whole else f"{name} {part.region.describe()}"
            if problem:
                problems.append(f"{where}: {problem}")
                continue
            want = part.region.numel(part.full_shape)
            if part.tensor.numel() != want:
                problems.append(f"{where}: the local tensor has {part.tensor.numel()} elements, the region {want}")
            elif not part.tensor.is_contiguous():
                problems.append(f"{where}: the local tensor is not contiguous; call .contiguous() first")
            elif any(p.full_shape != part.full_shape for p in mine):
                problems.append(f"{where}: full shape {list(part.full_shape)} differs from its other shards'")
            elif any(p.tensor.dtype != part.tensor.dtype for p in mine):
                problems.append(f"{where}: dtype {part.tensor.dtype} differs from its other shards'")
            else:
                clash = next((p for p in mine if p.region.overlaps(part.region, part.full_shape)), None)
                if clash is not None:
                    problems.append(f"{where}: overlaps {clash.region.describe()} of the same tensor")
                else:
                    mine.append(part)
        parts.extend(mine)
    if problems:
        raise InvalidRequest(
            f"{len(problems)} bad tensor region(s): " + "; ".join(problems[:8])
            + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            + ". Nothing was registered or read."
        )
    return parts
