"""A pull whose source is withdrawn mid-way moves to the retained copy without
losing the version.

Found by ``tensorhub bench rl`` (standalone): the trainer steps while a rollout
pulls version v from it. Its unpublish of v keeps a retained host copy (a new
replica), and the puller, seeing the copy can give everything, let the
trainer's replica go at once. But the retained copy lives only until version
v+1 is published; nobody leased it yet, so it went too, and the pull failed
with SourceLost ("v has no complete replica"). The puller now leases the
holders that take over before it lets the withdrawn ones go.

The control plane is a fake (what the server does in that order); the bytes
move for real, with memmove, and are checked."""

from __future__ import annotations

import ctypes
import itertools
import time

import numpy as np
import pytest
import torch

from tensorhub.client.puller import PullJob
from tensorhub.client.readlayout import ReadLayout, ReadPart
from tensorhub.client.rpc import RemoteReplica, Resolved
from tensorhub.errors import TensorHubError, VersionNotFound
from tensorhub.manifest import Manifest, itemsize
from tensorhub.planner import Source
from tensorhub.regions import Region
from tensorhub.testing import GrantingLeases
from tensorhub.topology import Labels
from tensorhub.transport import MemoryKind
from tensorhub.transport.memory import regions_of
from tensorhub.transport.nixl import TransferFailed

CHUNK = 4096
POST_S = 0.01  # a READ takes this long to post: the pull spans several rounds


class SlowMemcpy:
    """READs are memmoves, each taking ``POST_S``; counts bytes per holder."""

    def __init__(self) -> None:
        self.read: dict[str, int] = {}

    def connect(self, key: str, metadata: bytes, regions: object = None) -> str:
        return key

    def post(self, remote, local, local_kind, remote_descs, remote_kind):
        time.sleep(POST_S)
        for (dst, n, _), (src, _, _) in zip(local.tolist(), remote_descs.tolist()):
            ctypes.memmove(dst, src, n)
        self.read[remote] = self.read.get(remote, 0) + int(local[:, 1].sum())

    def poll(self, pending) -> bool:
        return True

    def release(self, pending) -> None:
        pass

    def forget(self, key: str) -> None:
        pass


class SteppingTrainer:
    """The server's view while the trainer steps past the version being pulled:
    after ``switch_after`` resolves its replica is withdrawn (still readable
    under the leases it has) and its retained copy listed instead; the retained
    copy is let go once the trainer's own replica is released by its readers,
    unless a reader leased the copy by then (its unpublish waits for them)."""

    def __init__(self, manifest: Manifest, trainer: RemoteReplica, retained: RemoteReplica, switch_after: int):
        self.manifest, self.trainer, self.retained = manifest, trainer, retained
        self.switch_after, self.resolves = switch_after, 0
        self.leases: dict[str, list[str]] = {}
        self.retained_gone = False
        self._ids = itertools.count()

    def _listed(self) -> list[RemoteReplica]:
        if self.resolves <= self.switch_after:
            return [self.trainer]
        return [] if self.retained_gone else [self.retained]

    def resolve(self, agent_id, model, version, *, group="", group_round=0, lease=False, **_wait):
        self.resolves += 1
        listed = self._listed()
        if not listed:
            raise VersionNotFound(model, version, "no complete replica")
        return Resolved(model, 1, self.manifest, tuple(listed))

    def acquire_lease(self, agent_id, replica_ids):
        live = {r.source.replica_id for r in self._listed()}
        granted = [rid for rid in replica_ids if rid in live]
        lease_id = f"lease{next(self._ids)}"
        self.leases[lease_id] = granted
        return lease_id, granted, 60.0

    def renew_lease(self, agent_id, lease_id):
        return 60.0

    def release_lease_async(self, agent_id, lease_id):
        self.leases.pop(lease_id, None)
        held = {rid for rids in self.leases.values() for rid in rids}
        if self.resolves > self.switch_after and "trainer" not in held and "retained" not in held:
            self.retained_gone = True  # version v+1 is out: the copy goes unless someone reads it

    def report_lost(self, agent_id, replica_id, reason, stalled=False):
        raise AssertionError(f"nothing failed, yet {replica_id} was reported lost: {reason}")


def _replica(rid: str, manifest: Manifest, tensor: torch.Tensor) -> RemoteReplica:
    _, mem = regions_of([tensor])
    regions = np.array([(m.addr, m.size, 0) for m in mem], np.uint64).reshape(-1, 3)
    return RemoteReplica(Source(rid, rid, Labels("t"), origin=True), rid, MemoryKind.DRAM,
                         ((0, Region()),), regions, b"", CHUNK)


def _job(plane, transport, manifest: Manifest, dest: torch.Tensor, **options) -> PullJob:
    """One pull of version 1 of tensor "w" into ``dest``, as a reader does it."""
    _, mem = regions_of([dest])
    spec = manifest.tensors[0]
    parts = [ReadPart("w", 0, spec.shape, Region().runs(spec.shape), itemsize(spec.dtype), mem[0])]
    options = {"chunk_timeout_s": 5, **options}
    return PullJob(rpc=plane, nixl=transport, agent_id="reader", labels=Labels("r"),
                   resolved=plane.resolve("reader", "m", 1), layout=ReadLayout(manifest, parts, CHUNK),
                   dest_kind=MemoryKind.DRAM, in_flight=4, deadline=time.monotonic() + 30, **options)


def test_a_pull_moves_to_the_retained_copy_and_keeps_it_leased():
    weights = torch.arange(64 * CHUNK // 4, dtype=torch.int32)
    copy = weights.clone()  # the retained host copy: the same bytes elsewhere
    manifest = Manifest.of({"w": weights})
    plane = SteppingTrainer(manifest, _replica("trainer", manifest, weights), _replica("retained", manifest, copy),
                            switch_after=1)
    dest = torch.zeros_like(weights)
    transport = SlowMemcpy()
    _job(plane, transport, manifest, dest).run()
    assert torch.equal(dest, weights)
    assert transport.read.get("retained", 0) > 0, "the trainer's replica was never let go"
    assert not plane.leases, "every lease is released when the pull ends"


class SlowLink(SlowMemcpy):
    """A slow link's queue: READs finish one every ``STEP_S``, in the order posted."""

    STEP_S = 0.05

    def __init__(self) -> None:
        super().__init__()
        self.queue: list[list[bool]] = []
        self.next_at = 0.0

    def post(self, remote, local, local_kind, remote_descs, remote_kind):
        for (dst, n, _), (src, _, _) in zip(local.tolist(), remote_descs.tolist()):
            ctypes.memmove(dst, src, n)
        if not self.queue:
            self.next_at = time.monotonic() + self.STEP_S
        handle = [False]
        self.queue.append(handle)
        return handle

    def poll(self, pending) -> bool:
        while self.queue and time.monotonic() >= self.next_at:
            self.queue.pop(0)[0] = True
            self.next_at += self.STEP_S
        return pending[0]


def test_a_read_queued_behind_others_on_a_slow_link_is_not_a_stall():
    """Found by the fault campaign (IntegrityErrors next to slow readers): a READ's
    deadline ran from when it was posted, so with 8 in flight on a slow link the
    last ones "stalled" while the link was busy with the first; the source was
    given up and its chunks read again while the first READs could still land.
    Now a READ stalls only when its source finishes no READ for ``chunk_timeout_s``."""
    weights = torch.arange(16 * CHUNK // 4, dtype=torch.int32)
    manifest = Manifest.of({"w": weights})
    plane = SteppingTrainer(manifest, _replica("trainer", manifest, weights), _replica("retained", manifest, weights),
                            switch_after=10**6)  # report_lost fails the test
    dest = torch.zeros_like(weights)
    _, mem = regions_of([dest])
    spec = manifest.tensors[0]
    parts = [ReadPart("w", 0, spec.shape, Region().runs(spec.shape), itemsize(spec.dtype), mem[0])]
    job = PullJob(rpc=plane, nixl=SlowLink(), agent_id="reader", labels=Labels("r"),
                  resolved=plane.resolve("reader", "m", 1), layout=ReadLayout(manifest, parts, CHUNK),
                  dest_kind=MemoryKind.DRAM, in_flight=8, chunk_timeout_s=4 * SlowLink.STEP_S,
                  deadline=time.monotonic() + 30)
    stats = job.run()
    assert torch.equal(dest, weights) and stats.lost_sources == []


def test_a_failed_pull_lets_its_reads_still_out_finish_before_it_returns():
    """Found by the fault campaign (1 mismatch in 504 pulls): a slow reader's pull
    failed with READs still on the wire and released them unfinished; the next
    pull's new tensors, allocated at the same addresses, took their late bytes."""
    weights = torch.arange(16 * CHUNK // 4, dtype=torch.int32)
    manifest = Manifest.of({"w": weights})
    plane = SteppingTrainer(manifest, _replica("trainer", manifest, weights), _replica("retained", manifest, weights),
                            switch_after=10**6)
    dest = torch.zeros_like(weights)
    _, mem = regions_of([dest])
    spec = manifest.tensors[0]
    parts = [ReadPart("w", 0, spec.shape, Region().runs(spec.shape), itemsize(spec.dtype), mem[0])]
    link = SlowLink()
    released_unfinished = []
    link.release = lambda pending: released_unfinished.append(not pending[0]) if not pending[0] else None

    def fail(done: int, total: int) -> None:
        raise KeyboardInterrupt  # the caller gives up mid-pull

    job = PullJob(rpc=plane, nixl=link, agent_id="reader", labels=Labels("r"),
                  resolved=plane.resolve("reader", "m", 1), layout=ReadLayout(manifest, parts, CHUNK),
                  dest_kind=MemoryKind.DRAM, in_flight=8, chunk_timeout_s=2.0, progress=fail,
                  deadline=time.monotonic() + 30)
    with pytest.raises(KeyboardInterrupt):
        job.run()
    assert released_unfinished == [], f"{len(released_unfinished)} READs released while still on the wire"


class DisconnectsOnPoll(SlowMemcpy):
    """A source whose link broke as its READ was posted: the post succeeds,
    polling it raises (NIXL_ERR_REMOTE_DISCONNECT); nothing of it lands."""

    def post(self, remote, local, local_kind, remote_descs, remote_kind):
        if remote == "broken":
            return "broken-read"
        super().post(remote, local, local_kind, remote_descs, remote_kind)
        return "read"

    def poll(self, pending) -> bool:
        if pending == "broken-read":
            raise TransferFailed("broken", "nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT")
        return True


class TwoHolders(GrantingLeases):
    def __init__(self, manifest: Manifest, replicas: list[RemoteReplica]) -> None:
        self.manifest, self.replicas, self.lost = manifest, replicas, []

    def resolve(self, agent_id, model, version, *, group="", group_round=0, lease=False, **_wait):
        live = [r for r in self.replicas if r.source.replica_id not in self.lost]
        return Resolved(model, 1, self.manifest, tuple(live))

    def report_lost(self, agent_id, replica_id, reason, stalled=False):
        self.lost.append(replica_id)


def test_a_read_that_fails_as_soon_as_it_is_posted_fails_its_source_over():
    """Found by the fault campaign (one untyped failure in 10 minutes): with
    checks on, the puller polls each READ right after posting it (landed at
    once over shared memory: checked while in cache); a READ whose source had
    just disconnected raised from that poll, out of the pull, untyped."""
    weights = torch.arange(64 * CHUNK // 4, dtype=torch.int32)
    copy = weights.clone()
    manifest = Manifest.of({"w": weights})
    plane = TwoHolders(manifest, [_replica("broken", manifest, weights), _replica("good", manifest, copy)])
    dest = torch.zeros_like(weights)
    stats = _job(plane, DisconnectsOnPoll(), manifest, dest, verify=True).run()
    assert torch.equal(dest, weights)
    assert plane.lost == ["broken"] and stats.lost_sources == ["broken"]


class FinishesLate(SlowMemcpy):
    """The slow holder's READs finish ``LATE_S`` after they were posted, and
    the reader's thread is off the CPU meanwhile (a loaded 2-core machine): the
    first poll of one returns only then, finished. The other holder's at once."""

    LATE_S = 1.2

    def post(self, remote, local, local_kind, remote_descs, remote_kind):
        super().post(remote, local, local_kind, remote_descs, remote_kind)
        return (remote, time.monotonic())

    def poll(self, pending) -> bool:
        remote, posted = pending
        if remote == "slow":
            time.sleep(max(0.0, posted + self.LATE_S - time.monotonic()))
        return True


class ShortLeases(TwoHolders):
    """Leases of 1 s that cannot be renewed: "slow" is withdrawing (no new
    lease covers it after the first)."""

    def acquire_lease(self, agent_id, replica_ids):
        granted = [rid for rid in replica_ids if rid != "slow" or not self.lost]
        self.lost.append("slow")  # what the server answers from now on
        return "lease", granted, 1.0

    def renew_lease(self, agent_id, lease_id):
        raise TensorHubError("lease gone: its holder stopped confirming it")


def test_a_read_seen_finished_only_after_its_lease_ran_out_is_not_taken():
    """Found by the fault campaign (2 IntegrityErrors in 10 minutes, each on a
    reader capped at 16 Mbit/s): on a slow link a READ's bytes leave the holder
    as the link takes them, so a READ that finished after its read lease ran
    out may carry memory the holder had already reused (here: the trainer's
    next version). The checksums caught it; a relay without checksums would
    not have. Such a READ is now read again, under a new lease (which a
    withdrawn holder does not get)."""
    weights = torch.arange(16 * CHUNK // 4, dtype=torch.int32)
    copy = weights.clone()
    manifest = Manifest.of({"w": weights})
    plane = ShortLeases(manifest, [_replica("slow", manifest, weights), _replica("good", manifest, copy)])
    weights.add_(1)  # the slow holder reused its memory: whatever it sends now is wrong
    dest = torch.zeros_like(weights)
    transport = FinishesLate()
    _job(plane, transport, manifest, dest, verify=False).run()
    assert torch.equal(dest, copy)
    assert transport.read.get("good", 0) >= dest.nbytes // 2  # what came late from "slow" was read again here


class StallsThenLands(SlowMemcpy):
    """The "stuck" holder's READs finish ``LAND_S`` after posting, long past the
    reader's chunk timeout (a link cut, then restored): their bytes land then.
    Records READs released while unfinished, and when the late ones landed."""

    LAND_S = 0.8

    def __init__(self) -> None:
        super().__init__()
        self.released_unfinished: list[str] = []
        self.landed_late: list[float] = []

    def post(self, remote, local, local_kind, remote_descs, remote_kind):
        if remote == "stuck":
            return ["stuck", time.monotonic() + self.LAND_S, local, remote_descs]
        super().post(remote, local, local_kind, remote_descs, remote_kind)
        return ["ok"]

    def poll(self, pending) -> bool:
        if pending[0] == "stuck" and len(pending) == 4:
            if time.monotonic() < pending[1]:
                return False
            for (dst, n, _), (src, _, _) in zip(pending[2].tolist(), pending[3].tolist()):
                ctypes.memmove(dst, src, n)
            self.landed_late.append(time.monotonic())
            del pending[2:]
        return True

    def release(self, pending) -> None:
        if len(pending) == 4:
            self.released_unfinished.append(pending[0])


class RecordsReleases(TwoHolders):
    def __init__(self, manifest: Manifest, replicas: list[RemoteReplica]) -> None:
        super().__init__(manifest, replicas)
        self.released_at: list[float] = []

    def release_lease_async(self, agent_id, lease_id):
        self.released_at.append(time.monotonic())


def test_a_read_given_up_on_is_polled_until_it_ends_under_the_pulls_leases():
    """A stalled READ cannot be cancelled (NIXL 1.5 releases it, UCX may still
    complete it: a link cut, then restored). Released at once, its bytes could
    land later, read from memory its holder reused after the pull's lease
    went. Now it is kept and polled, and the pull's leases are released only
    after it ended (here within the pull's drain time)."""
    weights = torch.arange(32 * CHUNK // 4, dtype=torch.int32)
    copy = weights.clone()
    manifest = Manifest.of({"w": weights})
    plane = RecordsReleases(manifest, [_replica("stuck", manifest, weights), _replica("good", manifest, copy)])
    dest = torch.zeros_like(weights)
    transport = StallsThenLands()
    stats = _job(plane, transport, manifest, dest, verify=False, chunk_timeout_s=0.6).run()
    assert torch.equal(dest, copy) and stats.lost_sources == ["stuck"]
    assert transport.released_unfinished == [], "a READ was released while it could still land"
    assert transport.landed_late and plane.released_at
    assert min(plane.released_at) >= max(transport.landed_late), "a lease went before a READ under it ended"


class StallsUntilFailureDetection(StallsThenLands):
    LAND_S = 2.0  # past the pull's end plus its chunk timeout: a vanished source UCX has not failed yet


@pytest.mark.parametrize("detection_s", [None, 2.0])
def test_a_pulls_drain_outlasts_the_transports_failure_detection(detection_s):
    """The fault campaign with UCX's TCP failure detection off had three pulls
    whose given-up READs landed a newer version's bytes after the pull ended.
    The drain waits as long as the transport takes to fail such a READ
    (NixlAgent.failure_detection_s, from UCX's settings), not just the chunk
    timeout; unknown (None), it waits the chunk timeout only and releases the
    READ unfinished, which is what this test tells apart."""
    weights = torch.arange(32 * CHUNK // 4, dtype=torch.int32)
    copy = weights.clone()
    manifest = Manifest.of({"w": weights})
    plane = RecordsReleases(manifest, [_replica("stuck", manifest, weights), _replica("good", manifest, copy)])
    transport = StallsUntilFailureDetection()
    dest = torch.zeros_like(weights)
    stats = _job(plane, transport, manifest, dest, verify=False, chunk_timeout_s=0.6,
                 failure_detection_s=detection_s).run()
    assert torch.equal(dest, copy) and stats.lost_sources == ["stuck"]
    if detection_s is None:
        assert set(transport.released_unfinished) == {"stuck"}  # released while they could still land
    else:
        assert transport.released_unfinished == [], "a READ was released before the transport could fail it"
        assert transport.landed_late


def test_drain_time_from_the_chunk_timeout_and_the_failure_detection():
    from tensorhub.client.puller import drain_s

    assert drain_s(10.0, None) == 5.0 and drain_s(2.0, None) == 2.0  # a live source ends within its timeout
    assert drain_s(2.0, 5.0) == 5.5  # TensorHub's UCX defaults: a vanished source's READ has failed by then
    assert drain_s(10.0, 30.0) == 30.5  # a user's longer TCP timeout: a longer drain, not late bytes
    assert drain_s(2.0, float("inf")) == 2.0  # detection off: it cannot be waited out (warned at agent start)


def test_ucx_failure_detection_is_read_from_the_tcp_settings():
    from tensorhub.transport.nixl import failure_detection_s

    assert failure_detection_s({}) == 5.0  # the defaults: user timeout 5 s, keepalive 1 + 1 x 3 s
    assert failure_detection_s({"UCX_TCP_USER_TIMEOUT": "30s"}) == 30.0
    assert failure_detection_s({"UCX_TCP_KEEPIDLE": "10s", "UCX_TCP_KEEPINTVL": "500ms"}) == 11.5
    assert failure_detection_s({"UCX_TCP_KEEPCNT": "inf"}) == float("inf")
    assert failure_detection_s({"UCX_TCP_USER_TIMEOUT": "inf"}) == float("inf")
    assert failure_detection_s({"UCX_TCP_USER_TIMEOUT": "auto"}) is None  # the system's own: not known


def _checked_against_a_relay(plain: torch.Tensor, weights: torch.Tensor):
    """A pull whose bytes all come from "plain", a holder without checksums,
    after "broken" (cut like the reader, with the version's checksums) failed
    its READs: no holder chunk can be checked, yet every reader chunk can,
    whole, against broken's table."""
    import dataclasses

    from tensorhub.integrity import chunk_checksums

    manifest = Manifest.of({"w": weights})
    held = weights.clone()
    broken = dataclasses.replace(_replica("broken", manifest, held), chunk_crc32=chunk_checksums([weights], CHUNK))
    plane = TwoHolders(manifest, [broken, _replica("plain", manifest, plain)])
    plane.keep_alive = (held, plain)  # a replica lists addresses only: its memory must outlive the pull
    dest = torch.zeros_like(weights)
    return plane, dest, _job(plane, DisconnectsOnPoll(), manifest, dest, verify=True)


def test_chunks_no_holder_check_covers_are_checked_whole_against_a_holder_cut_alike():
    weights = torch.arange(16 * CHUNK // 4, dtype=torch.int32)
    plane, dest, job = _checked_against_a_relay(weights.clone(), weights)
    stats = job.run()
    assert torch.equal(dest, weights) and plane.lost == ["broken"]
    assert stats.verified_bytes == dest.nbytes and stats.unverified_bytes == 0


def test_a_chunk_that_fails_its_whole_check_is_read_again_then_fails_the_pull():
    """Before, bytes of holder chunks that no check covered were settled
    unchecked: a wrong byte from a source without checksums (or a holder chunk
    read from two holders) reached the caller and the reader's own readers."""
    from tensorhub.errors import IntegrityError

    weights = torch.arange(16 * CHUNK // 4, dtype=torch.int32)
    plain = weights.clone()
    plain[5 * CHUNK // 4 + 7] += 1  # reader chunk 5 is wrong at "plain"
    _, _, job = _checked_against_a_relay(plain, weights)
    with pytest.raises(IntegrityError, match="chunk 5 failed its check against broken's checksum each time"):
        job.run()


class CorruptsOnce(DisconnectsOnPoll):
    """As ``DisconnectsOnPoll``, and the first READ from "plain" that lands the
    byte at ``address`` lands it wrong (a bad wire, once)."""

    def __init__(self, address: int) -> None:
        super().__init__()
        self.address, self.done = address, False

    def post(self, remote, local, local_kind, remote_descs, remote_kind):
        pending = super().post(remote, local, local_kind, remote_descs, remote_kind)
        for dst, n, _ in local.tolist():
            if remote == "plain" and not self.done and dst <= self.address < dst + n:
                ctypes.c_uint8.from_address(self.address).value ^= 1
                self.done = True
        return pending


def test_a_chunk_that_fails_its_whole_check_once_is_read_again_and_counted():
    """The pull ends byte-exact, and says what the checks caught: one chunk
    read from a holder without checksums, checked whole, no culprit."""
    weights = torch.arange(16 * CHUNK // 4, dtype=torch.int32)
    plane, dest, job = _checked_against_a_relay(weights.clone(), weights)
    job.nixl = CorruptsOnce(dest.data_ptr() + 5 * CHUNK + 7)
    stats = job.run()
    assert job.nixl.done and torch.equal(dest, weights) and plane.lost == ["broken"]
    assert (stats.checks_failed, stats.checks_failed_unplaced) == (1, 1) and stats.corrupt_sources == []
    assert stats.verified_bytes == dest.nbytes and stats.unverified_bytes == 0


def _read_in_halves(weights: torch.Tensor, dest: torch.Tensor, checksummed: dict[str, bool]):
    """A verifier over ``dest`` (one tensor, two chunks) whose reader chunk 0
    landed half from each holder in ``checksummed`` (name -> whether it lists
    the version's checksums); every holder is cut like the reader."""
    import dataclasses

    from tensorhub.client.transfer import Transfer
    from tensorhub.client.verify import ChunkVerifier
    from tensorhub.integrity import chunk_checksums

    manifest = Manifest.of({"w": weights})
    _, mem = regions_of([dest])
    spec = manifest.tensors[0]
    layout = ReadLayout(manifest, [ReadPart("w", 0, spec.shape, Region().runs(spec.shape), 4, mem[0])], CHUNK)
    crcs = chunk_checksums([weights], CHUNK)
    checks = ChunkVerifier(True, layout)
    for name, with_crcs in checksummed.items():
        r = _replica(name, manifest, weights)
        r = dataclasses.replace(r, chunk_crc32=crcs) if with_crcs else r
        checks.add_holder(r, layout.holder_table(r))
    half = CHUNK // 2
    desc = lambda off: np.array([[mem[0].addr + off, half, 0]], np.int64)
    first, second = checksummed
    return checks, [Transfer(first, desc(0), desc(0), half, np.array([0])),
                    Transfer(second, desc(half), desc(half), half, np.array([half]))]


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_holder_chunk_read_from_two_holders_is_checked_whole_at_the_end(corrupt):
    """Reader chunk 0 took half of it from "cut" (the reader's own layout, with
    checksums) and half from "plain" (none): cut's holder chunk 0 never lands
    whole from cut, so it cannot be checked by itself. At the end the reader
    chunk is checked whole against cut's table (before: settled unchecked)."""
    weights = torch.arange(2 * CHUNK // 4, dtype=torch.int32)
    dest = weights.clone()
    if corrupt:
        dest[CHUNK // 4 - 1] += 1  # in the half that came from "plain"
    checks, landed = _read_in_halves(weights, dest, {"cut": True, "plain": False})
    for t in landed:
        checks.arrived(t)
    assert checks.landed(0, landed) == []  # plain's half is checked whole at once; cut's chunk 0 waited for
    settled, bad = checks.poll(5.0)
    assert settled == [] and checks.busy is not corrupt
    if corrupt:
        assert [(m.chunk, m.whole, m.replica.source.replica_id) for m in bad] == [(0, True, "cut")]
        assert not checks.busy  # to be read again: it waits for nothing
    else:
        assert bad == [] and checks.settle_rest() == [0]  # cut's half was covered by the whole check
        assert checks.verified_bytes == CHUNK and checks.unverified_bytes == 0
    checks.close()


def test_a_holder_chunk_read_from_two_holders_and_no_whole_check_yet_is_checked_whole_at_the_end():
    """As above, with both halves from holders with checksums, so nothing is
    checked as it lands: the whole check comes from ``settle_rest``."""
    weights = torch.arange(2 * CHUNK // 4, dtype=torch.int32)
    dest = weights.clone()
    checks, landed = _read_in_halves(weights, dest, {"cut": True, "other": True})
    assert checks.landed(0, landed) == [] and checks.poll(0.5) == ([], [])  # each holder's chunk 0 waited in vain
    assert checks.settle_rest() == [] and checks.running  # checked whole now
    assert checks.poll(5.0) == ([0], [])
    assert checks.verified_bytes == CHUNK and checks.unverified_bytes == 0
    checks.close()


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_holder_chunk_read_from_two_holders_cut_unlike_the_reader_is_checked_from_the_readers_memory(corrupt):
    """Two holders whose chunks are twice the reader's (cut like no reader: no
    whole check applies), reader chunk 0 read from one, chunk 1 from the
    other: neither holder's chunk 0 landed whole from it. Before, both were
    settled unchecked (and a relay then computed its own checksums over them,
    vouching for bytes nobody checked); now each holder chunk is checked from
    the reader's memory once every READ landed. A mismatch names no culprit:
    both reader chunks are read again, nobody is excluded, and the third
    failure is final."""
    import dataclasses

    from tensorhub.client.transfer import Transfer
    from tensorhub.client.verify import ChunkVerifier
    from tensorhub.integrity import chunk_checksums

    weights = torch.arange(2 * CHUNK // 4, dtype=torch.int32)
    manifest = Manifest.of({"w": weights})
    dest = weights.clone()
    if corrupt:
        dest[CHUNK // 4 + 3] += 1  # in reader chunk 1
    _, mem = regions_of([dest])
    spec = manifest.tensors[0]
    layout = ReadLayout(manifest, [ReadPart("w", 0, spec.shape, Region().runs(spec.shape), 4, mem[0])], CHUNK)
    crcs = chunk_checksums([weights], 2 * CHUNK)
    checks = ChunkVerifier(True, layout)
    for name in ("a", "b"):
        r = dataclasses.replace(_replica(name, manifest, weights), chunk_size=2 * CHUNK, chunk_crc32=crcs)
        checks.add_holder(r, layout.holder_table(r))
    desc = lambda c: np.array([[mem[0].addr + c * CHUNK, CHUNK, 0]], np.int64)
    for tries in range(1, 4):
        landed = [checks.landed(c, [Transfer(name, desc(c), desc(c), CHUNK, np.array([c * CHUNK]))])
                  for c, name in ((0, "a"), (1, "b"))]
        assert landed == [[], []] and checks.poll(0.2) == ([], [])  # each waits for its holder's chunk 0 in vain
        assert checks.settle_rest() == [] and checks.running  # checked now, from the reader's memory
        settled, bad = checks.poll(5.0)
        if not corrupt:
            assert (sorted(settled), bad) == ([0, 1], [])
            assert checks.verified_bytes == 2 * CHUNK and checks.unverified_bytes == 0
            break
        assert settled == [] and not checks.busy and not checks.running
        assert sorted((m.replica.source.replica_id, m.chunk, m.rereads, m.whole) for m in bad) == [
            ("a", 0, frozenset({0, 1}), True), ("b", 0, frozenset({0, 1}), True)]
        assert {m.exhausted for m in bad} == {tries == 3}
    checks.close()



class CountsPieces(SlowMemcpy):
    """Records where each READ lands; ``out_of_order``: READs in flight land in
    any order, as over TCP (each odd one is reported done only from its third
    poll on, and the puller polls a READ once right after posting it, so the
    one posted after it is done first)."""

    def __init__(self, *, out_of_order: bool) -> None:
        super().__init__()
        self.out_of_order = out_of_order
        self.landing: list[int] = []
        self.polls: dict[int, int] = {}

    def post(self, remote, local, local_kind, remote_descs, remote_kind):
        super().post(remote, local, local_kind, remote_descs, remote_kind)
        self.landing.append(int(local[0][0]))
        return [len(self.landing)]  # a handle of its own

    def poll(self, pending) -> bool:
        n = pending[0]
        self.polls[n] = self.polls.get(n, 0) + 1
        return not self.out_of_order or n % 2 == 0 or self.polls[n] >= 3


def _pull_in_pieces(monkeypatch, transport: CountsPieces):
    """A checked pull of 16 chunks from one holder, each chunk's READ cut in four
    pieces; every READ takes ``POST_S`` to post, so rounds end on their clock
    (``_REFRESH_IDLE_S``) with chunks left to read."""
    import dataclasses

    from tensorhub.client import verify
    from tensorhub.integrity import chunk_checksums

    monkeypatch.setattr(verify, "READ_PIECE_BYTES", CHUNK // 4)
    weights = torch.arange(16 * CHUNK // 4, dtype=torch.int32)
    manifest = Manifest.of({"w": weights})
    holder = dataclasses.replace(_replica("trainer", manifest, weights), chunk_crc32=chunk_checksums([weights], CHUNK))
    dest = torch.zeros_like(weights)
    stats = _job(TwoHolders(manifest, [holder]), transport, manifest, dest, verify=True).run()
    assert torch.equal(dest, weights)
    assert stats.verified_bytes == dest.nbytes and stats.checks_failed == 0
    return stats


def test_pieces_of_one_chunk_that_land_out_of_order_are_each_settled_once(monkeypatch):
    """Found by CI (tests/core/test_pull.py, once): a checked READ is cut into
    pieces, several of one chunk in flight from one holder; when a later piece
    landed first, removing it from the flights compared it with the earlier
    piece field by field, descriptor arrays included, and the pull died with
    numpy's "truth value of an array with more than one element is ambiguous"."""
    _pull_in_pieces(monkeypatch, CountsPieces(out_of_order=True))


def test_a_round_that_stops_posting_finishes_the_chunks_it_began(monkeypatch):
    """Found with the test above: a round stopped posting on its clock between
    the pieces of a chunk, and the next round read that chunk again whole, the
    bytes of its landed pieces twice (with 32 MiB chunks, up to 24 MiB a round)."""
    transport = CountsPieces(out_of_order=False)
    stats = _pull_in_pieces(monkeypatch, transport)
    assert len(transport.landing) == 16 * 4 and len(set(transport.landing)) == 16 * 4, "a piece was read twice"
    assert stats.read_bytes == stats.nbytes  # and the pull's own count says so


class StalledHolder(GrantingLeases):
    """One holder, "stuck". A stalled report is answered as the server would:
    kept (``alive``: its agent heartbeats) or hidden until its next heartbeat,
    after which it is listed again."""

    def __init__(self, manifest: Manifest, replica: RemoteReplica, *, alive: bool) -> None:
        self.manifest, self.replica, self.alive = manifest, replica, alive
        self.reports: list[tuple[str, bool]] = []

    def resolve(self, agent_id, model, version, *, group="", group_round=0, lease=False, **_wait):
        return Resolved(model, 1, self.manifest, (self.replica,))  # hidden only until its next heartbeat

    def report_lost(self, agent_id, replica_id, reason, stalled=False):
        self.reports.append((replica_id, stalled))
        return stalled and self.alive


class StallsFirst(StallsThenLands):
    """The first ``STALLING`` READs from "stuck" land ``LAND_S`` late; later ones at once."""

    STALLING = 4

    def __init__(self) -> None:
        super().__init__()
        self.posts = 0

    def post(self, remote, local, local_kind, remote_descs, remote_kind):
        self.posts += 1
        if self.posts <= self.STALLING:
            return super().post(remote, local, local_kind, remote_descs, remote_kind)
        SlowMemcpy.post(self, remote, local, local_kind, remote_descs, remote_kind)
        return ["ok"]


def test_a_lone_holder_that_stalls_while_the_server_calls_it_alive_is_waited_for():
    """Sixteen readers of one trainer over one slow link starve each other's
    flows past the chunk timeout (``tensorhub bench cluster --readers 16
    --size 64MiB --link 100mbit``). A stall is silence, not an error: the
    server, which hears the holder's heartbeats, says it is alive, so the
    reader waits on the READs it posted (nothing read twice) rather than
    giving the holder up and failing with SourceLost."""
    weights = torch.arange(16 * CHUNK // 4, dtype=torch.int32)
    manifest = Manifest.of({"w": weights})
    plane = StalledHolder(manifest, _replica("stuck", manifest, weights), alive=True)
    dest = torch.zeros_like(weights)
    transport = StallsFirst()
    stats = _job(plane, transport, manifest, dest, verify=False, chunk_timeout_s=0.2).run()
    assert torch.equal(dest, weights)
    assert stats.lost_sources == [] and stats.sources_read_again == []
    assert plane.reports and all(stalled for _, stalled in plane.reports)  # asked, as a stall
    assert transport.posts == 16 and stats.read_bytes == dest.nbytes  # every chunk read once


def test_a_stalled_holder_the_server_hid_is_read_again_once_it_is_listed_again():
    """The server hid it (its heartbeats had stopped: a paused process); it
    came back (listed again) and is the only holder: read again, not
    SourceLost."""
    weights = torch.arange(16 * CHUNK // 4, dtype=torch.int32)
    manifest = Manifest.of({"w": weights})
    plane = StalledHolder(manifest, _replica("stuck", manifest, weights), alive=False)
    dest = torch.zeros_like(weights)
    stats = _job(plane, StallsFirst(), manifest, dest, verify=False, chunk_timeout_s=0.2).run()
    assert torch.equal(dest, weights)
    assert stats.lost_sources == ["stuck"] and stats.sources_read_again == ["stuck"]
