"""The steady state's answer: the holders a reader read before, by layout.

In RL every version comes from the same holders in the same memory, and a
reader pulls it into the same buffers; the holders it read version v from
are the ones to read v+1 from. Such a reader names their layouts
(``ResolveRequest.named_layouts``: ``ReplicaInfo.layout``, which stays put
from one version to the next) and the server answers with the version's
replicas laid out so, and no other: no ranking of every holder, no covering
search, an answer that does not grow with the trainer's ranks.

    Resolve(named_layouts, named_wait_s)
      │
      ├─ the asking group's own layouts (a member read a sibling) ─▶ left out: never waited for
      │
      ├─ every layout has a live replica of the version ──────────▶ those replicas (ResolveResponse.named)
      │
      ├─ some missing, each one's agent alive and not yet holding
      │  the version, none of them waiting so itself, wait left ──▶ wait for the version's next change
      │  (an upstream relay publishes v+1 as its own pull starts)    (``changes``), look again
      │
      └─ else ────────────────────────────────────────────────────▶ None: the usual ranked answer

Why the exceptions do not wait: an agent that is gone, or that holds the
version laid out otherwise (it re-registered its memory, the trainer
resharded), will never publish the layout named; and two relays that read
from each other would each wait for the other's publish, so the later of the
two is answered at once (ranked) and publishes, which ends the other's wait.

Replicas are indexed by layout per version as readers ask (``Version.laid_out``,
fed by the publishes since, ``Version.unindexed``): a lookup each, not a scan.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from tensorhub.server.changes import VersionChanges
from tensorhub.server.state import Replica, Version

_AGENTS_KEPT = 1 << 16  # layout -> agent entries kept for the waits' checks (about 100 B each)


class NamedHolders:
    """``layout_of``: a replica's ``ReplicaInfo.layout`` (the service's, cached per replica)."""

    def __init__(self, layout_of: Callable[[Replica], bytes], changes: VersionChanges) -> None:
        self._layout_of = layout_of
        self._changes = changes
        # Every layout indexed so far -> its agent, and whether it was a trainer's cut (an agent
        # holds one replica of a version of each kind: ``State.publish``)
        self._agent_of: dict[bytes, tuple[str, bool]] = {}
        self._waiting: Counter[str] = Counter()  # agents in a named wait now (the asker and its group's members)

    def laid_out(self, layout: bytes, replica: Replica) -> None:
        """``replica``'s layout, as the service computed it for an answer: whose
        it is, for the waits' checks (a layout named is one an earlier answer sent)."""
        if len(self._agent_of) >= _AGENTS_KEPT:
            self._agent_of.clear()
        self._agent_of[layout] = (replica.agent_id, replica.trainer_cut)

    def find(self, entry: Version, layouts: Sequence[bytes], agents: Mapping[str, object],
             askers: frozenset[str]) -> tuple[list[Replica], list[bytes]]:
        """The live replicas of ``entry`` laid out as ``layouts`` (never an asker's
        own), and the layouts that have none."""
        index = entry.laid_out
        for replica in entry.unindexed:
            if not replica.withdrawn and replica.agent_id in agents:
                index[self._layout_of(replica)] = replica
        entry.unindexed.clear()
        found, missing = [], []
        for key in layouts:
            replica = index.get(key)
            if (replica is None or replica.withdrawn or replica.agent_id not in agents or replica.agent_id in askers
                    or entry.replicas.get(replica.replica_id) is not replica):
                missing.append(key)
            else:
                found.append(replica)
        return found, missing

    def worth_waiting(self, entry: Version, missing: list[bytes], agents: Mapping[str, object]) -> bool:
        """Whether every missing layout may still come: its agent is known and
        alive, holds no replica of the version of that kind yet (one laid out
        otherwise would be its replica of the version), and is not itself waiting."""
        for key in missing:
            agent, cut = self._agent_of.get(key, ("", False))
            if not agent or agent not in agents or self._waiting[agent]:
                return False
            for rid in entry.by_agent.get(agent, ()):
                replica = entry.replicas.get(rid)
                if replica is not None and not replica.withdrawn and replica.trainer_cut == cut:
                    return False
        return True

    async def holders(self, model: str, version: int, entry: Version, layouts: Sequence[bytes], wait_s: float,
                      askers: frozenset[str], agents: Mapping[str, object],
                      expire: Callable[[], None]) -> list[Replica] | None:
        """The replicas to answer with, or None (answer as usual). Waits at most
        ``wait_s`` for missing ones that may still come (see the module's drawing)."""
        deadline = time.monotonic() + wait_s
        # The asking group's own earlier replicas (a TP worker read a sibling's
        # replicated tensors as it filled): none can hold the version before this
        # answer, which the group waits for, so they are neither waited for nor
        # needed; what they gave is in the others, or a refresh finds it.
        layouts = [key for key in layouts if self._agent_of.get(key, ("", False))[0] not in askers]
        if not layouts:
            return None
        while True:
            found, missing = self.find(entry, layouts, agents, askers)
            if not missing:
                return found
            left = deadline - time.monotonic()
            if left <= 0 or not self.worth_waiting(entry, missing, agents):
                return None
            seen = self._changes.seen(model, version)
            self._waiting.update(askers)
            try:
                await self._changes.wait(model, version, seen, left)
            finally:
                self._waiting.subtract(askers)
                for agent in askers:
                    if self._waiting[agent] <= 0:
                        del self._waiting[agent]
            expire()
