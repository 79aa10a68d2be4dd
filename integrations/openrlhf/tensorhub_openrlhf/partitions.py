"""Which flat region of each parameter a trainer rank publishes, in place.

ZeRO-3 (DeepSpeed ``partition_parameters``): a parameter of ``n`` elements is
padded to a multiple of the partition group's size ``W`` and cut into ``W``
equal flat ranges; rank ``r`` keeps ``param.ds_tensor``, the elements
``[r * p, (r + 1) * p)`` of the row-major tensor (``p = ceil(n / W)``), where
the last rank's tail past ``n`` is padding. So a rank's partition is already a
flat region: published as a view of ``ds_tensor`` (no gather, no copy).

ZeRO-0/1/2 keep whole parameters on every rank. Each rank then publishes the
same flat range of its own replica (a view again), so the ranks together
cover every element once and each one's link carries ``1/W`` of the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from tensorhub import Shard


def partition_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s flat range ``[start, stop)`` of ``numel`` elements cut as
    ZeRO-3 cuts them (may be empty on the last ranks of a small tensor)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world}")
    per_rank = -(-numel // world)
    start = min(numel, rank * per_rank)
    return start, min(numel, start + per_rank)


def zero3_region(param: torch.nn.Parameter, rank: int, world: int) -> Shard | None:
    """This rank's ZeRO-3 partition of ``param`` as a flat Shard of the full
    tensor (a view of ``param.ds_tensor`` without its padding), or None when
    the rank holds none of it."""
    numel, shape, local = int(param.ds_numel), tuple(param.ds_shape), param.ds_tensor
    start, stop = partition_range(numel, rank, world)
    if local.numel() != -(-numel // world):
        raise ValueError(f"ZeRO-3 partition of {list(shape)} holds {local.numel()} elements; expected "
                         f"{-(-numel // world)} for rank {rank} of {world} (a partition group other than the "
                         "data-parallel group, e.g. ZeRO++ hpZ, is not supported)")
    if stop <= start:
        return None
    return Shard(local.data.view(-1).narrow(0, 0, stop - start), shape, flat=(start, stop))


def replica_region(param: torch.nn.Parameter, rank: int, world: int) -> Shard | None:
    """Rank ``rank``'s share of a parameter every rank holds whole (ZeRO-0/1/2)."""
    data = param.data
    if not data.is_contiguous():
        raise ValueError(f"parameter of shape {list(data.shape)} is not contiguous; it cannot be published in place")
    start, stop = partition_range(data.numel(), rank, world)
    if stop <= start:
        return None
    return Shard(data.view(-1).narrow(0, start, stop - start), tuple(data.shape), flat=(start, stop))


def is_zero3(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_tensor")



def partition_group(params: Iterable[torch.nn.Parameter]) -> Any:
    """The process group the ranks' regions of ``params`` are cut over (and
    the readers' cut gathered over): ZeRO-3's partition group, else the whole
    world, over which ZeRO-0/1/2 replicas are cut. One for the whole model."""
    groups = {}
    for param in params:
        group = param.ds_process_group if is_zero3(param) else dist.group.WORLD
        groups[id(group)] = group
    if len(groups) != 1:
        raise ValueError(f"the model's parameters are partitioned over {len(groups)} process groups; the readers' "
                         "cut gathers over one (set TENSORHUB_CUT=off)")
    return next(iter(groups.values()))
