"""Which chunks a reader reads next, and in what order its READs go out. Pure: no I/O, no clock.

    the reader's chunks still needed, ──▶ next_chunks() ──▶ Batch: the chunks to plan now (in order),
    in its order (rotated by agent)                           those taken from filling peers (relayed),
    what each holder has / will hold                          a cap on READs from one complete holder
    (complete or filling, zone)                                    │
                                                                   ▼
                                         planner.choose_sources ranks holders per chunk; the
                                         puller cuts each chunk into READs (readlayout)
                                                                   │
    the READs, per chunk ──▶ by_turns() ──▶ one queue in turns over their holders ──▶ admit(): post
                                                                                       while the
    READs in flight per holder ───────────────────────────────────────────────────────▶ holder has room

Alone (no other reader fills the same version), a reader reads everything,
from the best holders. While a wave of readers fills the same version, the
chunks only complete holders have are shared out (``planner.relay_share``): a
reader reads its own arc of chunks, takes the chunks its zone's filling peers
already hold from them, and waits for the rest instead of racing its peers to
the origin; a chunk no holder of its zone has is owned by the zone's seeds
only, so it crosses the zone boundary once. After ``patience`` runs out
without a chunk landing, it reads whatever is left from wherever it can.

The puller (``client/puller.py``) executes a batch: it leases, posts, polls,
checks, reports and fails over; it asks the server again who holds what
between batches.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import TypeVar

import numpy as np

from tensorhub.planner import relay_share

# While a wave of readers relays (filling peers exist), a reader keeps at most
# this many READs in flight from any one complete holder: every reader of the
# wave shares that holder's link, and the more READs are out on it, the later
# each lands and can be relayed (raw NIXL with a lag-free relay, three readers
# on 1 Gbit/s links, ``tensorhub bench cluster --readers 3``: 2.67-2.69 s with
# one READ per reader on the trainer's link, 2.77-2.83 s with two, 2.97-3.10 s
# with every slot, its rows ``bench.rawrelay``).
ORIGIN_READS_IN_WAVE = 1
# While a wave relays, a reader keeps this many times its READs in flight: they
# spread over its peers' links, each shared with the rest of the wave, so each
# READ lands later than from a holder of its own and more of them keep its link
# busy (16 readers on 100 Mbit/s links, 64 MiB, warm: 15.2-15.3 s with 4 READs
# in flight, 11.6 s with 8, 10.3-10.5 s with 16; ``tensorhub bench cluster
# --readers 1,2,4,8,16`` has the sweep, docs/history/cluster-sweep.md).
WAVE_READS_FACTOR = 4

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class HolderView:
    """One holder as the schedule sees it: ``has[c]``, whether it can give some
    of chunk c now; ``will_hold``, the chunks it has or will have once complete."""

    agent_id: str
    zone: str
    complete: bool
    has: np.ndarray  # bool per chunk of the reader's layout
    will_hold: frozenset[int]


@dataclass(frozen=True, slots=True)
class Batch:
    chunks: list[int]  # to plan and read now, in this order
    relayed: frozenset[int] = frozenset()  # of them, those to take from filling peers of the zone
    origin_cap: int = 0  # READs in flight from one complete holder, at most (0: no cap)


@dataclass(frozen=True, slots=True)
class Wave:
    """What the reader knows of its situation, beside the holders."""

    me: str
    zone: str
    num_chunks: int
    in_flight: int  # READs it keeps in flight, at most
    seeds_per_zone: int = 1
    first: bool = False  # its first batch
    serving: bool = False  # it serves what lands (its chunks are its peers' sources)
    patience_out: bool = False  # no chunk landed for a while: read from anyone
    holders: Sequence[HolderView] = field(default_factory=tuple)


def _any_has(holders: Sequence[HolderView], n: int) -> np.ndarray:
    mask = np.zeros(n, bool)
    for h in holders:
        mask |= h.has
    return mask


def _upstream(complete: Sequence[HolderView], far: Sequence[HolderView], n: int) -> np.ndarray:
    """Per chunk: a filling reader of another zone will hold it, does not yet, and
    sits in the zone of a complete holder of it (it reads it there, near the origin)."""
    near_origin: dict[str, np.ndarray] = {}
    for h in complete:
        near_origin[h.zone] = near_origin.get(h.zone, np.zeros(n, bool)) | h.has
    mask = np.zeros(n, bool)
    for h in far:
        here = near_origin.get(h.zone)
        if here is not None:
            will = np.zeros(n, bool)
            will[list(h.will_hold)] = True
            mask |= here & will & ~h.has
    return mask


def reads_in_flight(base: int, holders: Sequence[HolderView]) -> int:
    """How many READs a reader keeps in flight: ``base`` alone, ``WAVE_READS_FACTOR``
    times that while readers beside it fill the same version (a relaying wave)."""
    return base * WAVE_READS_FACTOR if any(not h.complete for h in holders) else base


def next_chunks(order: Sequence[int], wave: Wave) -> Batch:
    """The next batch of ``order`` (the chunks still needed and not in flight,
    in the reader's order)."""
    order = list(order)
    n = wave.num_chunks
    peers = [h for h in wave.holders if not h.complete]
    if not peers:
        if wave.first and wave.serving:
            # A serving reader's first batch: one chunk, then ask again, by when
            # readers that started with it have registered (else each would take
            # a few chunks from the origin before seeing the others).
            return Batch(order[:1])
        return Batch(order)
    size = 2 * wave.in_flight
    near = [h for h in peers if h.zone == wave.zone]
    at_peers = _any_has(near, n)
    relayable = [c for c in order if at_peers[c]]
    rest = [c for c in order if not at_peers[c]]
    cap = 0
    if wave.patience_out:
        mine = rest
    else:
        cap = ORIGIN_READS_IN_WAVE
        complete = [h for h in wave.holders if h.complete]
        in_zone = _any_has([h for h in complete if h.zone == wave.zone], n)
        upstream = _upstream(complete, [h for h in peers if h.zone != wave.zone], n)
        mine = relay_share(rest, wave.me, {h.agent_id: h.will_hold for h in near}, num_chunks=n,
                           seeds_per_zone=wave.seeds_per_zone, local={c for c in rest if in_zone[c]},
                           upstream={c for c in rest if upstream[c]})
    # While it has chunks of its own share left, a reader gives them their part
    # of every batch (its share of the wave, half its READs at least): else,
    # once its peers hold more than a batch's worth, it reads only from them,
    # the complete holders' links idle and the wave's new bytes stop coming in
    # (found by ``tensorhub bench rl``, elastic).
    own = max(wave.in_flight // 2, -(-size // (len(near) + 1)))
    from_peers = relayable[: size - min(len(mine), own)]
    return Batch(alternate(from_peers, mine[: size - len(from_peers)]), frozenset(from_peers), cap)


def alternate(*lists: Sequence[T]) -> list[T]:
    """The lists' items in turns: [a0, b0, a1, b1, b2, ...]."""
    return [x for group in zip_longest(*lists) for x in group if x is not None]


def by_turns(reads: Mapping[int, Sequence[T]], holder_of: Callable[[T], Hashable]) -> list[tuple[int, T]]:
    """A batch's READs (per chunk) in turns over their holders, each holder's in
    order: a reader's READs in flight spread over the holders it reads from, so
    it takes its share of several links at once instead of queueing on one of
    them (found by ``tensorhub bench rl``, elastic: a joiner posted its READs
    from one peer, then the next, and took half its link)."""
    queues: dict[Hashable, list[tuple[int, T]]] = {}
    for chunk, planned in reads.items():
        for read in planned:
            queues.setdefault(holder_of(read), []).append((chunk, read))
    return alternate(*queues.values())


def admit(holder: K, *, complete: bool, flying: Mapping[K, int], cap: int) -> bool:
    """Whether a READ from ``holder`` may go out now: under the batch's cap on
    READs in flight from one complete holder (``Batch.origin_cap``; 0: none)."""
    return not cap or not complete or flying.get(holder, 0) < cap
