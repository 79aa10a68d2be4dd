"""Which holders to read each chunk from, best first. Pure Python, no I/O.

    resolve (server)             ReadLayout (client/readlayout.py)       choose_sources()
    holders: labels, load,  ───▶ per chunk of the reader's bytes, which ───▶ per chunk: holders
    held regions, bitmaps        holders can give all of it or a part        ranked best first
                                                                                   │
    puller: the first holder gives what it has of the chunk, the next the  ◀──────┘
    rest, ...; a failed holder is excluded and the chunk planned again

A holder ranks before another when it is
  1. nearer: same host, then rack, then zone, then elsewhere;
  2. able to give the whole chunk (one read instead of several);
     among those, the one the schedule picked for the chunk (a chain's
     upstream peer, ``schedule.chain_owners``) first; but a holder of a part
     that needs fewer READ descriptors (rule 5's powers of 8) than every whole
     holder of its tier ranks before them: it gives its part exactly, they the
     rest (trainer-cut holders that hold a chunk's tensors between them, one
     run each, before a row shard that holds the chunk as a run per row and
     would be read wide: more bytes than the reader's);
  3. reliable before spot;
  4. a reader that already holds the chunk before the origin (the trainer), so
     the trainer's link stops being the bottleneck once copies exist;
  5. laid out like the reader: fewer READ descriptors for the chunk, counted
     in powers of 8 (a relay cut like the reader gives a column slice in a few
     contiguous runs, a holder of whole rows in one run per row), so the strided
     first hop is paid once and the engines after it relay in bulk;
  6. less loaded: fewer other readers on it, then fewer chunks of this plan
     already given to it (ties spread evenly).
A holder already serving ``cap`` readers or more ranks after every nearer-or-equal
holder under the cap (a soft cap: it still serves when nobody else can).

Readers that fill the same version together in one zone form a chain
(``schedule.chain_owners``). Across zones they split the work (``relay_share``):
each owns an equal arc of the ring of chunks, reads its own arc from the origin and
the rest from the peers that own it, as those chunks land. Per zone: a chunk no
holder in the reader's zone has is owned only by the zone's first
``seeds_per_zone`` readers, so it crosses the zone boundary about once.

Before any of that the server narrows a version's holders to the few this reader
should know of (``best_holders``): with a thousand holders a reader costs O(k).

    all live holders ──▶ rank: tier, spot, origin, load, a per-reader hash ──▶ first k
                                                                                │
    + complete holders, best first, until the complete ones cover the version ◀─┘
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tensorhub.topology import Labels, Reliability


@dataclass(frozen=True, slots=True)
class Source:
    """One replica a reader may read from, as the planner sees it."""

    replica_id: str
    agent_name: str
    labels: Labels
    reliability: Reliability = Reliability.RELIABLE
    complete: bool = True
    origin: bool = False
    active_reads: int = 0
    # The holder's agent: equal holders are spread by it, so a reader is told of
    # the same agents version after version (their layouts it knows: ``replay``).
    # Empty: the replica id stands in.
    agent_id: str = ""


@dataclass(slots=True)
class Assignment:
    """For each chunk, its holders best first. ``unavailable`` lists chunks no
    usable holder has any part of."""

    order: dict[int, list[str]] = field(default_factory=dict)
    unavailable: list[int] = field(default_factory=list)

    def primary_load(self) -> dict[str, int]:
        load: dict[str, int] = {}
        for sources in self.order.values():
            load[sources[0]] = load.get(sources[0], 0) + 1
        return load


def choose_sources(
    holders: Mapping[int, Mapping[str, bool]],
    sources: list[Source],
    reader: Labels,
    *,
    exclude: frozenset[str] = frozenset(),
    cap: int = 0,
    relayed: frozenset[int] | set[int] = frozenset(),
    runs: Mapping[str, Sequence[int]] | None = None,
    prefer: Mapping[int, str] | None = None,
) -> Assignment:
    """Rank the holders of every chunk; spread ties evenly.

    ``holders[chunk][replica_id]`` is True when that replica can give the whole
    chunk, False when it can give a part of it. Chunks are planned in order.
    ``cap`` > 0: holders with that many active readers or more rank after the
    others of their tier.
    ``relayed``: chunks the reader takes from readers filling the version beside
    it (pipeline replication): for those, a filling holder of the whole chunk
    ranks before complete ones, spot or not. Else every reader of a wave of spot
    joiners ranks the one reliable complete holder first and they all queue on
    its link, while their peers' chunks sit unread. Among the filling holders,
    the least loaded (active readers, then this plan's chunks) ranks first,
    reliable or spot: when a reliable rollout fills the same version ahead of a
    wave of spot joiners, ranking it first put three joiners' relayed chunks on
    its one link while the joiners' own links idled (4.1-4.9 s joins against
    2.9-3.1 s, ``tensorhub bench rl scenario=elastic``).
    ``runs[replica_id][chunk]``: the READ descriptors that holder needs for
    its part of the chunk (``HolderMap.segments``); absent, every holder counts alike.
    ``prefer[chunk]``: the holder the schedule picked for a relayed chunk (the
    reader's upstream peer in a chain, ``schedule.chain_owners``); it ranks first
    among the nearest holders that give the whole chunk.
    """
    prefer = prefer or {}
    usable = {s.replica_id: s for s in sources if s.replica_id not in exclude}
    assigned = dict.fromkeys(usable, 0)
    out = Assignment()
    for chunk in sorted(holders):
        whole = {rid: full for rid, full in holders[chunk].items() if rid in usable}
        if not whole:
            out.unavailable.append(chunk)
            continue
        tier = {rid: (reader.tier(usable[rid].labels), cap > 0 and usable[rid].active_reads >= cap) for rid in whole}
        cost = {rid: _layout_cost(runs, chunk, rid) for rid in whole}
        shape = _shapes(whole, tier, cost)
        ranked = sorted(
            whole,
            key=lambda rid: (
                *tier[rid],
                shape[rid],
                prefer.get(chunk, rid) != rid,
                chunk in relayed and usable[rid].complete,
                usable[rid].active_reads + assigned[rid] if chunk in relayed else 0,
                usable[rid].reliability is Reliability.SPOT,
                usable[rid].origin,
                cost[rid],
                usable[rid].active_reads,
                assigned[rid],
                rid,
            ),
        )
        # Each holder up to the first whole one will likely serve a piece of
        # the chunk (a whole holder first serves it alone); none after it.
        for rid in ranked:
            assigned[rid] += 1
            if whole[rid]:
                break
        out.order[chunk] = ranked
    return out


def _shapes(whole: Mapping[str, bool], tier: Mapping[str, tuple], cost: Mapping[str, int]) -> dict[str, int]:
    """Rule 2 for each holder of a chunk: 1 for a holder of the whole chunk; 0
    for a holder of a part that needs fewer READ descriptors (by a power of 8,
    ``_layout_cost``) than every whole holder of its tier, so it gives its part
    exactly before those give the rest; 2 for any other part. (Two trainer-cut
    holders that each hold one tensor of a chunk, one contiguous run each,
    beside a row shard that holds the whole chunk as a run per row: ranked
    first as the whole holder, the shard was read wide, 1.5x the chunk's bytes.)"""
    least: dict[tuple, int] = {}
    for rid, full in whole.items():
        if full:
            least[tier[rid]] = min(cost[rid], least.get(tier[rid], cost[rid]))
    return {rid: 1 if full else 0 if cost[rid] < least.get(tier[rid], cost[rid] + 1) else 2
            for rid, full in whole.items()}


def _layout_cost(runs: Mapping[str, Sequence[int]] | None, chunk: int, rid: str) -> int:
    """A holder's descriptors for ``chunk`` in powers of 8: 1-7 runs 0, 8-63 1, ..., 4,096 and more 4+."""
    counts = None if runs is None else runs.get(rid)
    n = 1 if counts is None or chunk >= len(counts) else int(counts[chunk])
    return (max(1, n).bit_length() - 1) // 3


def best_holders(
    candidates: list[Source],
    reader: Labels,
    k: int,
    *,
    salt: str,
    covers: Callable[[list[Source]], bool],
) -> list[Source]:
    """The holders a reader is told of: the ``k`` best for it, best first, then
    as many more complete holders (best first) as it takes for the complete ones
    among them to cover the version (``covers``), so a pull never misses a region
    that some holder outside the k has.

    Best: nearer, reliable before spot, readers before the origin (the trainer's
    link is the scarce one), fewer active readers. Equal holders are ordered by a
    hash of (``salt``, holder's agent id): each reader (salt = its agent id) gets
    its own spread of equally good holders, and one reader always gets the same
    ones, also for the next version from the same holders (the steady state).
    """
    if k <= 0 or len(candidates) <= k:
        return list(candidates)

    seed = zlib.crc32(f"{salt}/".encode())  # crc32 of (salt/ + id), without building that string per holder
    tier = reader.tier

    def key(s: Source) -> tuple:
        return (tier(s.labels), s.reliability is Reliability.SPOT, s.origin, s.active_reads,
                zlib.crc32((s.agent_id or s.replica_id).encode(), seed))

    ranked = sorted(candidates, key=key)
    chosen = ranked[:k]
    complete = [s for s in chosen if s.complete]
    if covers(complete):
        return chosen
    for s in ranked[k:]:
        if s.complete:
            chosen.append(s)
            complete.append(s)
            if covers(complete):
                break
    return chosen


def ring_offset(agent_id: str, num_chunks: int) -> int:
    """Where a reader's arc of the chunk ring starts (every reader computes the same)."""
    return zlib.crc32(agent_id.encode()) % max(1, num_chunks)


def relay_share(
    chunks: list[int],
    me: str,
    zone_peers: Mapping[str, frozenset[int]],
    *,
    num_chunks: int,
    local: frozenset[int] | set[int],
    upstream: frozenset[int] | set[int] = frozenset(),
    seeds_per_zone: int = 1,
) -> list[int]:
    """Of ``chunks`` (in order), those this reader reads itself from wherever
    they are; it waits for the rest to land at a peer of its zone.

    ``zone_peers``: the other readers of this reader's zone that are filling the
    version, each with the chunks it will hold. ``local``: chunks some complete
    holder in this zone has (the trainer, when it is in the zone). ``upstream``:
    chunks no holder here has that a reader in the origin's zone will hold but
    does not yet; nobody here reads them from the origin, the seed takes them
    from that reader once they land (so the origin sends each byte about once).

      local chunk    ─▶ ring over the zone's filling readers: the arc's owner reads it
      upstream chunk ─▶ nobody yet: it is on its way to a reader in the origin's zone
      remote chunk   ─▶ ring over the zone's seeds only (the first ``seeds_per_zone``
                        readers by hash): one crossing of the zone boundary per chunk
      owner will never hold it (its read set lacks it) ─▶ the next reader round the
                        ring that will (no seed will: the zone's ring decides)
    """
    members = sorted(set(zone_peers) | {me}, key=lambda a: (zlib.crc32(a.encode()), a))
    seeds = members[: max(1, seeds_per_zone)]
    n = max(1, num_chunks)

    def will_hold(agent: str, c: int) -> bool:
        return agent == me or c in zone_peers.get(agent, frozenset())

    def owner(group: list[str], c: int) -> str | None:
        """The arc's owner (equal arcs, in hash order), or the next reader round
        the ring that will hold the chunk."""
        start = (c % n) * len(group) // n
        for step in range(len(group)):
            agent = group[(start + step) % len(group)]
            if will_hold(agent, c):
                return agent
        return None

    mine = []
    for c in chunks:
        if c in local:
            who = owner(members, c)
        elif c in upstream:
            continue
        else:
            who = owner(seeds, c) or owner(members, c)
        if who == me:
            mine.append(c)
    return mine
