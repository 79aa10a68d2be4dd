"""Which path a pull took: replayed (the steady state) or planned, and why.

In RL a reader pulls version after version into the same buffers, from
holders that publish every version from the same buffers in the same
regions. The second time round nothing about the layouts is new, and the
pull only replays what the first one worked out:

    Resolve(known_layouts = holders' layouts this client has)
      │
      ├─ server: a holder whose layout is known ─▶ lean (replica id, layout, state,
      │          checksums: tens of bytes)            otherwise full (regions, memory, NIXL metadata)
      │
      ├─ rpc:    lean holder ─▶ rebound from the earlier holder (nothing decoded)
      │
      ├─ plancache: holder tables, holder maps and per-chunk READs by layout keys
      │          (lean holders keep theirs) ─▶ reused, READs rebound to v+1's replica ids
      │
      └─ here:   every holder read was lean, and every chunk's READs came from
                 the cache ─▶ REPLAYED; else PLANNED, with the first reason below

Whatever changed falls back to the full path by itself, because keys are
contents: a holder that re-registered its memory (other addresses, other NIXL
metadata), joined, or publishes other regions has another layout and comes
full; a reader with other buffers has another layout signature; a lost holder
leaves the chunks it held to be planned afresh. A replayed pull reads only
holders of the version it resolved: the server answers v+1's replicas and no
other, and a chunk plan names the replica ids of this answer.

Pure: no I/O, no clock. ``PullJob`` counts, ``Hub.pull`` asks ``path_of``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

REPLAYED = "replayed"
PLANNED = "planned"
DELTA = "delta"


@dataclass(frozen=True, slots=True)
class PullPath:
    path: str  # REPLAYED, PLANNED or DELTA
    why: str = ""  # for PLANNED: why the earlier plans could not be replayed

    @property
    def replayed(self) -> bool:
        return self.path == REPLAYED


def path_of(*, earlier_pulls: int, holders_read: Iterable[tuple[str, bool]], lost: list[str],
            plans_made: int) -> PullPath:
    """``earlier_pulls``: pulls into the same reader layout before this one;
    ``holders_read``: (agent name, sent lean) of every holder a byte was read from;
    ``lost``: holders lost mid-pull; ``plans_made``: chunk plans not found in the cache."""
    if earlier_pulls == 0:
        return PullPath(PLANNED, "first pull into this destination layout")
    if lost:
        return PullPath(PLANNED, f"{len(lost)} holder(s) lost mid-pull: {', '.join(sorted(lost)[:4])}")
    new = sorted({name for name, lean in holders_read if not lean})
    if new:
        more = f" and {len(new) - 4} more" if len(new) > 4 else ""
        return PullPath(PLANNED, f"{len(new)} holder(s) with a layout this reader had not seen (joined, "
                                 f"re-registered or re-cut): {', '.join(new[:4])}{more}")
    if plans_made:
        return PullPath(PLANNED, f"{plans_made} chunk plan(s) made afresh (holders ranked otherwise, or filling)")
    return PullPath(REPLAYED)
