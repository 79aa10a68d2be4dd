"""Which chunk to read from which source. Pure Python, no I/O.

    plan (from the server)         choose_sources()                 puller
    replicas + bitmaps + load ───▶ rank each holder of a chunk ───▶ reads chunk from
    reader's labels                 (tier, reliability, role,        the first source,
    chunks still needed             load incl. this plan)            falls back in order

A source ranks before another when it is
  1. nearer: same host, then rack, then zone, then elsewhere;
  2. reliable before spot;
  3. a reader that already holds the chunk before the origin (the trainer), so
     the trainer's link stops being the bottleneck once copies exist;
  4. less loaded: fewer other readers on it, then fewer chunks of this plan
     already given to it (ties spread evenly).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tensorhub.chunks import bitmap_has
from tensorhub.topology import Labels, Reliability


@dataclass(frozen=True, slots=True)
class Source:
    """One replica a reader may read from, as the planner sees it."""

    replica_id: str
    agent_name: str
    labels: Labels
    reliability: Reliability = Reliability.RELIABLE
    complete: bool = True
    bitmap: bytes = b""
    origin: bool = False
    active_reads: int = 0

    def has(self, chunk: int) -> bool:
        return self.complete or bitmap_has(self.bitmap, chunk)


@dataclass(slots=True)
class Assignment:
    """For each chunk, its sources best first. ``unavailable`` lists chunks no
    source holds."""

    order: dict[int, list[str]] = field(default_factory=dict)
    unavailable: list[int] = field(default_factory=list)

    def primary_load(self) -> dict[str, int]:
        load: dict[str, int] = {}
        for sources in self.order.values():
            load[sources[0]] = load.get(sources[0], 0) + 1
        return load


def choose_sources(
    chunks: Iterable[int],
    sources: list[Source],
    reader: Labels,
    *,
    exclude: frozenset[str] = frozenset(),
) -> Assignment:
    """Rank the holders of every chunk in ``chunks``; spread ties evenly."""
    usable = [s for s in sources if s.replica_id not in exclude]
    assigned = {s.replica_id: 0 for s in usable}
    out = Assignment()
    for chunk in chunks:
        holders = [s for s in usable if s.has(chunk)]
        if not holders:
            out.unavailable.append(chunk)
            continue
        holders.sort(
            key=lambda s: (
                reader.tier(s.labels),
                s.reliability is Reliability.SPOT,
                s.origin,
                s.active_reads,
                assigned[s.replica_id],
                s.replica_id,
            )
        )
        assigned[holders[0].replica_id] += 1
        out.order[chunk] = [s.replica_id for s in holders]
    return out
