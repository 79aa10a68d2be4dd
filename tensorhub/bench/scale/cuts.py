"""Who holds what in the simulation, as chunk rules (``regiontable``), and what
a reader's READs against those holders cost in descriptors and bytes.

    trainer rank r of R    FSDP2 Shard(0): rows chunk r of R of every tensor
    TP worker w of 8       rows / columns chunk w of 8, one KV head of kv_heads, or whole

The descriptor count is exact for boxes: an overlap of the reader's box and a
holder's box moves as runs contiguous on both sides, one per index of the
dimensions before the last that both sides hold whole (``runs``). A column slice
read out of row-sharded holders is one run per row; a relay cut like the reader
gives the same box, one run per tensor, and back-to-back buffers join those
into one READ per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tensorhub.bench.scale.models import Tensor
from tensorhub.regions import Bounds, intersect
from tensorhub.regiontable import Rule, chunk_bounds
from tensorhub.transport.cost import LinkCost

TP = 8
KINDS = ("rows", "cols", "kv", "whole")


def trainer_rules(dims0: np.ndarray, ranks: int, rank: int) -> tuple[list[Rule], np.ndarray]:
    """(rules, rule_of) of FSDP rank ``rank``: rows chunk ``rank`` of every tensor that has one."""
    start, stop = chunk_bounds(dims0, np.full_like(dims0, ranks), np.full_like(dims0, rank))
    return [(0, ranks, rank)], (start < stop).astype(np.uint8)


def worker_rules(kinds: np.ndarray, kv_heads: int, worker: int) -> tuple[list[Rule], np.ndarray]:
    """(rules, rule_of) of TP worker ``worker`` of 8: what vLLM's loaders read on that rank."""
    kv = (0, kv_heads, worker * kv_heads // TP) if kv_heads and kv_heads < TP else (0, TP, worker)
    rules = [(0, TP, worker), (1, TP, worker), kv, (0, 1, 0)]
    return rules, (kinds + 1).astype(np.uint8)


def worker_box(t: Tensor, kv_heads: int, worker: int) -> Bounds:
    shape = t.shape
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


def first_hop(model: list[Tensor], ranks: int, kv_heads: int, worker: int, link: LinkCost) -> FirstHop:
    """The reader's overlaps with every FSDP rank, tensor by tensor, grouped by
    (shape, dtype, cut): box algebra once per group and holder."""
    groups: dict[tuple, int] = {}
    for t in model:
        key = (t.shape, t.dtype, worker_box(t, kv_heads, worker))
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
