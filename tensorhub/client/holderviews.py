"""The holders of a version as one pull sees them, kept across its rounds.

    the server's answer ──▶ maps(replicas, excluded) ──▶ per holder of some of the read set: its
    (a filling holder merged                            HolderMap (readlayout), from its holder table,
     with its peers' news)                              made once (its regions never change) and handed
    peers' news since ────▶ hear(maps) ──────────────▶  to the checks; a filling one's map anew
                                                             │
                                                             ▼
                                     views(maps, now) ──▶ schedule.HolderView: what it has now, the
                                                          chunks it will hold (once), whether it grows
                                                          (schedule.growing, from the times it is shown)

``PullJob`` (``puller``) asks for them each round and hands the views to
``schedule.next_chunks``; the tables come from ``plancache.LayoutPlans``, so
pulls into the same layout share them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from tensorhub.client.peernews import PullNews
from tensorhub.client.plancache import LayoutPlans
from tensorhub.client.readlayout import HolderMap, ReadLayout
from tensorhub.client.rpc import RemoteReplica
from tensorhub.client.verify import ChunkVerifier
from tensorhub.schedule import HolderView, growing


@dataclass(kw_only=True, slots=True)
class HolderViews:
    layout: ReadLayout
    plans: LayoutPlans
    checks: ChunkVerifier
    news: PullNews | None = None  # chunk news with the relaying peers; None: only the server says who has what
    _tables: dict[str, dict] = field(default_factory=dict)  # holder tables by replica id: regions never change
    _will_hold: dict[str, frozenset[int]] = field(default_factory=dict)  # chunks of the read set, by replica id
    _peer_counts: dict[str, tuple[int, float]] = field(default_factory=dict)  # filling holder -> (chunks, since when)

    def maps(self, replicas: Iterable[RemoteReplica], excluded: set[str]) -> dict[str, HolderMap]:
        """What each holder can give of the read set now; holders of none of it are dropped
        (complete ones: a filling one will hold some)."""
        out = {}
        filling = []
        for r in replicas:
            rid = r.source.replica_id
            if rid in excluded:
                continue
            if not r.source.complete and self.news is not None:
                r = self.news.merged(r)  # what news said of it since (never less)
                filling.append(r)
            table = self._tables.get(rid)
            if table is None:
                table = self._tables[rid] = self.plans.table(self.layout, r)
                if self.checks.enabled:
                    self.checks.add_holder(r, table, self.plans.coverage(self.layout, r, table))
            else:
                self.checks.refresh(r)
            if len(table["r_off"]):
                m = self.plans.holder_map(self.layout, r, table)
                # A filling reader that has landed nothing yet stays: it takes its
                # share of the wave (relay_share) from its first round on. Dropped,
                # the readers of a wave each read others' shares from the complete
                # holder until every one of them had landed a chunk.
                if len(m.chunk) or not r.source.complete:
                    out[rid] = m
        if self.news is not None:
            self.news.know(filling)
            # The filling holders it may read from tell it their chunks (subscriptions, ``peernews``).
            self.news.subscribe(m.replica for m in out.values() if not m.replica.source.complete)
        return out

    def hear(self, maps: dict[str, HolderMap]) -> dict[str, HolderMap]:
        """``maps`` with the chunk news that came since: the peers' holder maps
        as their news says (``maps`` itself when none came)."""
        if self.news is None:
            return maps
        updates = self.news.updates({rid: m.replica for rid, m in maps.items()})
        if not updates:
            return maps
        maps = dict(maps)
        for rid, replica in updates.items():
            self.checks.refresh(replica)
            maps[rid] = self.plans.holder_map(self.layout, replica, self._tables[rid])
        return maps

    def views(self, usable: Iterable[HolderMap], now: float) -> list[HolderView]:
        """The holders as the schedule sees them (``schedule.HolderView``) at ``now``."""
        return [HolderView(m.replica.agent_id, m.replica.source.labels.zone, m.replica.source.complete,
                           m.covered > 0, self._chunks_of(m), self._growing(m, now)) for m in usable]

    def _growing(self, holder: HolderMap, now: float) -> bool:
        """Whether a holder is complete or landed a chunk lately (``schedule.growing``)."""
        if holder.replica.source.complete:
            return True
        rid = holder.replica_id
        grows, self._peer_counts[rid] = growing(int(np.count_nonzero(holder.covered)), self._peer_counts.get(rid), now)
        return grows

    def _chunks_of(self, holder: HolderMap) -> frozenset[int]:
        """The chunks of the read set a holder has or will have once it is complete."""
        held = self._will_hold.get(holder.replica_id)
        if held is None:
            held = self._will_hold[holder.replica_id] = self.plans.will_hold(
                self.layout, holder.replica, self._tables[holder.replica_id])
        return held
