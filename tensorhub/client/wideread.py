"""Wide READs: a holder's contiguous span read whole into scratch, then the
wanted element runs cut out of it locally.

A column slice of a row-sharded matrix is one short run per row: a TP=8
reader of a Qwen3-30B-A3B expert's ``down_proj`` [2048, 768] wants 192 bytes
of every 1,536-byte row. One READ descriptor per run costs ~2.5 us each over
shared memory (``transport.cost``): the layer's 144 MiB slice in 262,400 runs
pulled 65x slower than a memcpy of its bytes (``tensorhub bench pull --layout
moe --reader-slice tp8``, before wide reads; docs/history/moe-slices.md). Reading the rows whole moves 8x
the bytes in one descriptor, and a strided copy cuts the columns out at
memory speed.

    Transfer (exact segments, in reader order)
      ──groups──▶ runs of one length at one stride on both sides, in one held region
      ──cost────▶ per group: exact_s(runs, wanted) vs wide_s(span, wanted)
      ──pack────▶ READs of at most one scratch slot of wide spans each
    posted:  exact segments straight into the destination, one descriptor per wide group into the slot
    landed:  each wide group cut from the slot into the destination, before the
             READ counts as landed: checks and accounting see the reader's own bytes

A Transfer keeps its exact segments (what the checks, accounting and failover
see); ``Transfer.wide`` only says how to move them. A READ posted without it
(no scratch slot free) moves the exact runs: the same bytes. A wide READ that
fails fails its chunk, which is read again like any other.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import as_strided

from tensorhub.client.scratch import ScratchPool, Slot
from tensorhub.client.transfer import Transfer, WidePlan
from tensorhub.transport.cost import LinkCost

if TYPE_CHECKING:
    from tensorhub.client.readlayout import HolderMap
    from tensorhub.client.rpc import RemoteReplica

# Below this saving a READ is not worth grouping: the numpy calls that group
# one READ's segments take about this long (so dense pulls, a few segments
# per READ, are never looked at).
_WORTH_S = 50e-6
_ALIGN = 64  # scratch offsets of wide spans: cache lines, so cuts start aligned


def widen(t: Transfer, held_ends: np.ndarray, cost: LinkCost, slot_bytes: int) -> list[Transfer]:
    """``t`` as READs that read wide where ``cost`` says it pays, each landing at
    most ``slot_bytes`` of scratch; ``[t]`` when nothing does. ``held_ends``:
    the end of each of the holder's held regions in its own byte space."""
    n = len(t.local)
    if t.h_off is None or n < 2 or (n - 1) * cost.per_descriptor_s < _WORTH_S:
        return [t]
    li, ri = t.local.view(np.int64), t.remote.view(np.int64)  # addresses < 2**63: signed strides
    la, ra, length = li[:, 0], ri[:, 0], li[:, 1]
    region = np.searchsorted(held_ends, t.h_off, side="right")
    s, d = np.diff(ra), np.diff(la)  # the strides between neighbours on either side
    # Neighbours continue a pattern if they lie in one held region (a wide
    # span must lie in one registration of the holder), on one device on
    # either side, are runs of one length, and move forward on both sides
    # without overlapping.
    valid = (region[1:] == region[:-1]) & (length[1:] == length[:-1]) & (s >= length[:-1]) & (d >= length[:-1])
    for dev in (li[:, 2], ri[:, 2]):
        if not bool((dev == dev[0]).all()):
            valid &= dev[1:] == dev[:-1]
    # A group starts where the pattern breaks or its strides change.
    changed = np.zeros(n - 1, bool)
    changed[1:] = valid[:-1] & ((s[1:] != s[:-1]) | (d[1:] != d[:-1]))
    start = np.ones(n, bool)
    start[1:] = ~valid | changed
    half = slot_bytes // 2
    first, runs, run_bytes, stride, span = _groups(start, s, length)
    if bool((span > half).any()):
        # At most half a slot of span per group, so that packing (below) fills a slot at most.
        rows_max = np.where(stride > 0, np.maximum(1, (half - run_bytes) // np.maximum(stride, 1) + 1), n)
        group = np.cumsum(start) - 1
        start |= (np.arange(n) - first[group]) % rows_max[group] == 0
        first, runs, run_bytes, stride, span = _groups(start, s, length)
    wide = (runs > 1) & (span <= half) & (cost.wide_s(span, runs * run_bytes) < cost.exact_s(runs, runs * run_bytes))
    if not wide.any():
        return [t]
    exact_seg = np.repeat(~wide, runs)
    scratch = np.where(wide, -(-span // _ALIGN) * _ALIGN, 0)
    at = np.cumsum(scratch) - scratch  # each group's scratch offset, were all READs one
    piece = at // half  # a READ's groups start in one half slot: at most two halves of span in all
    out = []
    bounds = np.flatnonzero(np.diff(piece, prepend=-1)).tolist() + [len(first)]
    for g0, g1 in itertools.pairwise(bounds):
        seg0, seg1 = int(first[g0]), int(first[g1]) if g1 < len(first) else n
        rows = slice(seg0, seg1)
        exact_rows = np.flatnonzero(exact_seg[rows]) + seg0
        w = np.flatnonzero(wide[g0:g1]) + g0
        nbytes = int(length[rows].sum())
        if not len(w):
            out.append(Transfer(t.replica_id, t.local[rows], t.remote[rows], nbytes, t.h_off[rows]))
            continue
        offset = (at[w] - piece[w] * half).astype(np.uint64)
        f = first[w]
        local = np.concatenate([t.local[exact_rows],
                                np.stack([offset, span[w].astype(np.uint64), np.zeros(len(w), np.uint64)], 1)])
        remote = np.concatenate([t.remote[exact_rows],
                                 np.stack([t.remote[f, 0], span[w].astype(np.uint64), t.remote[f, 2]], 1)])
        in_scratch = np.zeros(len(local), bool)
        in_scratch[len(exact_rows):] = True
        cuts = np.stack([offset.astype(np.int64), runs[w], run_bytes[w], stride[w], la[f], d[f]], 1)
        read_bytes = int(length[exact_rows].sum() + span[w].sum())
        out.append(Transfer(t.replica_id, t.local[rows], t.remote[rows], nbytes, t.h_off[rows],
                            WidePlan(local, remote, in_scratch, cuts, read_bytes)))
    return out


def _groups(start: np.ndarray, s: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per group of segments (each begins where ``start``): its first segment,
    runs, bytes per run, stride on the holder's side (0 for one run) and span."""
    first = np.flatnonzero(start)
    runs = np.diff(first, append=len(start))
    run_bytes = length[first]
    stride = np.append(s, 0)[first] * (runs > 1)
    return first, runs, run_bytes, stride, (runs - 1) * stride + run_bytes


def cut(plan: WidePlan, slot: Slot) -> None:
    """Copy each wide group's wanted runs out of ``slot`` into the destination."""
    for offset, runs, run_bytes, stride, dest, dest_stride in plan.cuts.tolist():
        src = as_strided(slot.array[offset:], (runs, run_bytes), (stride, 1))
        size = (runs - 1) * dest_stride + run_bytes
        dst = np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(dest))
        np.copyto(as_strided(dst, (runs, run_bytes), (dest_stride, 1)), src)


class WideReads:
    """One pull's wide READs: where the cost model says they pay (per holder:
    ``costs``, None for exact runs only), and the scratch slots they land in.
    Without a pool every READ is its exact runs."""

    def __init__(self, pool: ScratchPool | None = None,
                 costs: Callable[[RemoteReplica], LinkCost | None] | None = None) -> None:
        self.pool = pool
        self._costs = costs
        self._held_ends: dict[str, np.ndarray] = {}
        self._cost: dict[str, LinkCost | None] = {}
        self._slots: dict[int, Slot] = {}  # id(transfer) -> the slot its posted READ lands in

    @property
    def slot_bytes(self) -> int:
        """The scratch a wide READ may fill; 0: every READ is its exact runs."""
        return 0 if self.pool is None or self._costs is None else self.pool.slot_bytes

    def cost(self, replica: RemoteReplica) -> LinkCost | None:
        """The link cost READs from ``replica`` are weighed by; None: exact runs only."""
        if self.pool is None or self._costs is None:
            return None
        rid = replica.source.replica_id
        if rid not in self._cost:
            self._cost[rid] = self._costs(replica)
            self._held_ends[rid] = np.cumsum(replica.regions[:, 1].astype(np.int64))
        return self._cost[rid]

    def plan(self, transfers: list[Transfer], holders: Mapping[str, HolderMap]) -> list[Transfer]:
        """``transfers`` (one chunk's), wide where it pays."""
        if self.pool is None or self._costs is None:
            return transfers
        out: list[Transfer] = []
        for t in transfers:
            cost = self.cost(holders[t.replica_id].replica)
            out.extend([t] if cost is None else widen(t, self._held_ends[t.replica_id], cost, self.pool.slot_bytes))
        return out

    def posted(self, t: Transfer) -> tuple[np.ndarray, np.ndarray]:
        """The (local, remote) descriptors to post for ``t``: wide into a slot if one is free."""
        if t.wide is None or self.pool is None:
            return t.local, t.remote
        slot = self.pool.take()
        if slot is None:
            return t.local, t.remote
        self._slots[id(t)] = slot
        return t.wide.bound(slot), t.wide.remote

    def landed(self, t: Transfer) -> tuple[int, int]:
        """``t``'s READ landed: its wide groups are cut into the destination now.
        Returns (bytes that crossed the link, descriptors posted)."""
        slot = self._slots.pop(id(t), None)
        if slot is None:
            return t.nbytes, len(t.local)
        try:
            cut(t.wide, slot)
        finally:
            self.pool.give(slot)
        return t.wide.read_bytes, len(t.wide.local)

    def ended(self, t: Transfer, *, reusable: bool) -> None:
        """``t``'s READ failed or was let go of; ``reusable``: nothing of it can land later."""
        slot = self._slots.pop(id(t), None)
        if slot is not None:
            (self.pool.give if reusable else self.pool.retire)(slot)
