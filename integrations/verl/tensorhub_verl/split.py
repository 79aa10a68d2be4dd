"""Which part of each tensor a trainer rank keeps and publishes.

verl 0.9.1 hands every trainer rank the same stream of full tensors (FSDP
all-gathers each parameter on every rank). Rank ``r`` of ``n`` keeps only its
``1/n`` of each one, so the version is the union of ``n`` shards and no rank
holds or serves more than about ``1/n`` of the model:

* ``rows``  a tensor with at least ``n`` rows: rows ``[s*r/n, s*(r+1)/n)``
  (where TP readers cut too, so a TP slice spans few holders);
* ``flat``  fewer rows but at least ``n`` elements (e.g. ``[1, 4096]``): the
  same split of its row-major elements;
* ``whole`` fewer than ``n`` elements (a scalar): the rank ``index % n`` holds
  it, so such tensors spread over the ranks too.

The rule is a pure function of the shape, the tensor's position in the stream
and the rank, so every rank knows what every other rank holds without talking
to them (the per-rank byte counts in the metrics come from it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def rank_region(shape: Sequence[int], index: int, rank: int, world: int) -> dict[str, Any] | None:
    """``Shard`` keyword arguments for rank ``rank``'s part of a tensor of ``shape``
    (``{}``: all of it), or None when the rank keeps nothing of it."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a trainer world of {world}")
    if world == 1:
        return {}
    if len(shape) >= 1 and shape[0] >= world:
        return {"rows": (shape[0] * rank // world, shape[0] * (rank + 1) // world)}
    numel = math.prod(shape)
    if numel >= world:
        return {"flat": (numel * rank // world, numel * (rank + 1) // world)}
    return {} if index % world == rank else None


def region_numel(shape: Sequence[int], region: dict[str, Any] | None) -> int:
    """Elements of ``region`` (as returned by :func:`rank_region`)."""
    if region is None:
        return 0
    if "rows" in region:
        start, stop = region["rows"]
        return (stop - start) * math.prod(shape[1:])
    if "flat" in region:
        start, stop = region["flat"]
        return stop - start
    return math.prod(shape)


def bytes_per_rank(specs: Sequence[tuple[Sequence[int], int]], world: int) -> list[int]:
    """Bytes every rank keeps of tensors given as ``(shape, itemsize)`` in stream order."""
    totals = [0] * world
    for index, (shape, itemsize) in enumerate(specs):
        for rank in range(world):
            totals[rank] += region_numel(shape, rank_region(shape, index, rank, world)) * itemsize
    return totals
