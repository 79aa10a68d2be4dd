"""Executing one pull: plan, lease, read chunks in parallel, fail over.

    resolve ──▶ holder maps ──▶ choose_sources ──▶ acquire read lease ──▶ READs (posted, polled) ┐
       ▲        (readlayout)     ▲ (exclude lost / withdrawn)                                     │
       └─────────────────────────┴──── a source failed or vanished: re-plan what is left ◀───────┘

A chunk of the reader's bytes is done when every transfer planned for it has
landed; a chunk may come from several holders (one per shard it spans). It is
reported (served to others) once checked against its sources' checksums
(``verify.ChunkVerifier``); a mismatch excludes the source and reads it again.
Every byte of one pull comes from replicas of one resolved version, so a pull
never mixes versions. Reads stop before the read lease's local expiry, so a
holder that unpublished after the lease ran out never has its memory read.

``PullJob`` executes a schedule: it posts, polls, releases, reports and fails
over. What to read comes from pure modules, handed plain values (the clock
read here, passed in):

    schedule.next_chunks    which chunks a round reads (the reader's order: reader_order; growing peers)
    roundplan.RoundPlanner  from whom (planner.choose_sources), cut in READs (readlayout, verify, wideread)
    schedule.PostQueue      which READ goes out next (held back while its holder's cap is out), round_over
    pacing                  when to ask the server again, how long to wait for peers, patience, reports

It decides what only the execution can tell: when to lease, take over and
let go, what a failed READ or a fresh list of holders means. The bookkeeping
lives beside it:

    PullJob (this module) ─┬─▶ flights.Flights         READs in flight across rounds: deadlines,
                           │                           given-up READs polled until they end, the drain
                           ├─▶ chunkreads.ChunkReads   the chunks being read: READs not landed, bytes per
                           │                           source, failed ones planned again once none flies
                           ├─▶ refresh.ServerAnswers   what the server's answers mid-pull say: its
                           │                           instance, change counter, the resettle window
                           ├─▶ holderviews.HolderViews the holders as this pull sees them: their maps
                           │                           (peers' news merged), their views for the schedule
                           ├─▶ peernews.PullNews       relaying peers' chunk news: heard each round
                           │                           (once it flows, the server is asked every
                           │                           pacing.ASK_WITH_NEWS_S), told as this pull's chunks land
                           ├─▶ leases.PullLeases       which read lease covers which holder
                           ├─▶ verify.ChunkVerifier    chunks checked against their checksums
                           └─▶ wideread.WideReads      the scratch wide READs land in, cut into place

The job talks to the reference server through ``ControlPlane`` and moves bytes
through ``Transport``: the real ones are ``ReferenceClient`` and ``NixlAgent``;
tests drive the failover logic with fakes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tensorhub import pacing
from tensorhub.client.chunkreads import ChunkReads
from tensorhub.client.flights import Flight, Flights, Handles, drain_s
from tensorhub.client.holderviews import HolderViews
from tensorhub.client.leases import LeaseService, PullLeases
from tensorhub.client.peernews import PullNews
from tensorhub.client.plancache import LayoutPlans
from tensorhub.client.pullstats import PullStats
from tensorhub.client.readlayout import HolderMap, ReadLayout
from tensorhub.client.refresh import ServerAnswers
from tensorhub.client.roundplan import RoundPlanner
from tensorhub.client.rpc import RemoteReplica, Resolved
from tensorhub.client.stalls import Stalls
from tensorhub.client.transfer import Transfer
from tensorhub.client.verify import ChunkVerifier, Mismatch
from tensorhub.client.wideread import WideReads
from tensorhub.errors import (
    IntegrityError,
    ServerUnavailable,
    SourceLost,
    TensorHubError,
    TransferStalled,
    VersionNotFound,
)
from tensorhub.schedule import PostQueue, Wave, next_chunks, reader_order, reads_in_flight, round_over
from tensorhub.topology import Labels
from tensorhub.transport import MemoryKind, TransferFailed

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes total)
LandedFn = Callable[[list[int]], None]  # chunks that landed since the last call


class ControlPlane(LeaseService, Protocol):
    """What a pull asks of the reference server (``ReferenceClient``)."""

    def resolve(self, agent_id: str, model: str, version: int | None, *, group: str = "",
                group_round: int = 0, lease: bool = False, wait_change_s: float = 0.0,
                seen_change: int = 0) -> Resolved: ...

    def report_lost(self, agent_id: str, replica_id: str, reason: str, *, stalled: bool = False) -> bool: ...


class Transport(Handles, Protocol):
    """How a pull moves bytes (``NixlAgent``): READs posted, then polled and
    released (``flights.Handles``)."""

    def connect(self, key: str, metadata: bytes, regions: np.ndarray | None = None) -> str: ...

    def post(self, remote: str, local: np.ndarray, local_kind: MemoryKind, remote_descs: np.ndarray,
             remote_kind: MemoryKind) -> Any: ...

    def forget(self, key: str) -> None: ...


# Rounds that land nothing (a holder withdrawn, none left for some chunks) before the pull gives up.
_MAX_ROUNDS_WITHOUT_PROGRESS = 4
# After the server restarted (a new instance answers) or went out of reach, its
# holders announce their replicas again at their next heartbeats, once their
# channels are back: until then running out of holders, or a lease refused for
# a holder, does not mean the holder is gone. The pull asks again every
# _RESETTLE_POLL_S meanwhile.
_RESETTLE_S = 5.0
_RESETTLE_POLL_S = 0.1


def _names(tensors: list[str], limit: int = 4) -> str:
    """Tensor names for a message: the first ``limit``, then how many more."""
    more = len(tensors) - limit
    return ", ".join(tensors[:limit]) + (f" and {more} more" if more > 0 else "")


@dataclass(kw_only=True, slots=True)
class PullJob:
    rpc: ControlPlane
    nixl: Transport
    agent_id: str
    labels: Labels
    resolved: Resolved
    layout: ReadLayout
    dest_kind: MemoryKind
    in_flight: int  # READs posted and not yet complete, at most (alone; more in a wave: reads_in_flight)
    chunk_timeout_s: float
    deadline: float
    seeds_per_zone: int = 1  # readers of a zone that read across its boundary (planner.relay_share)
    progress: ProgressFn | None = None
    landed: LandedFn | None = None
    verify: bool = True  # check chunks against their publishers' checksums (HubConfig.verify_chunks)
    # The longest the transport takes to fail a READ whose source vanished
    # (NixlAgent.failure_detection_s); None: not known. Bounds the drain.
    failure_detection_s: float | None = None
    # Which READs go wide, and the scratch they land in; the default reads exact runs only.
    wide: WideReads = field(default_factory=WideReads)
    # What this pull plans from the two sides' layouts alone (holder tables,
    # chunk READs): the Hub's, kept across pulls into the same layout; by default this pull's own.
    plans: LayoutPlans = field(default_factory=LayoutPlans)
    # Chunk news with the relaying peers (``peernews``); None: only the server says who has what
    news: PullNews | None = None
    # The wave of readers the last pull into this destination saw (``PullStats.wave_readers``): a
    # named answer lists only the holders that pull read from, and the schedule needs the wave's length
    wave_readers: int = 0
    _checks: ChunkVerifier = field(init=False)
    _holders: HolderViews = field(init=False)  # the holders as this pull sees them (``holderviews``)
    # Read leases are kept until the pull ends: a holder that unpublishes
    # mid-pull waits for it (the contract), and it stays readable meanwhile.
    _leases: PullLeases = field(init=False)
    _progress_at: float = field(default_factory=time.monotonic)  # when a chunk last landed
    # READs in flight across rounds, and those given up on but not ended (``flights``):
    # made when the pull runs, over the transport it has then
    _flying: Flights = field(init=False)
    _reads: ChunkReads = field(default_factory=ChunkReads)  # the chunks being read, how far each got (``chunkreads``)
    _relayed: set[int] = field(default_factory=set)  # chunks of this round that _batch takes from filling peers
    _prefer: dict[int, str] = field(default_factory=dict)  # of _relayed, the peer (replica id) to read from (the chain's)
    _origin_cap: int = 0  # this round's READs in flight from one complete holder, at most (0: no cap; see _batch)
    _peer_cap: int = 0  # and from one filling holder
    _slots: int = 0  # this round's READs in flight, at most (``schedule.reads_in_flight``; see _batch)
    _server: ServerAnswers = field(init=False)  # what the server's answers to this pull said (``refresh``)
    _asked_at: float = 0.0  # when this pull last asked who holds what
    _planner: RoundPlanner = field(init=False)  # the READs that fill a round's chunks (``roundplan``)
    _stalls: Stalls = field(init=False)  # holders this pull heard nothing from: slow or dead (``stalls``)
    _round_view: tuple[dict, set[str]] = field(default_factory=lambda: ({}, set()))  # this round's maps, excluded
    _wave_seen: int = 1  # the longest wave of readers a round saw (itself included)

    def __post_init__(self) -> None:
        self._checks = ChunkVerifier(self.verify and self.dest_kind == MemoryKind.DRAM,  # checks read host memory
                                     self.layout)
        self._holders = HolderViews(layout=self.layout, plans=self.plans, checks=self._checks, news=self.news)
        # Made with the job, not in run(): the reports' thread reads its pace (``server_pace_s``) from the start
        self._server = ServerAnswers(self.rpc, self.agent_id, self.resolved, resettle_s=_RESETTLE_S)
        self._planner = RoundPlanner(layout=self.layout, labels=self.labels, plans=self.plans, wide=self.wide,
                                     checks=self._checks)
        self._leases = PullLeases(self.rpc, self.agent_id)
        self._stalls = Stalls(lambda rid: self.rpc.report_lost(
            self.agent_id, rid, f"no READ landed for {self.chunk_timeout_s:g} s", stalled=True),
            chunk_timeout_s=self.chunk_timeout_s)

    def run(self) -> PullStats:
        res = self.resolved
        stats = PullStats()
        needed = {c for c in range(self.layout.num_chunks)}
        maps = self._holders.maps(res.replicas, set())
        self._asked_at = time.monotonic()
        self._leases.upfront = res if res.lease_id else None  # the resolve's lease covers the first round
        self._flying = Flights(self.nixl, self._leases, chunk_timeout_s=self.chunk_timeout_s, deadline=self.deadline,
                               drain_time_s=drain_s(self.chunk_timeout_s, self.failure_detection_s),
                               wait_on=self._worth_waiting)
        listening = self.news if self.news is not None else contextlib.nullcontext()
        try:
            with listening:
                self._rounds(res, stats, needed, maps)
        except SourceLost as e:
            if not self._checks.mismatches or isinstance(e, IntegrityError):
                raise
            bad = ", ".join(f"{m.replica.source.agent_name} chunk {m.chunk} ({_names(self._checks.tensors(m))})"
                            for m in self._checks.mismatches[:4])
            raise IntegrityError(res.model, res.version, stats.corrupt_sources,
                                 f"bytes read from {bad} did not match their checksums, and no other "
                                 f"holder has them ({e})") from None
        finally:
            self._drop_flights()
            for rid in self._stalls.suspects():  # given up on as stalled, not read again: connection suspect
                self.nixl.forget(rid)
            self._checks.close()  # no check reads the destination after this
            self._leases.release_all()
            stats.verified_bytes = self._checks.verified_bytes
            stats.unverified_bytes = self._checks.unverified_bytes
            stats.checks_failed = len(self._checks.mismatches)
            stats.checks_failed_unplaced = sum(m.whole for m in self._checks.mismatches)
            stats.refreshes = self._server.asked
            stats.news_heard = self.news.heard if self.news is not None else 0
            stats.subscribers = self.news.subscribers if self.news is not None else 0
            stats.wave_readers = self._wave_seen
        stats.nbytes = self.layout.total_bytes
        stats.plans_reused, stats.plans_made = self._planner.reused, self._planner.made
        return stats

    def _asking_due(self) -> bool:
        """Whether to ask the server who holds what now (``pacing.asking_due``),
        or at once: news came from a holder it was not told of (``PullNews.strangers``)."""
        if self.news is not None and self.news.strangers:
            return True
        return pacing.asking_due(time.monotonic(), self._asked_at, news_flowing=self._news_flowing(),
                                 quiet_s=self._server.quiet_s, server_pace_s=self.server_pace_s)

    @property
    def server_pace_s(self) -> float:
        """The server's pace for this version's pulls in its latest answer
        (``pacing.server_pace_s``), which a named (steady) pull keeps: how
        often, at least, it asks and its reports go while its news reaches
        peers (``LandedReports.server_pace``). 0 for another pull: whether a
        longer pace slows those was not measured after the named-chain fix
        (``pacing.ASK_WITH_NEWS_S``)."""
        return self._server.pace_s if self.resolved.named else 0.0

    def _news_flowing(self) -> bool:
        return self.news is not None and self.news.heard > 0

    def _await_news(self, maps: dict[str, HolderMap]) -> dict[str, HolderMap] | None:
        """With nothing to read until peers land more: their news, waited for
        until the server is due to be asked, patience runs out, or the
        deadline; None if none came (the server is asked then)."""
        until = pacing.news_until(self._asked_at, self._progress_at, self.deadline, self.server_pace_s)
        while time.monotonic() < until:
            heard = self._holders.hear(maps)
            if heard is not maps:
                return heard
            if self.news is not None and self.news.strangers:  # a holder it was not told of: ask now
                return None
            time.sleep(pacing.NEWS_POLL_S)
        return None

    def _batch(self, needed: set[int], usable: list[HolderMap], first: bool = False, held: int = 0) -> list[int]:
        """The chunks of the next round (``schedule.next_chunks``, from what each
        usable holder has and will hold); it sets the round's ``_relayed`` and
        ``_origin_cap``. A round stops posting after ``pacing.REFRESH_IDLE_S`` and the
        server is asked again, so readers that start together (and were not yet
        registered) find each other early; after ``pacing.PATIENCE_S`` without a chunk
        a reader reads anything from anywhere."""
        now = time.monotonic()
        holders = self._holders.views(usable, now)
        self._slots = reads_in_flight(self.in_flight, holders)
        wave = Wave(me=self.agent_id, zone=self.labels.zone, num_chunks=self.layout.num_chunks,
                    in_flight=self._slots, seeds_per_zone=self.seeds_per_zone, first=first,
                    serving=self.landed is not None,
                    patience_out=pacing.patience_out(now, self._progress_at), holders=holders, held=held,
                    wave_readers=self.wave_readers if self.resolved.named else 0)
        self._wave_seen = max(self._wave_seen, wave.wave_readers, 1 + sum(not h.complete for h in holders))
        batch = next_chunks(reader_order(needed, self.agent_id, self.layout.num_chunks), wave)
        self._relayed, self._origin_cap, self._peer_cap = set(batch.relayed), batch.origin_cap, batch.peer_cap
        replica_of = {m.replica.agent_id: m.replica_id for m in usable}
        self._prefer = {c: replica_of[a] for c, a in batch.prefer.items()}
        return batch.chunks

    def _rounds(self, res: Resolved, stats: PullStats, needed: set[int], maps: dict[str, HolderMap]) -> None:
        excluded: set[str] = set()
        stale_rounds = 0
        # See the last ask below. (Not ``settled``: that name holds the chunks a round's checks settled.)
        named = res.named
        while needed or self._checks.busy:
            if time.monotonic() > self.deadline:
                raise TransferStalled(res.model, res.version, stats.lost_sources,
                                      f"{len(needed)} chunk(s) still missing at the pull's deadline")
            if not needed:  # everything landed: wait for the last checks
                settled = self._checked(needed, excluded, stats, min(0.05, self.deadline - time.monotonic()))
                if not needed and not self._checks.running:
                    settled += self._checks.settle_rest()
                if settled and self.landed is not None:
                    self.landed(settled)
                continue
            maps = self._holders.hear(maps)
            stats.rounds += 1
            usable = [m for rid, m in maps.items() if rid not in excluded]
            in_air = self._flying.chunks()
            chunks = self._batch(needed - in_air, usable, first=stats.rounds == 1,
                                 held=self.layout.num_chunks - len(needed))
            if not chunks:
                if self._flying:  # land what flies, then look again
                    self._read_round({}, maps, needed, excluded, stats, carry=True)
                    if self._asking_due():
                        maps = self._refresh_quietly(excluded, maps, needed)
                elif self._serve_checked(needed, excluded, stats):
                    if self._asking_due():
                        maps = self._refresh_quietly(excluded, maps, needed)
                else:  # every chunk left is due from a peer: until one lands it, or patience runs out
                    # peers tell what they land; without their news the server's long poll does
                    heard = self._await_news(maps) if self._news_flowing() and not self._asking_due() else None
                    maps = heard if heard is not None else self._refresh_quietly(
                        excluded, maps, needed, wait_s=self._wait_for_peers_s())
                continue
            plan = self._planner.plan(chunks, usable, excluded=excluded, relayed=self._relayed, prefer=self._prefer)
            self._relayed, self._prefer = set(), {}
            transfers, unavailable = plan.reads, plan.unavailable  # in the batch's order: the round reads them so
            if unavailable:
                self._leases.drop_upfront()  # the holders it leased cannot fill this round
                read_again = len(stats.sources_read_again)
                maps = self._keep_leased(self._refresh(stats, excluded, stale_rounds, sorted(unavailable), usable),
                                         maps, excluded, needed)
                # a slow source read again starts the count anew (``Stalls.read_again``: the deadline bounds it)
                stale_rounds = 0 if len(stats.sources_read_again) > read_again else stale_rounds + 1
                continue
            primaries = sorted({t.replica_id for planned in transfers.values() for t in planned})
            uncovered = [rid for rid in primaries if not self._leases.covers(rid)]
            if not self._leases.upfront_covers(uncovered):
                self._leases.drop_upfront()
            if uncovered:
                try:
                    granted = self._leases.take(uncovered)
                except ServerUnavailable:
                    if not self._server.unanswered():
                        raise
                    time.sleep(_RESETTLE_POLL_S)
                    continue
                withdrawn = set(uncovered) - granted
                if withdrawn and self._server.resettling():  # a restarted server may not list them again yet
                    time.sleep(_RESETTLE_POLL_S)
                    maps = self._refresh_quietly(excluded, maps, needed)
                    continue
                if withdrawn:  # unpublished since the plan: never read them
                    excluded |= withdrawn
                    stale_rounds += 1
                    if stale_rounds > _MAX_ROUNDS_WITHOUT_PROGRESS:
                        raise SourceLost(res.model, res.version, sorted(withdrawn), "sources were withdrawn")
                    continue
            before = len(needed)
            self._read_round(transfers, maps, needed, excluded, stats, carry=len(needed) > len(transfers))
            stale_rounds = 0 if len(needed) < before else stale_rounds + 1
            # Who holds what now: peers' chunks landed, readers joined. Not for an answer of the
            # holders named (the steady state): complete ones (the trainer, its cut) give everything,
            # and asking again only finds others to read from, at a blocking round trip each (a TP
            # worker's 90 ms pull asked 1-3 times, ~28% of it); filling relays tell their chunks in
            # their news (this pull subscribed to each), and readers below it subscribe to it. At
            # 1,024 relays an ask is a ranking of a thousand holders: it asks only when it has nothing
            # to read (above).
            if needed and not named and self._asking_due():
                maps = self._refresh_quietly(excluded, maps, needed)

    def _serve_checked(self, needed: set[int], excluded: set[str], stats: PullStats) -> bool:
        """While this reader waits for its peers' chunks, report its own chunks
        whose checks finish meanwhile (waiting ``pacing.WAIT_FOR_PEERS_S`` at most for
        one); False when no check is running. Else the last chunks of each
        reader's share stayed unserved until its patience ran out, while its
        peers, waiting for those chunks, did the same (found by ``tensorhub
        bench rl``, elastic: a wave of joiners stalled 1 s per round)."""
        if not self._checks.running:
            return False
        settled = self._checked(needed, excluded, stats, pacing.WAIT_FOR_PEERS_S)
        if settled and self.landed is not None:
            self.landed(settled)
        return True

    def _wait_for_peers_s(self) -> float:
        """How long a reader waiting for its peers' chunks lets the server hold
        its question, after the pause first due (``pacing.peer_wait``)."""
        pause, wait_s = pacing.peer_wait(time.monotonic(), self._asked_at, self._progress_at, self.deadline)
        if pause > 0:
            time.sleep(pause)
        return wait_s

    def _ask(self, wait_s: float = 0.0) -> Resolved:
        """Ask the server who holds the version (``ServerAnswers.ask``): the
        holders news came from unlisted are asked about with it."""
        if self.news is not None:
            self.news.asked()
        return self._server.ask(wait_s)

    def _refresh_quietly(self, excluded: set[str], maps: dict[str, HolderMap], needed: set[int],
                         wait_s: float = 0.0) -> dict[str, HolderMap]:
        """Holders as the server sees them now (``wait_s``: once they changed, or
        after that long); the old ones if it cannot say (the next round finds
        out what is missing)."""
        self._asked_at = time.monotonic()
        try:
            fresh = self._ask(wait_s)
        except ServerUnavailable:
            self._server.unanswered()
            return maps
        except VersionNotFound:
            return maps
        return self._keep_leased(self._holders.maps(fresh.replicas, excluded), maps, excluded, needed)

    def _keep_leased(self, fresh: dict[str, HolderMap], old: dict[str, HolderMap], excluded: set[str],
                     needed: set[int]) -> dict[str, HolderMap]:
        """Holders the server no longer lists are unpublishing, waiting for this
        pull's lease. If the listed holders can give everything still needed
        (e.g. the trainer's retained host copy, or peers), let the withdrawn ones
        go at once so their unpublish returns; else keep reading them.

        The complete holders that take over are leased before the withdrawn ones
        go: the trainer's retained copy of a version it just stepped past lives
        only until its next version is published, and is then let go unless a
        reader holds a lease on it (a pull that let the trainer go first lost
        the version mid-way, found by ``tensorhub bench rl``)."""
        gone = [rid for rid in old if rid not in fresh and self._leases.covers(rid) and rid not in excluded]
        if not gone:
            return fresh
        if any(self._flying.from_source(rid) for rid in gone):  # never release a lease under a READ
            for rid in gone:
                fresh[rid] = old[rid]
            return fresh
        if all(self.layout.transfers(c, list(fresh.values())) is not None for c in needed):
            try:
                if self._leases.take_over([rid for rid, m in fresh.items() if m.replica.source.complete]):
                    self._release(set(gone), fresh)
                    return fresh
            except TensorHubError as e:  # keep the old leases: they expire by themselves
                log.debug("re-lease: %s", e)
        for rid in gone:
            fresh[rid] = old[rid]
        return fresh

    def _release(self, gone: set[str], fresh: dict[str, HolderMap]) -> None:
        """Let the withdrawn holders ``gone`` go (their unpublish returns)."""
        self._leases.release(gone, set(fresh))

    def _refresh(self, stats: PullStats, excluded: set[str], stale_rounds: int, unavailable: list[int],
                 usable: list[HolderMap]) -> dict[str, HolderMap]:
        """Ask the server again who holds the version; new holders may exist."""
        res = self.resolved
        if stale_rounds >= _MAX_ROUNDS_WITHOUT_PROGRESS:
            if not self._server.resettling():
                raise SourceLost(res.model, res.version, stats.lost_sources,
                                 f"no remaining holder has {self.layout.missing(unavailable, usable)}")
            time.sleep(_RESETTLE_POLL_S)
        try:
            fresh = self._ask()
        except VersionNotFound as e:
            if self._server.resettling():  # nobody announced the version to the new instance yet
                return {}
            raise SourceLost(res.model, res.version, stats.lost_sources,
                             f"no remaining holder has {self.layout.missing(unavailable, usable)} ({e})") from None
        except ServerUnavailable:
            if not self._server.unanswered():
                raise
            return {}
        if fresh.manifest.fingerprint != res.manifest.fingerprint:  # defensive: versions are immutable
            raise TensorHubError(f"{res.model!r} version {res.version} changed manifest during the pull")
        self._read_again(fresh, excluded, stats)
        return self._holders.maps(fresh.replicas, excluded)

    def _read_again(self, fresh: Resolved, excluded: set[str], stats: PullStats) -> None:
        """Some chunks have no holder left: the holders given up on as stalled
        that the server lists (again) are read again (``stalls``)."""
        listed = {r.source.replica_id: r.source.agent_name for r in fresh.replicas}
        for rid in self._stalls.read_again(listed, excluded):
            stats.sources_read_again.append(listed[rid])
            log.info("source %s (%s) stalled, but the server lists it and no other holder has the rest: "
                     "reading it again", listed[rid], rid)

    def _read_round(self, transfers: dict[int, list[Transfer]], maps: dict[str, HolderMap],
                    needed: set[int], excluded: set[str], stats: PullStats, *, carry: bool = False) -> None:
        """Post the round's READs, up to ``_slots`` at a time, from this one
        thread, and poll them. Over shared memory a READ is done when posted (no
        thread hop, as raw NIXL); over TCP or RDMA several are in flight at once.
        A chunk is done when all its READs are; a failed one is planned again.

        ``carry``: once every READ of the round is posted and some landed, return
        with up to half of ``_slots`` still flying; the next round (after the
        server is asked who holds what) keeps them, so the links never drain
        between rounds. The flights live on the job (``_flying``: ``flights.Flights``)."""
        layout = self.layout
        self._round_view = (maps, excluded)  # for a stalled READ's question: can another holder give it?
        queue = PostQueue(transfers, lambda t: t.replica_id, cap=self._origin_cap, peer_cap=self._peer_cap,
                          complete={rid: m.replica.source.complete for rid, m in maps.items()})
        reads, flying = self._reads, self._flying
        reads.plan(transfers)  # planned anew: whatever failed before is forgotten
        lost_now: set[str] = set()
        landed: list[int] = []
        finished_any = False
        last_report = time.monotonic()
        done_bytes = layout.total_bytes - sum(layout.chunk_bytes(c) for c in needed)
        pause = pacing.POLL_MIN_S

        def lost(replica: RemoteReplica, error: TransferFailed) -> None:
            rid = replica.source.replica_id
            if rid not in lost_now and rid not in excluded:
                lost_now.add(rid)
                self._lose(replica, str(error), stats, stalled=error.stalled)
            excluded.add(rid)

        def post(chunk: int, transfer: Transfer) -> None:
            replica = maps[transfer.replica_id].replica
            if not self._leases.covers(transfer.replica_id):  # its lease failed to renew: lease again next round
                reads.fail(chunk)
                return
            try:
                deadline = flying.deadline(transfer.replica_id, time.monotonic())
                remote = self.nixl.connect(transfer.replica_id, replica.metadata, replica.regions)
                local, remote_descs = self.wide.posted(transfer)
                handle = self.nixl.post(remote, local, self.dest_kind, remote_descs, replica.kind)
            except TransferFailed as e:
                self.wide.ended(transfer, reusable=True)
                lost(replica, e)
                reads.fail(chunk)
            except TensorHubError as e:  # the lease could not be renewed: lease again next round
                self.wide.ended(transfer, reusable=True)
                log.info("chunk %d deferred: %s", chunk, e)
                self._leases.forget(transfer.replica_id)
                reads.fail(chunk)
            else:
                flying.add(chunk, transfer, handle, deadline, replica)

        try:
            stop_posting_at = time.monotonic() + pacing.REFRESH_IDLE_S
            posting, cut = True, False
            slots = max(self._slots, self.in_flight)
            begun: set[int] = set()  # chunks with a READ posted this round
            while True:
                while posting and len(flying) < slots:
                    if not cut and time.monotonic() >= stop_posting_at:
                        cut = True  # time to ask who holds what: post the rest of the chunks begun, only
                        queue.cut(begun)
                    item = queue.take(flying.from_source)
                    if item is None:
                        posting = queue.held_back  # the held-back ones go as their holders' READs land
                        break
                    chunk, transfer = item
                    if transfer.replica_id in lost_now or transfer.replica_id in excluded or reads.failed(chunk):
                        reads.fail(chunk)  # stays needed: the next round re-plans it
                        continue
                    begun.add(chunk)
                    post(chunk, transfer)
                    if self._checks.enabled and flying.newest_landed():
                        break  # landed when posted (shared memory): its check starts now, while it is in cache
                if round_over(len(flying), slots, posting=posting, carry=carry, landed_any=finished_any):
                    break
                finished: list[Flight] = []
                for flight, error in flying.poll():
                    chunk, transfer, replica = flight.chunk, flight.transfer, flight.replica
                    finished.append(flight)
                    if error is not None:
                        self.wide.ended(transfer, reusable=not error.stalled)  # a stalled READ may land later
                        lost(replica, error)
                        reads.fail(chunk)
                        continue
                    read, descriptors = self.wide.landed(transfer)  # wide groups cut into place first
                    stats.read_bytes += read
                    stats.descriptors += descriptors
                    if not self._leases.still_leased(transfer.replica_id):
                        # Its bytes may come from memory the holder reused: read
                        # again, under a new lease (refused if the holder is gone).
                        log.info("chunk %d from %s finished only after its read lease ran out: read again",
                                 chunk, transfer.replica_id)
                        self._leases.forget(transfer.replica_id)
                        reads.fail(chunk)
                        continue
                    flying.progressed(transfer.replica_id)
                    if reads.failed(chunk):
                        continue
                    name = replica.source.agent_name
                    stats.read_from(name, (self.labels.tier(replica.source.labels), replica.source.origin), replica.lean,
                                    replica.wire_layout)
                    self._checks.arrived(transfer)  # its CRC now, while its bytes are in cache
                    whole = reads.landed(chunk, name, transfer)
                    if whole is not None:  # counted once the whole chunk is in (``chunkreads``)
                        sources, arrived = whole
                        stats.chunk_done(chunk, sources)
                        done_bytes += layout.chunk_bytes(chunk)
                        self._progress_at = time.monotonic()
                        needed.discard(chunk)
                        landed.extend(self._checks.landed(chunk, arrived))
                landed.extend(self._checked(needed, excluded, stats))
                flying.settle(finished)
                if finished:
                    finished_any = True
                    pause = pacing.POLL_MIN_S
                    if self.progress is not None:
                        self.progress(min(done_bytes, layout.total_bytes), layout.total_bytes)
                else:
                    time.sleep(pause)
                    pause = pacing.poll_backoff(pause)
                if landed and self.landed is not None and pacing.report_due(time.monotonic(), last_report,
                                                                            flying=bool(flying)):
                    self.landed(landed)
                    landed = []
                    last_report = time.monotonic()
        except BaseException:  # a raise mid-round (e.g. from the progress callback) leaves no handle behind
            self._drop_flights()
            raise
        finally:
            reads.settle(flying.chunks())  # a failed chunk with nothing left in flight is planned again next round
        if landed and self.landed is not None:
            self.landed(landed)

    def _drop_flights(self) -> None:
        """Let go of the READs still out (``Flights.drop``); their scratch is not reused."""
        for transfer in self._flying.drop():
            self.wide.ended(transfer, reusable=False)

    def _checked(self, needed: set[int], excluded: set[str], stats: PullStats, wait_s: float = 0.0) -> list[int]:
        """Collect finished checks: the chunks now settled. A source whose bytes
        failed one is reported and excluded, and the chunks that took bytes of
        the bad chunk are needed again (read from another holder)."""
        settled, bad = self._checks.poll(wait_s)
        for m in bad:
            if m.whole:  # which of its holders gave the wrong bytes is not known: read it again
                log.warning("chunk %d failed its check against %s's checksum: read again", m.chunk,
                            m.replica.source.agent_name)
                if m.exhausted:
                    res = self.resolved
                    raise IntegrityError(res.model, res.version, stats.corrupt_sources,
                                         f"chunk {m.chunk} failed its check against {m.replica.source.agent_name}'s "
                                         f"checksum each time it was read")
            else:
                self._reject(m, excluded, stats)
            needed |= m.rereads
        return settled

    def _reject(self, m: Mismatch, excluded: set[str], stats: PullStats) -> None:
        rid = m.replica.source.replica_id
        if rid in excluded:
            return
        excluded.add(rid)
        stats.corrupt_sources.append(m.replica.source.agent_name)
        self._lose(m.replica, m.reason(), stats)

    def _worth_waiting(self, flight: Flight) -> bool:
        """A READ stalled: wait on it, or give it up (``stalls``)."""
        rid, (maps, excluded) = flight.transfer.replica_id, self._round_view
        others = [m for r, m in maps.items() if r != rid and r not in excluded]
        return self._stalls.worth_waiting(
            rid, replaceable=bool(others) and self.layout.transfers(flight.chunk, others) is not None)

    def _lose(self, replica: RemoteReplica, reason: str, stats: PullStats, *, stalled: bool = False) -> None:
        rid = replica.source.replica_id
        log.warning("source %s (%s) lost: %s", replica.source.agent_name, rid, reason)
        stats.lost_sources.append(replica.source.agent_name)
        if self._stalls.lost(rid, stalled=stalled):  # a stalled one may be read again: connection kept
            self.nixl.forget(rid)
        try:
            self.rpc.report_lost(self.agent_id, rid, reason, stalled=stalled)
        except TensorHubError as e:  # the server will expire it anyway
            log.debug("report_lost: %s", e)
