"""Which chunks a reader reads next, and in what order its READs go out. Pure: no I/O, no clock.

    the reader's chunks still needed, ──▶ next_chunks() ──▶ Batch: the chunks to plan now (in order),
    in its order (reader_order: turned                        those taken from filling peers (relayed),
    by agent); what each holder has /                         a cap on READs from one complete holder
    will hold (complete or filling, zone,                          │
    growing: still landing chunks)                                 ▼
                                         planner.choose_sources ranks holders per chunk; the
                                         puller cuts each chunk into READs (client/roundplan)
                                                                   │
    the READs, per chunk ──▶ PostQueue: by_turns() ──▶ take(): the next READ whose holder has room
                             one queue in turns over       (admit()), held-back ones first;
                             their holders                 cut(): only the chunks begun
    READs in flight per holder ─────────────────────────────────▲
                                                                 round_over(): the round returns,
                                                                 its last READs carried to the next

Alone (no other reader fills the same version), a reader reads everything,
from the best holders. While a wave of readers fills the same version:

* in one zone (every holder in the reader's zone), a wave of
  ``CHAIN_MIN_READERS`` readers or more (``Wave.wave_readers``: the wave its
  last pull saw, where it sees only the peers it names) is a chain
  (``chain_owners``): the readers in one order (by hash), each reads every
  chunk from the nearest reader before it that will hold the chunk and is not
  behind it, as those chunks land; the first reads from the origin. Each link
  then carries one stream in and one out, at its full rate, and the trainer
  sends one copy; a reader that joins late is behind everybody and goes last.

      origin ──▶ r_a ──▶ r_b ──▶ r_c ──▶ ...      (a newcomer: ... ──▶ r_new)

* across zones, or in a shorter wave, the chunks only complete holders have are shared out
  (``planner.relay_share``): a reader reads its own arc of chunks, takes the
  chunks its zone's filling peers already hold from them, and waits for the
  rest instead of racing its peers to the origin; a chunk no holder of its
  zone has is owned by the zone's seeds only, so it crosses the zone boundary once.

Sharing, after ``patience`` runs out without a chunk landing, a reader
reads whatever is left from wherever it can; in a chain, an upstream peer that
stops landing chunks (``HolderView.growing``) stops being waited for instead.

The puller (``client/puller.py``) executes a batch: it leases, posts, polls,
checks, reports and fails over; it asks the server again who holds what
between batches.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Generic, TypeVar

import numpy as np

from tensorhub.planner import relay_share, ring_offset

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
# --readers 1,2,4,8,16`` has the sweep, docs/history/cluster.md).
WAVE_READS_FACTOR = 4
# A chain waits for an upstream peer's chunks while that peer landed one within
# this long (the puller says so in ``HolderView.growing``). Longer than the
# reader's own patience: the last of 16 readers gets its first chunk after 15
# hops, each a chunk's transfer plus a report and a resolve.
CHAIN_PATIENCE_S = 3.0
# In a chain a reader keeps at most this many READs in flight from one holder:
# READs in flight together on one link land together, and a chunk is passed on
# only once it has landed. Two: one landing while the next is on its way (16 in
# flight on a 50 Mbit/s link landed in bursts of 13-16 chunks every 1.2-1.4 s,
# and the next reader in the chain waited for each burst; ``tensorhub bench
# cluster --readers 2 --link 50mbit``).
CHAIN_READS_PER_HOLDER = 2
# A wave of fewer readers shares the chunks out instead of forming a chain:
# every hop of a chain adds a report and a resolve to the chunk's way, and in a
# short wave that costs more than the shares' crowded links. ``tensorhub bench
# rl scenario=elastic`` (a wave of 3 joiners beside a rollout that stayed, 1
# Gbit/s): joins 2.54-2.57 s with shares against 2.69-2.74 s as a chain (a lone
# copy 2.29-2.31 s); ``tensorhub bench cluster --readers 4`` (1 Gbit/s): 2.91 s
# against 2.95 s. At 8 readers and more the chain is ahead (``--readers
# 1,2,4,8,16``, docs/history/cluster.md); 6 was not measured both ways.
CHAIN_MIN_READERS = 6

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
    # A filling holder that landed a chunk lately (``CHAIN_PATIENCE_S``): a
    # chain waits for its chunks; one that did not is read only for what it has.
    growing: bool = True


@dataclass(frozen=True, slots=True)
class Batch:
    chunks: list[int]  # to plan and read now, in this order
    relayed: frozenset[int] = frozenset()  # of them, those to take from filling peers of the zone
    origin_cap: int = 0  # READs in flight from one complete holder, at most (0: no cap)
    peer_cap: int = 0  # READs in flight from one filling holder, at most (0: no cap)
    prefer: Mapping[int, str] = field(default_factory=dict)  # relayed chunk -> the peer (agent) to read it from


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
    held: int = 0  # chunks of its read set it has landed (how far along it is, for the chain)
    # The wave's length where the reader does not see all of it: an answer
    # naming the holders it read from before (the steady state) lists those
    # alone, one filling peer of a chain, say; the wave its previous pull saw
    # is the one it is in again (0: the holders it sees are the wave)
    wave_readers: int = 0


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


def reader_order(chunks: Iterable[int], me: str, num_chunks: int) -> list[int]:
    """``chunks`` in reader ``me``'s order: from its place on the ring of chunks
    (``planner.ring_offset``) round, so readers that start together begin at different chunks."""
    start = ring_offset(me, num_chunks)
    return sorted(chunks, key=lambda c: (c - start) % max(1, num_chunks))


def growing(count: int, seen: tuple[int, float] | None, now: float) -> tuple[bool, tuple[int, float]]:
    """Whether a filling holder that has ``count`` chunks of the read set landed
    a chunk within ``CHAIN_PATIENCE_S`` (``HolderView.growing``); ``seen``: its
    count and since when, as last returned (None: first seen now). Returns that
    and what to keep for the next call."""
    if seen is None or count > seen[0]:
        seen = (count, now)
    return now - seen[1] <= CHAIN_PATIENCE_S, seen


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
    # A steady (named) reader sees only the peers it read from, yet it is in a
    # chain all the same: taken for a short wave, it read a share from the
    # origin beside its one peer every version (11-25 of 64 chunks at 8 readers,
    # the trainer sending 1.3-1.6 copies; ``tensorhub bench cluster --readers 8 --versions 4``).
    readers = max(len(peers) + 1, wave.wave_readers)
    if readers >= CHAIN_MIN_READERS and all(h.zone == wave.zone for h in wave.holders):
        return _chained(order, wave, peers, size)
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


def chain_order(agents: Sequence[str]) -> list[str]:
    """The order of a wave's chain: the same for every reader of the wave."""
    return sorted(agents, key=lambda a: (zlib.crc32(a.encode()), a))


def chain_owners(me: str, held: int, peers: Sequence[HolderView], num_chunks: int,
                 slack: int = 0) -> list[HolderView | None]:
    """Per chunk, the peer a reader of a one-zone wave takes it from: the
    nearest before it in the chain's order (``chain_order``) that will hold the
    chunk and either has it or is ``growing`` and not behind the reader by more
    than ``slack`` chunks (the reader has ``held``); None where none does (the
    reader reads the chunk itself). A peer behind it (one that joined later) or
    stuck is not waited for. The slack: what the server says a peer holds lags
    what it holds by a report and a resolve, and a reader just behind it in the
    chain catches up to that often."""
    by_agent = {h.agent_id: h for h in peers}
    agents = chain_order([me, *by_agent])
    upstream = [by_agent[a] for a in reversed(agents[: agents.index(me)])]  # nearest first
    owner = np.full(num_chunks, -1)
    for k, h in enumerate(upstream):
        will = np.zeros(num_chunks, bool)
        will[[c for c in h.will_hold if c < num_chunks]] = True
        eligible = will & (h.has if int(h.has.sum()) < held - slack or not h.growing else True)
        owner[(owner < 0) & eligible] = k
    return [upstream[k] if k >= 0 else None for k in owner.tolist()]


def _chained(order: list[int], wave: Wave, peers: list[HolderView], size: int) -> Batch:
    """``next_chunks`` for a one-zone wave: the chain (see the module's
    docstring). A chunk an upstream peer will hold waits for it; one no upstream
    peer will hold is the reader's own (from any peer that has it, else the
    origin). READs in flight from one holder: ``CHAIN_READS_PER_HOLDER``; a
    reader with peers before it reads the origin only for what they will not
    hold, one READ at a time (``ORIGIN_READS_IN_WAVE``). The reader's own
    patience does not apply: a chain's last readers wait longer than it for
    their first chunk, and an upstream peer that stops landing chunks stops
    being waited for."""
    owners = chain_owners(wave.me, wave.held, peers, wave.num_chunks, slack=size)
    at_peers = _any_has(peers, wave.num_chunks)
    relayed: list[int] = []
    prefer: dict[int, str] = {}
    mine: list[int] = []
    for c in order:
        owner = owners[c]
        if owner is None:
            (relayed if at_peers[c] else mine).append(c)
        elif owner.has[c]:
            relayed.append(c)
            prefer[c] = owner.agent_id
    from_peers = relayed[:size]
    first = chain_order([wave.me, *(h.agent_id for h in peers)])[0] == wave.me
    return Batch(alternate(from_peers, mine[: size - len(from_peers)]), frozenset(from_peers),
                 CHAIN_READS_PER_HOLDER if first else ORIGIN_READS_IN_WAVE, CHAIN_READS_PER_HOLDER,
                 {c: prefer[c] for c in from_peers if c in prefer})


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


def admit(holder: K, *, complete: bool, flying: Mapping[K, int], cap: int, peer_cap: int = 0) -> bool:
    """Whether a READ from ``holder`` may go out now: under the batch's cap on
    READs in flight from one complete holder (``Batch.origin_cap``), or from one
    filling holder (``Batch.peer_cap``); 0: no cap."""
    limit = cap if complete else peer_cap
    return not limit or flying.get(holder, 0) < limit


class PostQueue(Generic[K, T]):
    """A round's READs in the order they go out: in turns over their holders
    (``by_turns``); a READ whose holder has its cap out (``admit``) is held
    back, and held-back ones go first once their holder has room. ``cut``
    drops the READs of chunks not begun (the round's time is up: a chunk posted
    in part is read again whole next round, the bytes of its landed pieces twice)."""

    def __init__(self, reads: Mapping[int, Sequence[T]], holder_of: Callable[[T], K], *,
                 complete: Mapping[K, bool], cap: int, peer_cap: int = 0) -> None:
        self._todo = iter(by_turns(reads, holder_of))
        self._held: list[tuple[int, T]] = []
        self._holder_of, self._complete, self._cap, self._peer_cap = holder_of, complete, cap, peer_cap

    def _room(self, read: T, flying: Callable[[K], int]) -> bool:
        holder = self._holder_of(read)
        return admit(holder, complete=self._complete[holder], cap=self._cap, peer_cap=self._peer_cap,
                     flying={holder: flying(holder)})

    def take(self, flying: Callable[[K], int]) -> tuple[int, T] | None:
        """The next ``(chunk, READ)`` to post, given the READs in flight per
        holder (``flying``); None when every READ left is held back, or none is."""
        for i, item in enumerate(self._held):
            if self._room(item[1], flying):
                return self._held.pop(i)
        for item in self._todo:
            if self._room(item[1], flying):
                return item
            self._held.append(item)
        return None

    @property
    def held_back(self) -> bool:
        """Whether READs wait for their holders' room (they go as that holder's READs land)."""
        return bool(self._held)

    def cut(self, begun: set[int]) -> None:
        """Keep only the READs of the chunks ``begun``."""
        self._todo = iter([item for item in self._todo if item[0] in begun])
        self._held[:] = [item for item in self._held if item[0] in begun]


def round_over(flying: int, slots: int, *, posting: bool, carry: bool, landed_any: bool) -> bool:
    """Whether a round returns with ``flying`` READs still in flight: none
    flies; or, ``carry``ing them to the next round, every READ is posted
    (``posting`` over), some landed, and at most half its ``slots`` fly (the
    links never drain between rounds)."""
    return not flying or (carry and not posting and landed_any and flying <= slots // 2)
