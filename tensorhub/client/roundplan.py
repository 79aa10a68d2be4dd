"""The READs that fill a round's chunks, and from whom. No I/O.

    the round's chunks, in order ──▶ planner.choose_sources ──▶ per chunk, its holders ranked
    (schedule.next_chunks)            (relayed, preferred peers)          │
                                                                          ▼
    per chunk: each ranked holder's segments of it (readlayout) ──▶ cut into pieces checked in
    cache (verify) ──▶ wide where the link makes it pay (wideread); the same for the same
    layouts (plancache keeps them)
                                                                          │
                                                                          ▼
    RoundPlan: the READs per chunk, in the batch's order; the chunks no holder can fill now

``PullJob`` (``puller``) leases the holders of a plan and posts its READs
(``schedule.PostQueue``); with chunks ``unavailable`` it asks the server
again who holds what instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tensorhub.client.plancache import LayoutPlans
from tensorhub.client.readlayout import HolderMap, ReadLayout
from tensorhub.client.transfer import Transfer
from tensorhub.client.verify import ChunkVerifier
from tensorhub.client.wideread import WideReads
from tensorhub.planner import choose_sources
from tensorhub.topology import Labels


@dataclass(frozen=True, slots=True)
class RoundPlan:
    reads: dict[int, list[Transfer]]  # chunk -> the READs that fill it, in the batch's order
    unavailable: list[int]  # chunks no usable holder can give whole now


@dataclass(kw_only=True, slots=True)
class RoundPlanner:
    layout: ReadLayout
    labels: Labels  # the reader's
    plans: LayoutPlans
    wide: WideReads
    checks: ChunkVerifier
    reused: int = 0  # chunk plans an earlier pull into the same layout made
    made: int = 0  # chunk plans made here

    def plan(self, chunks: Sequence[int], usable: Sequence[HolderMap], *, excluded: set[str],
             relayed: set[int], prefer: Mapping[int, str]) -> RoundPlan:
        """The READs for ``chunks`` (in this order) from the ``usable`` holders:
        ``relayed`` ones from filling peers, each of ``prefer`` from that peer first."""
        maps = {m.replica_id: m for m in usable}
        plan = choose_sources(self.layout.holders(list(chunks), list(usable)), [m.replica.source for m in usable],
                              self.labels, exclude=frozenset(excluded), relayed=relayed,
                              runs={m.replica_id: m.segments for m in usable}, prefer=prefer)
        reads: dict[int, list[Transfer]] = {}
        unavailable = list(plan.unavailable)
        for chunk in chunks:
            ranked = plan.order.get(chunk)
            planned = self._planned(chunk, [maps[rid] for rid in ranked]) if ranked else None
            if planned is None:
                if ranked:
                    unavailable.append(chunk)
            else:
                reads[chunk] = planned
        return RoundPlan(reads, unavailable)

    def _planned(self, chunk: int, ranked: list[HolderMap]) -> list[Transfer] | None:
        """The READs that fill ``chunk`` from ``ranked`` holders, None if they miss
        some bytes: each holder's segments of it, checked ones cut to be checked
        in cache, then wide where the link makes it pay (the same for the same
        layouts: ``plans`` keeps them)."""
        def make() -> list[Transfer] | None:
            planned = self.layout.transfers(chunk, ranked)
            return None if planned is None else self.wide.plan(self.checks.pieces(planned), maps)

        maps = {m.replica_id: m for m in ranked}
        context = (tuple(self.checks.checked(m.replica_id) for m in ranked),
                   tuple(self.wide.cost(m.replica) for m in ranked), self.wide.slot_bytes)
        planned, reused = self.plans.chunk(chunk, ranked, context, make)
        self.reused += reused
        self.made += not reused
        return planned
