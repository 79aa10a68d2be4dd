"""What this process holds, and its session with the reference server.

    Hub.publish ─┐                          ┌─ heartbeat thread: re-register after a server
    Hub.pull(serve=True) ── open_filling ──▶│  restart, re-announce dropped replicas,
                 │                          │  release retained copies nobody needs
                 ▼                          │
          Publication  FILLING ─▶ COMPLETE ─▶ WITHDRAWING ─▶ CLOSED
                                    (unpublish: the server drains readers; the
                                     last reliable holder of a retained region
                                     first keeps a host copy)

Every state change of a Publication happens here, under ``_lock``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from tensorhub.client.config import HubConfig
from tensorhub.client.groupsend import sent_by_first
from tensorhub.client.publication import Publication, PubState
from tensorhub.client.rpc import MAX_BATCH, AgentUnknown, ReferenceClient, RemoteReplica, ReplicaUnknown
from tensorhub.errors import AlreadyPublished, ServerUnavailable, TensorHubError, UnpublishTimeout
from tensorhub.integrity import chunk_checksums, some_chunk_checksums
from tensorhub.manifest import Manifest
from tensorhub.shard import Part
from tensorhub.transport import NixlAgent

T = TypeVar("T")
# The server's drain ends this much (at most a quarter of the timeout) before
# unpublish's own timeout, which leaves the answer its way back: unpublish(timeout)
# returns within its timeout, not a whole RPC timeout later.
_UNPUBLISH_CALL_SLACK_S = 1.0


def _call_slack(timeout: float) -> float:
    """Of an unpublish's ``timeout``, what the call keeps beyond the drain (alone or in a Batch)."""
    return min(_UNPUBLISH_CALL_SLACK_S, timeout / 4)
log = logging.getLogger(__name__)


class Holdings:
    """The publishing side of a Hub: agent session, heartbeats, publications,
    retention copies and unpublish-with-drain. Thread-safe."""

    def __init__(self, *, rpc: ReferenceClient, nixl: NixlAgent, agent_id: str, name: str,
                 config: HubConfig) -> None:
        self._rpc, self._nixl = rpc, nixl
        self.agent_id, self.name, self.config = agent_id, name, config
        self._lock = threading.RLock()
        self._publications: dict[str, Publication] = {}
        self._replica_seq = itertools.count()
        self._instance_id = ""
        self.lease_ttl_s = 10.0
        self._retain_spares: dict[tuple, list[list[torch.Tensor]]] = {}
        self._releasing: set[str] = set()
        # Filling replicas whose chunk report the server missed (it was away, or
        # had forgotten the replica): the heartbeat announces them again, bitmap included.
        self._unreported: set[str] = set()
        # Replicas held when the server restarted: the new instance does not know
        # the read leases the old one granted on them; those end by this time.
        self._unknown_reads_until: dict[str, float] = {}
        # Replicas unpublished while the server was out of reach (closed after one
        # lease TTL): the server still lists them until told. Sent after the next
        # heartbeat gets through, and before this process publishes again.
        self._withdraw_notices: set[str] = set()
        # Slow housekeeping off the heartbeat thread (releasing retained copies drains readers).
        self._chores = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensorhub-chores")
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # ---------------------------------------------------------------- session

    def register(self, wait_s: float = 0.0) -> None:
        """Register the agent (retrying up to ``wait_s``) and announce what it holds."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                instance, lease_ttl = self._rpc.register_agent(
                    self.agent_id, self.name, self.config.labels, self.config.reliability)
                break
            except ServerUnavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
        with self._lock:
            changed = self._instance_id != instance
            if changed and self._instance_id:  # a restart, not this agent's first registration
                until = time.monotonic() + lease_ttl
                self._unknown_reads_until.update(dict.fromkeys(self._publications, until))
            self._instance_id, self.lease_ttl_s = instance, lease_ttl
            pubs = [p for p in self._publications.values() if p.announced]
        if changed and pubs:
            log.info("reference server %s: re-registering %d replica(s)", instance[:8], len(pubs))
        for pub in pubs:
            self._announce(pub)

    def with_agent(self, fn: Callable[[], T]) -> T:
        """Run an RPC; if the server forgot this agent, register again and retry once."""
        try:
            return fn()
        except AgentUnknown:
            self.register()
            return fn()

    def control_plane(self) -> AgentBound:
        """The server as a pull talks to it mid-way (resolve, leases, lost
        reports): each call goes through ``with_agent``."""
        return AgentBound(self)

    def start_heartbeats(self) -> None:
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="tensorhub-heartbeat", daemon=True)
        self._heartbeat.start()

    def _heartbeat_loop(self) -> None:
        # A few heartbeats per lease TTL: each confirms the replicas held, and
        # the server cuts read leases on a replica one TTL after its last confirmation.
        while not self._stop.wait(min(self.config.heartbeat_interval_s, self.lease_ttl_s / 3)):
            try:
                if not self._resolve_stood_in():
                    self._heartbeat_once()
            except ServerUnavailable as e:
                log.debug("heartbeat: %s", e)
            except Exception:
                log.exception("heartbeat failed")

    def _resolve_stood_in(self) -> bool:
        """True when this heartbeat may be skipped (fewer calls on a busy server):
        a Resolve sent less than an interval ago was answered by the server
        instance this agent registered with (a Resolve keeps its agent alive,
        and a restart shows as a new instance id), and this process holds
        nothing and owes the server no word (a heartbeat lists the replicas
        held: it confirms them and learns which ones the server forgot, which a
        Resolve cannot; and it sends the withdraw notices of replicas let go
        while the server was out of reach)."""
        instance, sent = self._rpc.last_resolve
        if instance != self._instance_id or time.monotonic() - sent >= self.config.heartbeat_interval_s:
            return False
        with self._lock:
            return not self._publications and not self._unreported and not self._withdraw_notices

    def _heartbeat_once(self) -> None:
        timeout = max(self.config.heartbeat_interval_s, 1.0)
        with contextlib.ExitStack() as confirming:
            # Entered under the lock that ends a drain: an unpublish that stops
            # draining sees every confirmation sent of it in ``confirmed_by()``.
            with self._lock:
                pubs = [p for p in self._publications.values()
                        if (p.announced or p.draining) and not p.announce_pending]
                for pub in pubs:
                    confirming.enter_context(pub.confirming(timeout))
            instance, known, unknown, release = self._rpc.heartbeat(self.agent_id, [p.replica_id for p in pubs],
                                                                    timeout=timeout)
        if not known or instance != self._instance_id:
            self.register()  # announces every replica again, bitmaps included
            with self._lock:
                self._unreported.clear()
                self._withdraw_notices.clear()  # a new instance never heard of them
            return
        self._send_withdraw_notices()
        with self._lock:
            unreported, self._unreported = self._unreported, set()
        for rid in unreported:
            with self._lock:
                pub = self._publications.get(rid)
            if pub is not None and pub.announced:
                try:
                    self._announce(pub)
                except TensorHubError as e:  # the next heartbeat tries again
                    log.debug("announcing %s again: %s", rid, e)
                    with self._lock:
                        self._unreported.add(rid)
        for rid in release:
            with self._lock:
                pub = self._publications.get(rid)
                if pub is None or not pub.retained or not pub.announced or rid in self._releasing:
                    continue
                self._releasing.add(rid)
            self._chores.submit(self._release_retained, pub)
        for rid in unknown:
            with self._lock:
                pub = self._publications.get(rid)
            if pub is not None and pub.announced:
                log.info("server dropped replica %s; publishing it again", rid)
                self._announce(pub)

    # ---------------------------------------------------------------- publishing

    def publish(self, model: str, version: int, manifest: Manifest, parts: list[Part], chunk_size: int, *,
                origin: bool = True, complete: bool = True, retained: bool = False,
                chunk_crc32: np.ndarray | None = None, announce: bool = True, deltas: tuple[str, ...] = (),
                companions: tuple[Publication, ...] = (), trainer_cut: bool = False,
                replica_id: str | None = None) -> Publication:
        """Register ``parts`` in place and announce them as a replica. A complete
        replica's chunk checksums are computed here, once, from its memory
        (unless given: a copy of a replica has its checksums). ``announce=False``:
        the caller announces it (``announce``), e.g. off a pull's critical path;
        unpublishing it before then is fine (the server counts it as drained).
        ``deltas``/``companions``: the delta models announced with it and their
        publications, unpublished with it (``tensorhub.client.delta``).
        ``trainer_cut``: the replica is this trainer rank's copy of its readers'
        cut, beside its shards (``tensorhub.client.trainercut``). ``replica_id``:
        one ``next_replica_id`` reserved (an announce sent ahead named it)."""
        if not retained:
            self._send_withdraw_notices()
            self._finish_withdrawals(model, version)
        if chunk_crc32 is None and complete and self.config.verify_chunks:
            chunk_crc32 = _checksums(parts, chunk_size)
        registration = self._nixl.register([p.tensor for p in parts])
        pub = Publication(self, model=model, version=version, replica_id=replica_id or self.next_replica_id(),
                          manifest=manifest, parts=parts, chunk_size=chunk_size, registration=registration,
                          origin=origin, complete=complete, retained=retained, chunk_crc32=chunk_crc32,
                          deltas=deltas, companions=companions, trainer_cut=trainer_cut)
        pub.announce_pending = not announce
        try:
            if announce:
                self.announce(pub)
        except ServerUnavailable as e:
            if e.maybe_applied:
                self._withdraw_unanswered(pub, e)
            else:
                self._nixl.deregister(registration)
            raise
        except BaseException:
            self._nixl.deregister(registration)
            raise
        with self._lock:
            self._publications[pub.replica_id] = pub
        return pub

    def next_replica_id(self) -> str:
        """A replica id of this process never used before."""
        return f"{self.agent_id}.{next(self._replica_seq)}"

    def drop_unopened(self, replica_id: str) -> None:
        """A replica announced ahead (``tensorhub.client.ahead``) that no pull
        opened: the server is told before this process publishes again."""
        with self._lock:
            self._withdraw_notices.add(replica_id)

    def _withdraw_unanswered(self, pub: Publication, error: ServerUnavailable) -> None:
        """A publish whose answer was lost may still have been taken: the server
        may list the replica and lease it to readers, who then read memory the
        caller reuses once the publish has failed (the fault campaign's readers
        caught a trainer's next version in a replica whose publish had timed out,
        by its checksums). So withdraw it as any replica before raising: with
        the server back, its readers drain; else its leases run out first. Held
        here (memory alive) until that unpublish succeeds."""
        with self._lock:
            self._publications[pub.replica_id] = pub
        log.warning("publish %r v%d: %s; withdrawing it in case the server took it", pub.model, pub.version, error)
        try:
            self.unpublish(pub, self.lease_ttl_s + 1, force=True)  # failed: nothing of it to retain
        except TensorHubError as e:  # kept as withdrawing: finished before the version is published again
            log.warning("publish %r v%d: withdrawing the unanswered replica: %s", pub.model, pub.version, e)

    def announce(self, pub: Publication) -> None:
        """Tell the server about ``pub`` (published with ``announce=False``)."""
        self.with_agent(lambda: self._announce(pub))

    def _send_withdraw_notices(self) -> bool:
        """Tell the server of replicas this process let go while it could not
        reach it; else it keeps listing them (unleasable, their holder silent)
        and refuses this agent another replica of the same version. True if
        a notice was delivered."""
        with self._lock:
            notices = list(self._withdraw_notices)
        delivered = False
        for rid in notices:
            try:
                self._rpc.unpublish(self.agent_id, rid, 0.0, force=True)
                delivered = True
            except (ServerUnavailable, AgentUnknown) as e:  # the next heartbeat tries again
                log.debug("withdraw notice for %s: %s", rid, e)
                return delivered
            except TensorHubError as e:  # the server no longer has it: nothing to tell
                log.debug("withdraw notice for %s: %s", rid, e)
            with self._lock:
                self._withdraw_notices.discard(rid)
        return delivered

    def _finish_withdrawals(self, model: str, version: int) -> None:
        """Unpublish again this process's replicas of (model, version) whose
        unpublish timed out (e.g. a failed serving pull's, while the server was
        out of reach): the server allows one replica per agent and version, and
        may still count them. UnpublishTimeout if one still cannot go."""
        with self._lock:
            stale = [p for p in self._publications.values()
                     if (p.model, p.version) == (model, version) and not p.retained
                     and p.state is PubState.WITHDRAWING]
        for pub in stale:
            log.info("%r v%d: finishing the unpublish of %s first", model, version, pub.replica_id)
            self.unpublish(pub, self.lease_ttl_s + 1)

    def open_filling(self, model: str, version: int, manifest: Manifest, parts: list[Part],
                     chunk_size: int, sources: Sequence[RemoteReplica] = (), *,
                     announce: bool = True, replica_id: str | None = None) -> Publication:
        """A pull's destination, served as its chunks land (see ``landed``).
        Where it holds what one of ``sources`` holds, cut the same way, it
        announces that source's checksums: they belong to the version, and its
        readers check against them what it serves (it serves only checked chunks)."""
        crcs, derive = None, False
        if self.config.verify_chunks:
            crcs = _same_layout_checksums(manifest, parts, chunk_size, sources)
            # No source is cut like this: its own checksums, each computed as its
            # chunk lands (from the bytes checked against their sources where
            # they could be), so that what it serves is checkable by its readers
            # and bytes that change in its memory later do not travel on.
            derive = crcs is None and all(p.tensor.device.type == "cpu" and p.tensor.is_contiguous() for p in parts)
            if derive:
                crcs = np.zeros(-(-sum(p.nbytes for p in parts) // chunk_size), np.uint32)
        pub = self.publish(model, version, manifest, parts, chunk_size, origin=False, complete=False,
                           chunk_crc32=crcs, announce=announce, replica_id=replica_id)
        pub.derives_crc32 = derive
        return pub

    def landed_here(self, pub: Publication, chunks: list[int],
                    tell: Callable[[list[int], np.ndarray | None], bool] | None = None) -> bool:
        """Chunks of a filling ``pub`` landed: their checksums, its bitmap, and
        ``tell`` (the pull's chunk news to its peers, ``peernews``) before the
        server hears of them (``report_landed``). Whether news reached a peer."""
        crcs = None
        if pub.derives_crc32 and chunks:
            # Before the bitmap: an announce sends the bitmap it read first and
            # these after, so every chunk the server lists comes with its checksum.
            crcs = some_chunk_checksums([p.tensor for p in pub.parts], pub.chunk_size, chunks)
            pub.chunk_crc32[chunks] = crcs
        pub.mark_landed(chunks)
        return bool(tell is not None and chunks and tell(chunks, crcs))

    def report_landed(self, pub: Publication, chunks: list[int], complete: bool = False) -> None:
        """Tell the server of chunks ``landed_here`` marked (``complete``: the last report)."""
        crcs = pub.chunk_crc32[chunks].tolist() if pub.derives_crc32 and chunks else None
        if complete:
            with pub.lock:
                if pub.state is PubState.FILLING:
                    pub.state = PubState.COMPLETE
        try:
            with pub.confirming(2 * self._rpc.timeout_s):  # with_agent may call twice
                self.with_agent(lambda: self._rpc.report_chunks(self.agent_id, pub.replica_id, chunks, complete,
                                                                crcs))
        except (ServerUnavailable, ReplicaUnknown) as e:
            # The bytes are here and the bitmap says so: a server that restarted or
            # was out of reach hears it from the next heartbeat, rather than the
            # pull that serves them failing.
            log.info("chunk report for %s deferred to the heartbeat: %s", pub.replica_id, e)
            with self._lock:
                self._unreported.add(pub.replica_id)

    def hold_complete(self, pub: Publication, chunks: list[int]) -> bytes:
        """``report_landed(complete=True)``, encoded instead of sent: another
        member of the pull's group sends it with the others' (``Hub.send_group_reports``).
        Until the server has it, the server lists ``pub`` as filling with the
        chunks reported before; a report the group could not deliver goes with
        the next heartbeat (``report_later``)."""
        crcs = pub.chunk_crc32[chunks].tolist() if pub.derives_crc32 and chunks else None
        with pub.lock:
            if pub.state is PubState.FILLING:
                pub.state = PubState.COMPLETE
        return self._rpc.complete_report(self.agent_id, pub.replica_id, chunks, crcs)

    def report_later(self, pub: Publication) -> None:
        """A held report of ``pub`` did not reach the server: the next heartbeat
        announces it again, its bitmap (complete) included."""
        with self._lock:
            self._unreported.add(pub.replica_id)

    def _announce(self, pub: Publication) -> None:
        with pub.lock:
            bitmap, complete = bytes(pub.bitmap), pub.complete
        try:
            with pub.confirming(self._rpc.timeout_s):
                self._publish(pub, bitmap, complete)
            pub.announce_pending = False
        except AlreadyPublished:
            # publish() sends pending withdraw notices first, but the server may
            # have been out of reach then and back by now (a serving pull
            # announces later, on its reports thread): the replica it still
            # lists may be one this process let go. Tell it, try once more.
            if not self._send_withdraw_notices():
                raise
            with pub.confirming(self._rpc.timeout_s):
                self._publish(pub, bitmap, complete)
            pub.announce_pending = False

    def _publish(self, pub: Publication, bitmap: bytes, complete: bool) -> None:
        self._rpc.publish(**self._publish_args(pub, bitmap, complete))

    def announce_args(self, pub: Publication, *, bitmap: bytes, complete: bool) -> dict[str, Any]:
        """What ``pub``'s announce would say with this bitmap (``ReferenceClient.publish``'s arguments)."""
        return self._publish_args(pub, bitmap, complete)

    def _publish_args(self, pub: Publication, bitmap: bytes, complete: bool) -> dict[str, Any]:
        return {"agent_id": self.agent_id, "replica_id": pub.replica_id, "model": pub.model, "version": pub.version,
                "manifest": pub.manifest, "held": [] if pub.whole_model else pub.held, "chunk_size": pub.chunk_size,
                "kind": pub.registration.kind, "regions": pub.registration.regions,
                "metadata": pub.registration.metadata, "complete": complete, "bitmap": bitmap, "origin": pub.origin,
                "retained": pub.retained, "chunk_crc32": pub.chunk_crc32, "deltas": pub.deltas,
                "trainer_cut": pub.trainer_cut}

    def announce_together(self, pubs: list[Publication], group: Any = None) -> None:
        """Announce ``pubs`` (published with ``announce=False``) in one message
        where each goes lean (a trainer rank's cut and shards, every step from
        the same buffers); else, and any the server did not take, one by one.
        ``group``: a torch.distributed process group whose every rank calls
        this at once (a trainer's ranks publishing with ``cut=``): its first
        rank sends every rank's lean announces, ``MAX_BATCH`` a message."""
        lean = [self.group_announce(p, lean_only=True) for p in pubs]
        mine = lean if pubs and all(lean) and (len(pubs) > 1 or group is not None) else []
        with contextlib.ExitStack() as confirming:
            for pub in pubs if mine else ():
                confirming.enter_context(pub.confirming(self._rpc.timeout_s))
            taken = self._announce_group(mine, group) if group is not None else self._announce_batch(mine)
        taken = taken or [False] * len(pubs)
        for pub, ok in zip(pubs, taken, strict=True):
            if ok:
                pub.announce_pending = False
            else:
                self.announce(pub)

    def _announce_batch(self, lean: list[bytes]) -> list[bool]:
        """Send ``lean`` announces in Batches; per announce whether the server took it."""
        taken = [False] * len(lean)
        for start in range(0, len(lean), MAX_BATCH):
            part = lean[start:start + MAX_BATCH]
            try:
                errors, _, _ = self.with_agent(lambda part=part: self._rpc.batch(self.agent_id, publishes=part))
            except TensorHubError as e:  # announced one by one (a publish is idempotent)
                log.info("announcing %d replicas in one message: %s; one by one", len(part), e)
                continue
            taken[start:start + len(part)] = [e is None for e in errors]
        return taken

    def _announce_group(self, lean: list[bytes], group: Any) -> list[bool]:
        """Every rank of ``group`` at once: the first sends all ranks' ``lean``
        announces (``_announce_batch``); each rank learns which of its own were taken."""
        return sent_by_first(lean, group, self._announce_batch)

    def group_announce(self, pub: Publication, *, lean_only: bool = False) -> bytes:
        """``announce(pub)`` encoded for another member of its group to send
        with the others' (``Hub.pull(announce_with=)``): lean where the server
        took this layout from this process before, else whole with its manifest
        named by fingerprint (``lean_only``: b"" then, and this process
        announces it itself). ``group_announce_taken`` once the server took it."""
        with pub.lock:
            bitmap, complete = bytes(pub.bitmap), pub.complete
        return self._rpc.group_publish(lean_only=lean_only, **self._publish_args(pub, bitmap, complete))

    def group_announce_taken(self, pub: Publication, data: bytes) -> None:
        """The group's Batch delivered ``data`` (``group_announce``) for ``pub``."""
        pub.announce_pending = False
        self._rpc.group_publish_taken(data)

    def find(self, model: str, version: int) -> list[Publication]:
        with self._lock:
            return [p for p in self._publications.values()
                    if (p.model, p.version) == (model, version) and not p.retained]

    def publications(self) -> list[Publication]:
        with self._lock:
            return list(self._publications.values())

    # ---------------------------------------------------------------- unpublish

    def unpublish(self, pub: Publication, timeout: float, *, force: bool = False, group: Any = None) -> None:
        """Withdraw ``pub`` and wait for its readers (``Publication.unpublish``).
        ``group``: every rank of this torch.distributed group withdraws its
        publication at once, the first rank sending all of them in one message."""
        if pub.cut is not None or group is not None:
            # Its cut and its shards in one message (a trainer rank's step), and
            # every rank's in the same one where the ranks withdraw together; the
            # cut is a copy of bytes the shards hold, so nothing of it is
            # retained. What the Batch did not finish goes alone, the cut first
            # (the shards' retention check then does not count it).
            start = time.monotonic()
            together = ([(pub.cut, True)] if pub.cut is not None else []) + [(pub, force)]
            done = self.withdraw_together(together, timeout, group=group)
            left = max(0.0, timeout - (time.monotonic() - start))
            if pub.cut is not None and pub.cut not in done:
                self.unpublish(pub.cut, left, force=True)
            if pub in done:
                return
            timeout = max(0.0, timeout - (time.monotonic() - start))
        if not self._begin_withdrawal(pub):
            return
        # Every wait below comes out of the caller's one ``timeout``.
        deadline = time.monotonic() + timeout

        slack = _call_slack(timeout)

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        def drain_s() -> float:
            return max(0.0, left() - slack)

        try:
            try:
                drained, outstanding, retain = self._rpc.unpublish(self.agent_id, pub.replica_id, drain_s(),
                                                                   force=force, call_slack_s=slack)
                if retain:
                    # The last reliable holder of a region of a retained version: keep
                    # the bytes in host memory of this process before letting go.
                    self._retain_copy(pub)
                    drained, outstanding, retain = self._rpc.unpublish(self.agent_id, pub.replica_id, drain_s(),
                                                                       call_slack_s=slack)
                    if retain:
                        raise TensorHubError(f"{pub.model!r} v{pub.version}: retention copy was not accepted")
            finally:
                with self._lock:
                    pub.draining = False
        except (ServerUnavailable, AgentUnknown) as e:
            # The server cannot say who still reads. Readers stop at their
            # lease's expiry, and the server ends every lease on this replica one
            # TTL after it last heard that the replica is held (heartbeats stopped
            # saying so when the drain call ended): waiting for that is safe, if the timeout leaves that long.
            until = max(time.monotonic(), pub.confirmed_by()) + self.lease_ttl_s
            wait = min(until - time.monotonic(), left())
            log.warning("unpublish %r v%d: %s; waiting %.1fs for read leases to expire", pub.model, pub.version, e, wait)
            time.sleep(max(0.0, wait))
            drained, outstanding = time.monotonic() >= until, -1
            if drained:
                with self._lock:
                    self._withdraw_notices.add(pub.replica_id)
        with self._lock:
            unknown_until = self._unknown_reads_until.get(pub.replica_id, 0.0)
        if drained and unknown_until > time.monotonic():
            # The server saw no reader, but readers leased by its previous instance
            # may still read: they stop when their leases run out.
            time.sleep(min(unknown_until - time.monotonic(), left()))
            drained, outstanding = time.monotonic() >= unknown_until, -1
        if not drained:
            who = (f"{outstanding} reader(s) still held read leases" if outstanding >= 0 else
                   "the server could not say whether readers still held read leases")
            raise UnpublishTimeout(
                f"{pub.model!r} version {pub.version}: {who} after {timeout:.1f}s; the replica is withdrawn, "
                "but its memory must not be reused yet: call unpublish again"
            )
        self._close(pub, left)

    def _begin_withdrawal(self, pub: Publication) -> bool:
        """Mark ``pub`` withdrawing (False: it is closed already)."""
        with self._lock, pub.lock:
            if pub.state is PubState.CLOSED:
                return False
            # From here on heartbeats must never publish it again: the server may
            # drop it any moment, and the caller is about to reuse the memory.
            pub.state = PubState.WITHDRAWING
            pub.draining = True
        return True

    def withdrawal(self, pub: Publication, timeout: float, *, force: bool = False) -> bytes:
        """Begin withdrawing ``pub``: its message, for a ``withdraw_batch`` that
        this process or another member of its group sends, drain included, within
        ``timeout``; b"" when it is closed already. Then ``withdrawn``."""
        if not self._begin_withdrawal(pub):
            return b""
        return self._rpc.withdrawal(self.agent_id, pub.replica_id, max(0.0, timeout - _call_slack(timeout)),
                                    force=force)

    def withdrawn(self, pub: Publication, outcome: tuple[bool, int, bool] | Exception | None,
                  timeout: float, *, force: bool = False) -> None:
        """``withdrawal``'s answer (None: never sent): a drained withdrawal closes
        ``pub`` here; anything else (a retention copy to make first, readers
        still leasing it, an error) is left to ``unpublish`` alone, which then
        raises as it would have."""
        if not self._closed_if_drained(pub, outcome, timeout):
            self.unpublish(pub, timeout, force=force)

    def withdraw_together(self, pubs: Sequence[tuple[Publication, bool]], timeout: float, *,
                          group: Any = None) -> set[Publication]:
        """Withdraw ``pubs`` ((publication, force) each) in one message; the
        ones that drained are closed, and returned. The others are left
        withdrawing, to ``unpublish`` alone. ``group``: every rank of it calls
        this at once, and the first sends every rank's withdrawals."""
        begun = [(p, self.withdrawal(p, timeout, force=force)) for p, force in pubs]
        sent = [(p, w) for p, w in begun if w]
        done = {p for p, w in begun if not w}
        if group is None and not sent:
            return done
        mine = [w for _, w in sent]
        slack = _call_slack(timeout)

        def send(every: list[bytes]) -> list:
            return self._withdraw_batches(every, slack)

        try:
            # With a group every rank takes part, with or without withdrawals of its own; a
            # rank that does not come within half the timeout fails the round: the other
            # half is left for each rank's withdrawal alone, drain included.
            outcomes: list = send(mine) if group is None else sent_by_first(mine, group, send, bound_s=timeout / 2)
        except TensorHubError as e:  # the group's round failed
            log.info("withdrawing %d replicas with the group's: %s; each goes alone", len(sent), e)
            outcomes = [None] * len(sent)
        done.update(p for (p, _), outcome in zip(sent, outcomes, strict=True)
                    if self._closed_if_drained(p, outcome, timeout))
        return done

    def _withdraw_batches(self, withdrawals: list[bytes], slack: float) -> list:
        """``withdrawals`` (a group's, or one rank's), ``MAX_BATCH`` a message, the messages sent
        at once (each waits for its drains: one after another, the last would
        drain past its timeout); per withdrawal its outcome, or None (not sent:
        it goes alone). Picklable, for every rank."""
        parts = [withdrawals[start:start + MAX_BATCH] for start in range(0, len(withdrawals), MAX_BATCH)]

        def send(part: list[bytes]) -> list:
            try:
                outcomes = self.with_agent(lambda: self._rpc.withdraw_batch(part, call_slack_s=slack))
            except TensorHubError as e:
                log.info("withdrawing %d replicas in one message: %s; each goes alone", len(part), e)
                return [None] * len(part)
            return [o if isinstance(o, tuple) else None for o in outcomes]

        if len(parts) <= 1:
            return [o for part in parts for o in send(part)]
        with cf.ThreadPoolExecutor(len(parts), thread_name_prefix="tensorhub-withdraw") as pool:
            return [o for outcomes in pool.map(send, parts) for o in outcomes]

    def _closed_if_drained(self, pub: Publication, outcome: tuple[bool, int, bool] | Exception | None,
                           timeout: float) -> bool:
        """Close ``pub`` if its withdrawal's ``outcome`` says it drained (and no
        reader of an earlier server instance may still read it): True if so."""
        with self._lock:
            pub.draining = False
            unknown = self._unknown_reads_until.get(pub.replica_id, 0.0) > time.monotonic()
        if not (isinstance(outcome, tuple) and outcome[0] and not outcome[2]) or unknown:
            return False
        self._close(pub, lambda: timeout)
        return True

    def _close(self, pub: Publication, left: Callable[[], float]) -> None:
        """The end of a drained withdrawal: forget ``pub``, release its memory registration."""
        with self._lock, pub.lock:
            if pub.state is PubState.CLOSED:  # another unpublish of it (a retry) finished first
                return
            self._publications.pop(pub.replica_id, None)
            self._unknown_reads_until.pop(pub.replica_id, None)
            pub.state = PubState.CLOSED
        self._nixl.deregister(pub.registration)
        # Its delta models after it: no reader finds them through it any more.
        # Nothing of a delta is retained (a reader without one pulls whole).
        for companion in pub.companions:
            self.unpublish(companion, left(), force=True)

    # ---------------------------------------------------------------- retention

    def _retain_copy(self, pub: Publication) -> Publication:
        """Copy a publication's regions into host memory (a reused buffer where
        one is free) and publish the copy as a retained replica."""
        key = tuple((p.name, p.region, p.tensor.dtype, p.tensor.numel()) for p in pub.parts)
        with self._lock:
            spares = self._retain_spares.get(key, [])
            buffers = spares.pop() if spares else None
        if buffers is None:
            buffers = [torch.empty(p.tensor.shape, dtype=p.tensor.dtype, device="cpu") for p in pub.parts]
        for buffer, part in zip(buffers, pub.parts):
            buffer.copy_(part.tensor)
        log.info("retaining %r v%d in host memory (%d bytes)", pub.model, pub.version, pub.nbytes)
        parts = [Part(p.name, p.full_shape, p.region, b) for p, b in zip(pub.parts, buffers)]
        return self.publish(pub.model, pub.version, pub.manifest, parts, pub.chunk_size, retained=True,
                            chunk_crc32=pub.chunk_crc32)

    def _release_retained(self, pub: Publication) -> None:
        """The server no longer needs this retained copy: drop it, keep its buffer."""
        try:
            self.unpublish(pub, 60.0, force=True)
        except TensorHubError as e:
            log.warning("releasing retained %r v%d: %s", pub.model, pub.version, e)
            return
        finally:
            with self._lock:
                self._releasing.discard(pub.replica_id)
        key = tuple((p.name, p.region, p.tensor.dtype, p.tensor.numel()) for p in pub.parts)
        with self._lock:
            spares = self._retain_spares.setdefault(key, [])
            if not spares:  # one spare buffer per layout is enough to avoid re-allocating
                spares.append([p.tensor for p in pub.parts])

    # ---------------------------------------------------------------- lifecycle

    def close(self, timeout: float) -> None:
        """Stop heartbeats and unpublish everything (nothing can be retained past
        this process)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        self._chores.shutdown(wait=True)
        for pub in self.publications():
            try:
                self.unpublish(pub, timeout, force=True)
            except TensorHubError as e:
                log.warning("close: %s", e)

    def shutdown_local(self) -> None:
        self._chores.shutdown(wait=True)


def _checksums(parts: list[Part], chunk_size: int) -> np.ndarray | None:
    """The chunk checksums of ``parts``' bytes, read in place; None for device
    memory (its readers then cannot check it: no copy to host is made for this)."""
    if not all(p.tensor.device.type == "cpu" and p.tensor.is_contiguous() for p in parts):
        log.info("chunk checksums are computed for host memory only; readers of this replica cannot check it")
        return None
    return chunk_checksums([p.tensor for p in parts], chunk_size)


def _same_layout_checksums(manifest: Manifest, parts: list[Part], chunk_size: int,
                           sources: Sequence[RemoteReplica]) -> np.ndarray | None:
    """The checksums of a source whose chunks are exactly those of ``parts``
    (the same regions in the same order, the same chunk size), if one has them."""
    index = manifest.index()
    held = tuple((index[p.name], p.region) for p in parts)
    for r in sources:  # a filling source's table is not whole yet (see open_filling)
        if r.chunk_crc32 is not None and r.source.complete and r.chunk_size == chunk_size and r.held == held:
            return r.chunk_crc32
    return None


class AgentBound:
    """A ``ReferenceClient`` whose calls re-register the agent and retry once
    when the server has forgotten it (it restarted, or the agent expired behind
    a saturated link). Found by tensorhub chaos: ``AgentUnknown`` escaped pulls
    whose mid-pull resolve or lease met a restarted server, although the pull
    could go on from the holders that re-announce themselves."""

    def __init__(self, holdings: Holdings) -> None:
        self._holdings = holdings

    def __getattr__(self, name: str) -> Callable[..., Any]:
        call = getattr(self._holdings._rpc, name)

        def bound(*args: Any, **kwargs: Any) -> Any:
            return self._holdings.with_agent(lambda: call(*args, **kwargs))

        return bound
