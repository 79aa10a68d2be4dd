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
  3. reliable before spot;
  4. a reader that already holds the chunk before the origin (the trainer), so
     the trainer's link stops being the bottleneck once copies exist;
  5. less loaded: fewer other readers on it, then fewer chunks of this plan
     already given to it (ties spread evenly).
"""

from __future__ import annotations

from collections.abc import Mapping
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
) -> Assignment:
    """Rank the holders of every chunk; spread ties evenly.

    ``holders[chunk][replica_id]`` is True when that replica can give the whole
    chunk, False when it can give a part of it. Chunks are planned in order.
    """
    usable = {s.replica_id: s for s in sources if s.replica_id not in exclude}
    assigned = dict.fromkeys(usable, 0)
    out = Assignment()
    for chunk in sorted(holders):
        whole = {rid: full for rid, full in holders[chunk].items() if rid in usable}
        if not whole:
            out.unavailable.append(chunk)
            continue
        ranked = sorted(
            whole,
            key=lambda rid: (
                reader.tier(usable[rid].labels),
                not whole[rid],
                usable[rid].reliability is Reliability.SPOT,
                usable[rid].origin,
                usable[rid].active_reads,
                assigned[rid],
                rid,
            ),
        )
        # A whole holder serves the chunk alone; otherwise each part-holder
        # will likely serve a piece of it.
        for rid in ranked[:1] if whole[ranked[0]] else ranked:
            assigned[rid] += 1
        out.order[chunk] = ranked
    return out
