"""What pulls work out from layouts alone, kept from one pull to the next.

An RL reader pulls version after version into the same buffers, from
holders that publish every version from the same buffers in the same
regions. Everything a pull plans from those two layouts is then the same
each time: which of the reader's bytes each holder gives (its holder table),
per chunk, and the READs that fill a chunk from a given ranking of holders
(exact segments, cut into checked pieces, widened where the link makes it
pay). For the TP=8 slice of one MoE layer that is a third of a pull's own
time. Only the holders' bitmaps, the ranking and the bytes differ; those are
never cached.

    Hub ── PlanCache ── per reader layout (its signature) ── LayoutPlans
                                                              ├── holder tables, by the holder's layout key
                                                              ├── holder maps of complete holders
                                                              ├── which of a holder's chunks the read set covers whole
                                                              └── chunk READs, by (chunk, ranked holders' keys)

Keys are contents, never names: a reader layout by its parts' tensors,
boxes and local addresses (``signature``); a holder by
``RemoteReplica.layout_key`` (its held regions, memory regions and chunk size;
``rpc`` makes it), so version v+1 from the same buffers finds version v's
plans. A holder without a key (made by hand) is known by its replica id, whose
regions never change while it is published. Cached arrays are read-only: a
caller that tried to write one would fail loudly rather than corrupt the
next pull. Plans of a chunk are kept only when every ranked holder is
complete (a filling one's map changes as it lands).
"""

from __future__ import annotations

import copy
import hashlib
import threading
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import TypeVar

import numpy as np

from tensorhub.client.lru import Lru
from tensorhub.client.readlayout import HolderMap, ReadLayout
from tensorhub.client.rpc import RemoteReplica
from tensorhub.client.transfer import Transfer
from tensorhub.client.verify import Coverage, coverage

V = TypeVar("V")

_LAYOUTS = 4  # reader layouts kept (a rollout pulls into one; a few for tests and side buffers)
_HOLDERS = 32  # holder tables per layout: two versions' worth of a 16-rank trainer
_CHUNK_PLANS = 8192  # chunk plans per layout: a 256 GiB read set in 32 MiB chunks, from one ranking


def signature(layout: ReadLayout) -> bytes:
    """What ``layout``'s plans depend on: its tensors (shapes and sizes), its
    parts' boxes, sizes and local memory, and its chunk size."""
    h = hashlib.blake2b(digest_size=20)
    h.update(layout.manifest.fingerprint.encode())
    h.update(np.array([layout.chunk_size], np.int64).tobytes())
    for arr in layout.signature_arrays():
        h.update(arr.tobytes())
    for p in layout.parts_without_box():  # flat regions: by region or runs
        if p.region is not None:
            h.update(repr((p.tensor, p.region)).encode())
        else:
            runs = p.element_runs()
            h.update(repr(p.tensor).encode())
            for arr in (runs.start, runs.length, runs.offset):
                h.update(arr.tobytes())
    return h.digest()


def holder_key(replica: RemoteReplica) -> Hashable:
    return replica.layout_key or ("replica", replica.source.replica_id)


def _frozen(table: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    for v in table.values():
        v.flags.writeable = False
    return table


class LayoutPlans:
    """One reader layout's plans. Thread-safe: a Hub may pull from several threads."""

    def __init__(self) -> None:
        self._tables: Lru[dict[str, np.ndarray]] = Lru(_HOLDERS)
        self._maps: Lru[HolderMap] = Lru(_HOLDERS)
        self._will_hold: Lru[frozenset[int]] = Lru(_HOLDERS)
        self._coverage: Lru[Coverage] = Lru(_HOLDERS)
        self._chunks: Lru[tuple[tuple[int, Transfer], ...]] = Lru(_CHUNK_PLANS)
        self.pulls = 0  # finished pulls into this layout (``replay.path_of``)

    @staticmethod
    def _cached(lru: Lru[V], key: Hashable, make: Callable[[], V]) -> V:
        value = lru.get(key)
        if value is None:
            value = make()  # unlocked: two threads may both make it, and both get the same
            lru.put(key, value)
        return value

    def table(self, layout: ReadLayout, replica: RemoteReplica) -> dict[str, np.ndarray]:
        """``layout.holder_table(replica)``: it depends only on the two layouts."""
        return self._cached(self._tables, holder_key(replica), lambda: _frozen(layout.holder_table(replica)))

    def holder_map(self, layout: ReadLayout, replica: RemoteReplica, table: dict[str, np.ndarray]) -> HolderMap:
        """``layout.holder_map``; a complete holder's is its table's, whatever its replica object."""
        if not replica.source.complete:
            return layout.holder_map(replica, table)
        m = self._cached(self._maps, holder_key(replica), lambda: layout.holder_map(replica, table))
        if m.replica is not replica:
            m = copy.copy(m)  # shares the arrays; this resolve's view of the holder (its load, its labels)
            m.replica = replica
        return m

    def will_hold(self, layout: ReadLayout, replica: RemoteReplica, table: dict[str, np.ndarray]) -> frozenset[int]:
        """The chunks of the read set ``replica`` has or will have once complete."""
        return self._cached(self._will_hold, holder_key(replica),
                            lambda: frozenset(np.unique(table["r_off"] // layout.chunk_size).tolist()))

    def coverage(self, layout: ReadLayout, replica: RemoteReplica, table: dict[str, np.ndarray]) -> Coverage:
        """Which of ``replica``'s chunks the read set covers whole (``verify.coverage``)."""
        return self._cached(self._coverage, holder_key(replica), lambda: coverage(layout, replica, table))

    def chunk(self, chunk: int, ranked: list[HolderMap], context: Hashable,
              make: Callable[[], list[Transfer] | None]) -> tuple[list[Transfer] | None, bool]:
        """The READs that fill ``chunk`` from ``ranked`` holders (``make`` plans
        them), and whether an earlier plan was reused. ``context``: what else
        they depend on (checks, the link's cost)."""
        if not all(m.replica.source.complete for m in ranked):
            return make(), False
        key = (chunk, tuple(holder_key(m.replica) for m in ranked), context)
        hit = self._chunks.get(key)
        ids = [m.replica_id for m in ranked]
        if hit is not None:  # the same layouts; this version's holders (replica ids) read
            return [t if t.replica_id == ids[i] else replace(t, replica_id=ids[i]) for i, t in hit], True
        planned = make()
        if planned is not None:
            at = {rid: i for i, rid in enumerate(ids)}
            self._chunks.put(key, tuple((at[t.replica_id], t) for t in planned))
        return planned, False


class PlanCache:
    """A Hub's plans, by reader layout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one LayoutPlans per layout, even when two threads ask at once
        self._layouts: Lru[LayoutPlans] = Lru(_LAYOUTS)

    def plans(self, layout: ReadLayout) -> LayoutPlans:
        key = signature(layout)
        with self._lock:
            plans = self._layouts.get(key)
            if plans is None:
                plans = LayoutPlans()
                self._layouts.put(key, plans)
        return plans
