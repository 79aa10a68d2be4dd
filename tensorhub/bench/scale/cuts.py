"""Who holds what in the simulation, as chunk rules (``regiontable``), and what
a reader's READs against those holders cost in descriptors and bytes.

    trainer rank r of R    FSDP2 Shard(0): rows chunk r of R of every tensor
    TP worker w of 8       rows / columns chunk w of 8, one KV head of kv_heads, or whole
    EP worker w of 8       (TP=8 with ``enable_expert_parallel``) its routed experts whole,
                           the others not at all; attention, dense and shared MLPs as TP

Under EP vLLM's FusedMoE places experts linearly: worker w owns
[w*base + min(w, rem), ...) with base = E // 8 and the first rem = E % 8
workers one more (``expert_owner``). Our adapter's dry run then records no box
for an owned expert (whole) and lists the rest as unread
(tests/vllm/test_vllm_moe.py::test_expert_parallel_workers_read_their_experts_whole).

The descriptor count is exact for boxes: an overlap of the reader's box and a
holder's box moves as runs contiguous on both sides, one per index of the
dimensions before the last that both sides hold whole (``runs``). A column slice
read out of row-sharded holders is one run per row; a relay cut like the reader
gives the same box, one run per tensor, and back-to-back buffers join those
into one READ per chunk.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from tensorhub.bench.scale.models import Tensor
from tensorhub.regions import Bounds, intersect
from tensorhub.regiontable import Rule, chunk_bounds
from tensorhub.transport.cost import LinkCost

TP = 8
KINDS = ("rows", "cols", "kv", "whole")
LAYOUTS = ("tp", "ep")


def trainer_rules(dims0: np.ndarray, ranks: int, rank: int) -> tuple[list[Rule], np.ndarray]:
    """(rules, rule_of) of FSDP rank ``rank``: rows chunk ``rank`` of every tensor that has one."""
    start, stop = chunk_bounds(dims0, np.full_like(dims0, ranks), np.full_like(dims0, rank))
    return [(0, ranks, rank)], (start < stop).astype(np.uint8)


def expert_owner(expert: int, experts: int) -> int:
    """The EP worker (of 8) that holds routed expert ``expert`` of ``experts``:
    vLLM's linear placement (``start = rank * base + min(rank, remainder)``)."""
    base, rem = divmod(experts, TP)
    # the first rem workers hold base + 1 experts: (base + 1) * rem of them
    return expert // (base + 1) if expert < (base + 1) * rem else rem + (expert - (base + 1) * rem) // base


def owners(model: list[Tensor], experts: int) -> np.ndarray:
    """Per tensor, its EP owner, or -1 where every worker cuts it as TP (not a routed expert)."""
    return np.array([expert_owner(t.expert, experts) if t.expert >= 0 else -1 for t in model], np.int64)


def worker_rules(kinds: np.ndarray, kv_heads: int, worker: int,
                 owner: np.ndarray | None = None) -> tuple[list[Rule], np.ndarray]:
    """(rules, rule_of) of worker ``worker`` of 8: what vLLM's loaders read on that rank.
    ``owner`` (``owners``) makes it an EP worker: its experts whole, the others not held."""
    kv = (0, kv_heads, worker * kv_heads // TP) if kv_heads and kv_heads < TP else (0, TP, worker)
    rules = [(0, TP, worker), (1, TP, worker), kv, (0, 1, 0)]
    rule_of = kinds + 1
    if owner is not None:
        whole = KINDS.index("whole") + 1
        rule_of = np.where(owner < 0, rule_of, np.where(owner == worker, whole, 0))
    return rules, rule_of.astype(np.uint8)


def worker_box(t: Tensor, kv_heads: int, worker: int, ep_experts: int = 0) -> Bounds | None:
    """The box worker ``worker`` reads of ``t``; None for another EP worker's expert.
    ``ep_experts``: routed experts per layer when the engine runs expert parallel (0: TP)."""
    shape = t.shape
    if ep_experts and t.expert >= 0:
        return tuple((0, d) for d in shape) if expert_owner(t.expert, ep_experts) == worker else None
    box = [(0, d) for d in shape]
    if t.tp in ("rows", "cols"):
        d = 0 if t.tp == "rows" else 1
        step = shape[d] // TP
        box[d] = (worker * step, (worker + 1) * step)
    elif t.tp == "kv":
        heads = kv_heads if kv_heads and kv_heads < TP else TP
        step = shape[0] // heads
        head = worker * heads // TP
        box[0] = (head * step, (head + 1) * step)
    return tuple(box)


def runs(overlap: Bounds, a: Bounds, b: Bounds) -> int:
    """Runs contiguous in both local layouts (boxes ``a`` and ``b``, row-major) of their overlap."""
    k = len(overlap) - 1
    while k > 0 and overlap[k] == a[k] == b[k]:
        k -= 1
    return math.prod(hi - lo for lo, hi in overlap[:k]) if overlap else 1


@dataclass(frozen=True, slots=True)
class FirstHop:
    """A TP worker's READs from the FSDP ranks, per the cost model's choice."""

    wanted_bytes: int
    read_bytes: int  # with the wide reads the cost model chose (whole rows, cut locally)
    exact_descriptors: int
    descriptors: int  # as chosen
    seconds: float  # cost model: per-descriptor cost plus bytes over the link


def first_hop(model: list[Tensor], ranks: int, kv_heads: int, worker: int, link: LinkCost,
              ep_experts: int = 0) -> FirstHop:
    """The reader's overlaps with every FSDP rank, tensor by tensor, grouped by
    (shape, dtype, cut): box algebra once per group and holder. Under EP a whole
    expert out of a rank's rows is one contiguous run per rank."""
    groups: dict[tuple, int] = {}
    for t in model:
        box = worker_box(t, kv_heads, worker, ep_experts)
        if box is None:  # another EP worker's expert: not read
            continue
        key = (t.shape, t.dtype, box)
        groups[key] = groups.get(key, 0) + 1
    wanted = read = exact_desc = desc = 0
    seconds = 0.0
    for (shape, dtype, box), count in groups.items():
        item = 4 if dtype == "float32" else 2
        row = math.prod(shape[1:]) * item
        pieces = [(a, b) for a, b in (chunk_bounds(np.int64(shape[0]), np.int64(ranks), np.int64(r))
                                      for r in range(ranks)) if a < b]
        for a, b in pieces:
            holder = ((int(a), int(b)), *((0, d) for d in shape[1:]))
            ov = intersect(box, holder)
            if ov is None:
                continue
            n = runs(ov, box, holder)
            nbytes = math.prod(hi - lo for lo, hi in ov) * item
            span = (ov[0][1] - ov[0][0]) * row  # the holder's whole rows of the overlap: contiguous there
            exact_s, wide_s = link.exact_s(n, nbytes), link.wide_s(span, nbytes)
            wide = n > 1 and wide_s < exact_s
            wanted += count * nbytes
            read += count * (span if wide else nbytes)
            exact_desc += count * n
            desc += count * (1 if wide else n)
            seconds += count * (wide_s if wide else exact_s)
    return FirstHop(wanted, read, exact_desc, desc, seconds)


# ---------------------------------------------------------------- the trainer's cut
# ``Hub.publish(cut="readers")`` (``client/trainercut.py``): from the second
# version on, every FSDP rank also publishes a share of the readers' cut, each
# region back to back in its buffer, so a reader's first hop is one contiguous
# READ per region instead of one per row of a column slice.


def read_boxes(t: Tensor, kv_heads: int, ep_experts: int = 0) -> list[Bounds]:
    """The distinct boxes the 8 workers read of ``t``, in worker order: what
    the cut holds of it (a box read by several workers, once)."""
    boxes: list[Bounds] = []
    for w in range(TP):
        box = worker_box(t, kv_heads, w, ep_experts)
        if box is not None and box not in boxes:
            boxes.append(box)
    return boxes


def cut_owners(model: list[Tensor], ranks: int) -> np.ndarray:
    """Per tensor, the rank that holds its cut: by bytes, largest first, to the
    least loaded rank (``trainercut.plan_cut``'s rule)."""
    nbytes = np.array([math.prod(t.shape) * (4 if t.dtype == "float32" else 2) for t in model], np.int64)
    owner = np.empty(len(model), np.int64)
    load = [(0, r) for r in range(ranks)]  # a heap: (bytes dealt, rank)
    for i in sorted(range(len(model)), key=lambda i: (-nbytes[i], i)):
        dealt, rank = heapq.heappop(load)
        owner[i] = rank
        heapq.heappush(load, (dealt + int(nbytes[i]), rank))
    return owner


@dataclass(frozen=True, slots=True)
class CutHop:
    """A worker's first hop from the trainer's cut, and what the cut cost the trainer."""

    wanted_bytes: int
    descriptors: int  # one per region read: each is contiguous in the cut
    read_s: float  # cost model: the reader's READs
    share_bytes_max: int  # the largest rank's share of the cut (its extra memory while published)
    gather_s: float  # the largest share gathered over the rank's NIC before it is published
    seconds: float  # gather, then read (the cut is published once built)

    @property
    def read_bytes(self) -> int:  # exactly what it wants: every region is contiguous in the cut
        return self.wanted_bytes


def cut_hop(model: list[Tensor], ranks: int, kv_heads: int, worker: int, link: LinkCost,
            ep_experts: int = 0) -> CutHop:
    """Worker ``worker``'s READs from the cut, and the trainer's gather. A rank
    gathers each tensor it owns whole from every rank's rows: it receives all
    but its own rows of its share (full duplex: its sends to the other owners
    overlap), so the largest share over the NIC bounds the gather."""
    owner = cut_owners(model, ranks)
    share = np.zeros(ranks, np.int64)
    wanted = descriptors = 0
    for t, rank in zip(model, owner):
        item = 4 if t.dtype == "float32" else 2
        boxes = read_boxes(t, kv_heads, ep_experts)
        share[rank] += sum(math.prod(hi - lo for lo, hi in b) for b in boxes) * item
        box = worker_box(t, kv_heads, worker, ep_experts)
        if box is not None:
            wanted += math.prod(hi - lo for lo, hi in box) * item
            descriptors += 1
    read_s = float(link.exact_s(descriptors, wanted))
    biggest = int(share.max())
    gather_s = biggest * (ranks - 1) / ranks / link.bandwidth
    return CutHop(wanted, descriptors, read_s, biggest, gather_s, gather_s + read_s)
