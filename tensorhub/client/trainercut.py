"""A trainer's copy of its readers' cut: the version once more, laid out as its
readers read it (``Hub.publish(..., cut="readers")``).

FSDP ranks hold rows; a TP worker reads columns of the row-parallel tensors,
which from row shards is one READ run per row. The readers' read sets are with
the server already (a serving reader publishes exactly the regions it read),
so the trainer asks it (``ReaderCuts``) instead of being configured, and
publishes those regions as one more holder, each read set back to back:

    rank 0 asks the server ──broadcast──▶ every rank has the same read sets
    every rank makes the same plan (``plan_cut``): per tensor its regions, the
        ranks' parts it is gathered from, and its owner (tensors dealt out by
        bytes, largest first, to the least loaded rank)
    every rank walks the planned tensors in manifest order:
        owner:  gathers the full tensor (the other ranks' parts, point to point
                over ``cut_group``), at most ``gather_bytes`` of them at a time,
                then copies each region into its cut buffer and frees it
        others: send their parts of it to the owner (in place, no copy)
    each rank publishes its cut buffer as a ``trainer_cut`` replica

Where the read sets overlap without being equal (readers of two TP degrees),
the regions of the read set with more readers are cut and the others' are
left to the shards: one replica holds no element twice. A read set of every
tensor whole is not cut (whole tensors read contiguously from row shards).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorhub.client.rpc import ReaderCuts
from tensorhub.errors import InvalidRequest
from tensorhub.manifest import DTYPES, Manifest
from tensorhub.regions import Region
from tensorhub.shard import Part

log = logging.getLogger(__name__)

_ALIGN = 16  # bytes: each region of the cut buffer starts on this (any dtype's view of it is aligned)
_TAGS = 1 << 30  # p2p tags wrap around here (gloo takes any int; ordered per pair anyway)

# A rank's parts as the plan sees them: (tensor index, region, elements).
Layout = list[tuple[int, Region, int]]


@dataclass(slots=True)
class CutReport:
    """What a rank's cut cost and holds. ``peak_gather_bytes``: the most bytes
    of gathered tensors (and staging for their non-contiguous parts) it held
    at once, never over ``gather_bytes``; ``nbytes``: its share of the cut,
    published (the trainer's other extra memory, for as long as it publishes)."""

    from_version: int = -1  # whose readers' read sets were cut (-1: none known: nothing was cut)
    read_sets: int = 0  # read sets cut (in whole or in part)
    regions: int = 0  # regions this rank holds
    nbytes: int = 0
    tensors: int = 0  # tensors this rank gathered
    skipped_regions: int = 0  # of every rank: overlapping another read set's, or of a tensor no rank holds all of
    gather_bytes: int = 0  # the bound
    peak_gather_bytes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class CutPlan:
    """The same on every rank: per planned tensor its regions (in cut order),
    the parts it is gathered from ((rank, position in that rank's layout)),
    its owner; and per rank the regions it holds, in its buffer's order."""

    regions: dict[int, list[Region]] = field(default_factory=dict)
    sources: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    owner: dict[int, int] = field(default_factory=dict)
    held: list[list[tuple[int, Region]]] = field(default_factory=list)
    read_sets: int = 0
    skipped: int = 0


def plan_cut(manifest: Manifest, cuts: ReaderCuts, layouts: list[Layout]) -> CutPlan:
    """Which regions to cut, where each tensor is gathered from, and which rank
    holds it: a function of its arguments only, so every rank makes the same."""
    tensors = manifest.tensors
    world = len(layouts)
    plan = CutPlan(held=[[] for _ in range(world)])
    order: list[tuple[int, Region]] = []  # every region cut, by read set then its memory order
    for read_set in cuts.read_sets:
        if all(region.whole for _, region in read_set.held) and len(read_set.held) == len(tensors):
            continue  # a whole model: contiguous in the shards already
        took = False
        for index, region in read_set.held:
            shape = tensors[index].shape
            taken = plan.regions.setdefault(index, [])
            if any(region == other for other in taken):
                continue  # held by an earlier read set too (a replicated tensor): once
            if any(region.overlaps(other, shape) for other in taken):
                plan.skipped += 1
                continue
            taken.append(region)
            order.append((index, region))
            took = True
        plan.read_sets += took
    # Each tensor from parts that do not overlap (a lower rank's first), all of
    # its elements, or it is left to the shards.
    for index in list(plan.regions):
        shape, numel = tensors[index].shape, math.prod(tensors[index].shape)
        chosen: list[tuple[int, int]] = []
        for rank, layout in enumerate(layouts):
            for k, (t, region, _) in enumerate(layout):
                if t == index and not any(region.overlaps(layouts[r][j][1], shape) for r, j in chosen):
                    chosen.append((rank, k))
        if not plan.regions[index] or sum(layouts[r][j][2] for r, j in chosen) != numel:
            plan.skipped += len(plan.regions.pop(index))
            continue
        plan.sources[index] = chosen
    # Owners: by the bytes each tensor's regions take, largest first, to the least loaded rank.
    nbytes = {index: sum(r.numel(tensors[index].shape) for r in regions) * _itemsize(manifest, index)
              for index, regions in plan.regions.items()}
    load = [0] * world
    for index in sorted(nbytes, key=lambda i: (-nbytes[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        plan.owner[index] = rank
        load[rank] += nbytes[index]
    for index, region in order:
        if index in plan.owner:
            plan.held[plan.owner[index]].append((index, region))
    return plan


def _itemsize(manifest: Manifest, index: int) -> int:
    return torch.empty((), dtype=DTYPES[manifest.tensors[index].dtype]).element_size()


def _gather_need(manifest: Manifest, plan: CutPlan, layouts: list[Layout], index: int) -> int:
    """Bytes the owner holds while gathering tensor ``index``: the full tensor,
    plus staging for each other rank's part that is not contiguous in it."""
    spec = manifest.tensors[index]
    owner, item = plan.owner[index], _itemsize(manifest, index)
    staged = sum(layouts[r][k][2] for r, k in plan.sources[index]
                 if r != owner and not _contiguous(layouts[r][k][1], spec.shape))
    return spec.nbytes + staged * item


def _contiguous(region: Region, shape: tuple[int, ...]) -> bool:
    return region.run_count(shape) == 1


def _flat_start(region: Region, shape: tuple[int, ...]) -> int:
    return int(region.runs(shape).start[0]) if region.numel(shape) else 0


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat bytes: p2p in any dtype."""
    return tensor.reshape(-1).view(torch.uint8)


def _region_of(full: torch.Tensor, region: Region) -> torch.Tensor:
    """A view of ``region`` of ``full`` (strided for a column box)."""
    if region.flat is not None:
        return full.reshape(-1)[region.flat[0]:region.flat[1]]
    return full[tuple(slice(a, b) for a, b in region.bounds(tuple(full.shape)))]


class _Gathering:
    """The full tensor of one planned tensor, landing at its owner."""

    def __init__(self, index: int, full: torch.Tensor, need: int) -> None:
        self.index, self.full, self.need = index, full, need
        self.works: list[Any] = []
        self.staged: list[tuple[torch.Tensor, Region]] = []  # received apart, copied in once landed


def gather_cut(manifest: Manifest, parts: list[Part], plan: CutPlan, layouts: list[Layout], *, rank: int,
               group: Any, gather_bytes: int, report: CutReport,
               allocate: Callable[[int, torch.device], torch.Tensor] | None = None) -> list[Part]:
    """This rank's share of the cut, in one contiguous buffer (each region
    aligned to ``_ALIGN`` bytes), gathered over ``group`` as the module says.
    Every rank of ``group`` calls it with the same plan."""
    import torch.distributed as dist

    tensors = manifest.tensors
    mine = plan.held[rank]
    offsets, end = [], 0
    for index, region in mine:
        offsets.append(end)
        end += -(-region.numel(tensors[index].shape) * _itemsize(manifest, index) // _ALIGN) * _ALIGN
    device = parts[0].tensor.device if parts else torch.device("cpu")
    # ``allocate``: the caller's buffer of the last version's cut when it is free
    # again (the same plan then lays the cut out at the same addresses, and
    # its readers replay their plans: ``client/replay.py``).
    buffer = (allocate or _new_buffer)(end, device)
    slots: dict[int, list[tuple[Region, torch.Tensor]]] = {}
    out: list[Part] = []
    for (index, region), offset in zip(mine, offsets):
        spec = tensors[index]
        n = region.numel(spec.shape) * _itemsize(manifest, index)
        view = buffer[offset:offset + n].view(DTYPES[spec.dtype]).view(region.local_shape(spec.shape))
        slots.setdefault(index, []).append((region, view))
        out.append(Part(spec.name, spec.shape, region, view))

    def peer(r: int) -> int:
        return dist.get_global_rank(group, r)

    in_flight: list[_Gathering] = []
    held_bytes = 0
    sends: list[Any] = []

    def finish(g: _Gathering) -> None:
        nonlocal held_bytes
        for work in g.works:
            work.wait()
        for staging, region in g.staged:
            _region_of(g.full, region).copy_(staging.view(region.local_shape(tuple(g.full.shape))))
        for region, view in slots[g.index]:
            view.copy_(_region_of(g.full, region))
        held_bytes -= g.need

    tag = 0
    for index in sorted(plan.owner):  # manifest order, on every rank
        spec, owner = tensors[index], plan.owner[index]
        if owner != rank:
            for r, k in plan.sources[index]:
                tag = (tag + 1) % _TAGS
                if r == rank:
                    sends.append(dist.isend(_bytes(parts[k].tensor), dst=peer(owner), group=group, tag=tag))
            continue
        need = _gather_need(manifest, plan, layouts, index)
        while in_flight and held_bytes + need > gather_bytes:  # the look-ahead is full: land the oldest
            finish(in_flight.pop(0))
        g = _Gathering(index, torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=device), need)
        held_bytes += need
        report.peak_gather_bytes = max(report.peak_gather_bytes, held_bytes)
        for r, k in plan.sources[index]:
            tag = (tag + 1) % _TAGS
            region = layouts[r][k][1]
            if r == rank:
                _region_of(g.full, region).copy_(parts[k].tensor.view(region.local_shape(spec.shape)))
            elif _contiguous(region, spec.shape):
                start = _flat_start(region, spec.shape)
                into = g.full.reshape(-1)[start:start + layouts[r][k][2]]
                g.works.append(dist.irecv(_bytes(into), src=peer(r), group=group, tag=tag))
            else:
                staging = torch.empty(layouts[r][k][2], dtype=g.full.dtype, device=device)
                g.staged.append((staging, region))
                g.works.append(dist.irecv(_bytes(staging), src=peer(r), group=group, tag=tag))
        in_flight.append(g)
        report.tensors += 1
    while in_flight:
        finish(in_flight.pop(0))
    for work in sends:  # the parts are the caller's again only once sent
        work.wait()
    report.regions, report.nbytes = len(out), sum(p.nbytes for p in out)
    return out


def agreed_cuts(ask: Callable[[], ReaderCuts | None], *, rank: int, group: Any) -> ReaderCuts | None:
    """Rank 0's answer from the server, the same on every rank (each rank asking
    could see the readers change in between). A failed ask is no cut on every
    rank: the shards are published as without one."""
    import torch.distributed as dist

    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = ask()
        except Exception as e:  # noqa: BLE001  every rank must hear something, or the others wait forever
            log.warning("asking the server for the readers' cuts: %s; publishing the shards only", e)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def check_gather_bounds(manifest: Manifest, plan: CutPlan, layouts: list[Layout], gather_bytes: int) -> None:
    """InvalidRequest (on every rank alike: the plan is the same) when a tensor
    alone needs more than ``gather_bytes`` to gather."""
    over = [(need, manifest.tensors[index].name) for index in plan.owner
            if (need := _gather_need(manifest, plan, layouts, index)) > gather_bytes]
    if over:
        need, name = max(over)
        raise InvalidRequest(f"the trainer cut gathers {name!r} whole ({need} bytes), more than cut_gather_bytes "
                             f"{gather_bytes}; raise it (HubConfig.cut_gather_bytes) or publish without cut=")


def _new_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def ranks_holding_nothing(holds: bool, group: Any = None) -> list[int]:
    """The ranks of ``group`` (default: the whole world) that hold nothing to
    publish, asked of every rank at once. The cut's publish is collective: a
    rank that cannot join it would leave the others waiting in its gathers, so
    a caller refuses on every rank together when this is not empty."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, holds, group=group)
    return [r for r, h in enumerate(every) if not h]


def publish_cut(*, ask: Callable[[], ReaderCuts | None], manifest: Manifest, parts: list[Part], group: Any,
                gather_bytes: int, publish: Callable[[list[Part]], Any],
                allocate: Callable[[int, torch.device], torch.Tensor] | None = None) -> tuple[Any, CutReport]:
    """Every rank of ``group``: agree on the readers' cuts, gather this rank's
    share and publish it (``publish(parts)``). Returns (the publication or
    None when there is nothing to cut, the report)."""
    import torch.distributed as dist

    start = time.perf_counter()
    rank = dist.get_rank(group)
    report = CutReport(gather_bytes=gather_bytes)
    cuts = agreed_cuts(ask, rank=rank, group=group)
    if cuts is None:
        return None, report
    index = manifest.index()
    mine: Layout = [(index[p.name], p.region, p.tensor.numel()) for p in parts]
    layouts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(layouts, mine, group=group)
    plan = plan_cut(manifest, cuts, layouts)
    report.from_version, report.read_sets, report.skipped_regions = cuts.version, plan.read_sets, plan.skipped
    check_gather_bounds(manifest, plan, layouts, gather_bytes)
    held = gather_cut(manifest, parts, plan, layouts, rank=rank, group=group, gather_bytes=gather_bytes,
                      report=report, allocate=allocate)
    publication = publish(held) if held else None
    report.seconds = time.perf_counter() - start
    return publication, report
