"""Executing one pull: plan, lease, read chunks in parallel, fail over.

    resolve ──▶ choose_sources ──▶ acquire read lease ──▶ READ chunks (pool) ──┐
       ▲             ▲ (exclude lost / withdrawn)                              │
       └─────────────┴──── a source failed or vanished: re-plan what is left ◀─┘

Every chunk of one pull comes from replicas of one resolved version, so a pull
never mixes versions. Reads stop before the read lease's local expiry, so a
holder that unpublished after the lease ran out never has its memory read.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tensorhub.chunks import ChunkLayout
from tensorhub.client.rpc import ReferenceClient, RemoteReplica, Resolved
from tensorhub.errors import SourceLost, TensorHubError, TransferStalled, VersionNotFound
from tensorhub.planner import choose_sources
from tensorhub.topology import Labels
from tensorhub.transport import MemoryKind, NixlAgent, TransferFailed

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes total)
LandedFn = Callable[[list[int]], None]  # chunks that landed since the last call

_REPORT_PERIOD_S = 0.05
_MAX_ROUNDS_WITHOUT_PROGRESS = 4


@dataclass(kw_only=True, slots=True)
class PullStats:
    nbytes: int = 0
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    lost_sources: list[str] = field(default_factory=list)
    rounds: int = 0


class _Lease:
    """A read lease on the sources of one round. Renewed before it runs out;
    ``expiry`` is local and conservative (taken before the request was sent)."""

    def __init__(self, rpc: ReferenceClient, agent_id: str, replica_ids: list[str],
                 taken: Resolved | None = None) -> None:
        self._rpc, self._agent_id = rpc, agent_id
        if taken is not None:  # leased together with the resolve
            self.lease_id, self.ttl_s, sent = taken.lease_id, taken.lease_ttl_s, taken.lease_sent_at
            self.granted = set(replica_ids)
        else:
            sent = time.monotonic()
            self.lease_id, granted, self.ttl_s = rpc.acquire_lease(agent_id, replica_ids)
            self.granted = set(granted)
        self.expiry = sent + self.ttl_s
        self._lock = threading.Lock()

    def valid_until(self) -> float:
        with self._lock:
            if self.expiry - time.monotonic() < self.ttl_s / 2:
                sent = time.monotonic()
                self.ttl_s = self._rpc.renew_lease(self._agent_id, self.lease_id)
                self.expiry = sent + self.ttl_s
            return self.expiry

    def release(self) -> None:
        try:
            self._rpc.release_lease_async(self._agent_id, self.lease_id)
        except Exception as e:  # the lease expires by itself
            log.debug("release lease: %s", e)


class ChunkReader:
    """Builds NIXL descriptors for a chunk between the destination and a source."""

    def __init__(self, layout: ChunkLayout, dest_regions: np.ndarray, dest_kind: MemoryKind) -> None:
        self.layout = layout
        self.dest = dest_regions
        self.dest_kind = dest_kind
        self._segments: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _segs(self, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        segs = self._segments.get(chunk)
        if segs is None:
            raw = self.layout.segments(chunk)
            segs = (
                np.array([s.tensor for s in raw], dtype=np.int64),
                np.array([s.offset for s in raw], dtype=np.uint64),
                np.array([s.length for s in raw], dtype=np.uint64),
            )
            self._segments[chunk] = segs
        return segs

    def descriptors(self, chunk: int, source: RemoteReplica) -> tuple[np.ndarray, np.ndarray]:
        t, off, length = self._segs(chunk)
        local = np.stack([self.dest[t, 0] + off, length, self.dest[t, 2]], axis=1)
        remote = np.stack([source.regions[t, 0] + off, length, source.regions[t, 2]], axis=1)
        return local, remote


def _run_inline(fn: Callable[..., int], *args: object) -> cf.Future:
    fut: cf.Future = cf.Future()
    try:
        fut.set_result(fn(*args))
    except BaseException as e:  # delivered through the future, like the pool's
        fut.set_exception(e)
    return fut


@dataclass(kw_only=True, slots=True)
class PullJob:
    rpc: ReferenceClient
    nixl: NixlAgent
    agent_id: str
    labels: Labels
    resolved: Resolved
    dest_regions: np.ndarray
    dest_kind: MemoryKind
    pool: cf.ThreadPoolExecutor
    workers: int
    chunk_timeout_s: float
    deadline: float
    progress: ProgressFn | None = None
    landed: LandedFn | None = None
    _used_leases: set[str] = field(default_factory=set)

    def run(self) -> PullStats:
        res = self.resolved
        layout = ChunkLayout([t.nbytes for t in res.manifest.tensors], res.chunk_size)
        reader = ChunkReader(layout, self.dest_regions, self.dest_kind)
        stats = PullStats()
        needed = set(range(layout.num_chunks))
        replicas = {r.source.replica_id: r for r in res.replicas}
        upfront = res if res.lease_id else None  # the resolve's lease covers the first round
        try:
            self._rounds(res, layout, reader, stats, needed, replicas, upfront)
        finally:
            if upfront is not None and upfront.lease_id not in self._used_leases:
                _Lease(self.rpc, self.agent_id, [], upfront).release()
        stats.nbytes = layout.total_bytes
        return stats

    def _rounds(self, res: Resolved, layout: ChunkLayout, reader: ChunkReader, stats: PullStats, needed: set[int],
                replicas: dict[str, RemoteReplica], upfront: Resolved | None) -> None:
        excluded: set[str] = set()
        stale_rounds = 0
        while needed:
            if time.monotonic() > self.deadline:
                raise TransferStalled(res.model, res.version, stats.lost_sources,
                                      f"{len(needed)} chunk(s) still missing at the pull's deadline")
            stats.rounds += 1
            plan = choose_sources(sorted(needed), [r.source for r in replicas.values()], self.labels,
                                  exclude=frozenset(excluded))
            if plan.unavailable:
                replicas = self._refresh(stats, excluded, stale_rounds)
                stale_rounds += 1
                upfront = None  # new replicas are not covered by it
                continue
            primaries = sorted(plan.primary_load())
            lease = _Lease(self.rpc, self.agent_id, primaries, upfront)
            if upfront is not None:
                self._used_leases.add(upfront.lease_id)
                upfront = None
            try:
                withdrawn = set(primaries) - lease.granted
                if withdrawn:  # unpublished since the plan: never read them
                    excluded |= withdrawn
                    stale_rounds += 1
                    if stale_rounds > _MAX_ROUNDS_WITHOUT_PROGRESS:
                        raise SourceLost(res.model, res.version, sorted(withdrawn), "sources were withdrawn")
                    continue
                before = len(needed)
                self._read_round(plan.order, replicas, reader, lease, needed, excluded, stats, layout)
                stale_rounds = 0 if len(needed) < before else stale_rounds + 1
            finally:
                lease.release()

    def _refresh(self, stats: PullStats, excluded: set[str], stale_rounds: int) -> dict[str, RemoteReplica]:
        """Ask the server again who holds the version; new holders may exist."""
        res = self.resolved
        if stale_rounds >= _MAX_ROUNDS_WITHOUT_PROGRESS:
            raise SourceLost(res.model, res.version, stats.lost_sources, "no remaining holder has the missing chunks")
        try:
            fresh = self.rpc.resolve(self.agent_id, res.model, res.version)
        except VersionNotFound:
            raise SourceLost(res.model, res.version, stats.lost_sources,
                             "the version has no complete replica any more") from None
        if fresh.manifest.fingerprint != res.manifest.fingerprint:  # defensive: versions are immutable
            raise TensorHubError(f"{res.model!r} version {res.version} changed manifest during the pull")
        return {r.source.replica_id: r for r in fresh.replicas if r.source.replica_id not in excluded}

    def _read_round(self, order: dict[int, list[str]], replicas: dict[str, RemoteReplica], reader: ChunkReader,
                    lease: _Lease, needed: set[int], excluded: set[str], stats: PullStats,
                    layout: ChunkLayout) -> None:
        lost_now: set[str] = set()

        def read(chunk: int, replica: RemoteReplica) -> int:
            rid = replica.source.replica_id
            if rid in lost_now:
                return -1  # skip: its source already failed this round
            remote_name = self.nixl.connect(rid, replica.metadata)
            local, remote = reader.descriptors(chunk, replica)
            deadline = min(time.monotonic() + self.chunk_timeout_s, lease.valid_until(), self.deadline)
            self.nixl.read(remote_name, local, reader.dest_kind, remote, replica.kind, deadline=deadline)
            return chunk

        # A window of reads in flight (twice the workers): a failed source is noticed
        # before more reads are queued on it, and the caller's progress
        # callback paces the pull.
        todo = iter(order.items())
        submit = self.pool.submit if len(order) > 1 else _run_inline  # one chunk: no thread hop
        futures: dict[cf.Future, tuple[int, str]] = {}

        def refill() -> None:
            while len(futures) < 2 * self.workers:  # keep the pool busy while results are handled
                item = next(todo, None)
                if item is None:
                    return
                chunk, sources = item
                if sources[0] in lost_now:
                    continue  # stays needed: the next round re-plans it
                futures[submit(read, chunk, replicas[sources[0]])] = (chunk, sources[0])

        landed: list[int] = []
        last_report = time.monotonic()
        done_bytes = layout.total_bytes - sum(layout.chunk_bytes(c) for c in needed)
        refill()
        while futures:
            done, _ = cf.wait(futures, timeout=_REPORT_PERIOD_S, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                chunk, rid = futures.pop(fut)
                try:
                    if fut.result() < 0:
                        continue
                except TransferFailed as e:
                    if rid not in lost_now:
                        lost_now.add(rid)
                        self._lose(replicas[rid], str(e), stats)
                    excluded.add(rid)
                    continue
                except TensorHubError as e:  # e.g. the lease could not be renewed: next round
                    log.info("chunk %d deferred: %s", chunk, e)
                    continue
                needed.discard(chunk)
                landed.append(chunk)
                name = replicas[rid].source.agent_name
                nbytes = layout.chunk_bytes(chunk)
                stats.bytes_by_source[name] = stats.bytes_by_source.get(name, 0) + nbytes
                done_bytes += nbytes
            if self.progress is not None and done:
                self.progress(done_bytes, layout.total_bytes)
            refill()
            if landed and self.landed is not None and (
                not futures or time.monotonic() - last_report >= _REPORT_PERIOD_S
            ):
                self.landed(landed)
                landed = []
                last_report = time.monotonic()

    def _lose(self, replica: RemoteReplica, reason: str, stats: PullStats) -> None:
        rid = replica.source.replica_id
        log.warning("source %s (%s) lost: %s", replica.source.agent_name, rid, reason)
        stats.lost_sources.append(replica.source.agent_name)
        self.nixl.forget(rid)
        try:
            self.rpc.report_lost(self.agent_id, rid, reason)
        except TensorHubError as e:  # the server will expire it anyway
            log.debug("report_lost: %s", e)
