"""A holder cut off from the server while a reader still reaches both.

Found by the fault campaign (3 IntegrityErrors in 10 minutes, each seconds
after a trainer's or the server's cable was cut): the holder's unpublish could
not reach the server, so it waited one lease TTL and reused its memory; but the
reader kept renewing its read lease with the server, which knew nothing of the
withdraw, and read the overwritten bytes. Only the checksums stood between that
and wrong weights. Now the server ends every lease on a replica one TTL after
the holder last said it holds it (publish, chunk report, heartbeat), and a
withdrawing holder no longer says so: after its wait no reader can be reading.

The cut is a TCP proxy between the holder and the server, closed mid-pull; the
reader talks to the server directly and READs from the holder over NIXL."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch

from tensorhub.manifest import Manifest, TensorSpec
from tensorhub.server.config import ServerConfig
from tensorhub.server.state import State, StateError, check_held
from tensorhub.testing import HubProcess, RemoteError, ServerProcess, wait_for_progress
from tensorhub.topology import Labels, Reliability

SPECS = [("w", "float32", ((8 << 20) // 4,))]  # 8 MiB in 1 MiB chunks
CHUNK = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_a_lease_never_outlives_the_holders_last_word_by_more_than_a_ttl(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("tensorhub.server.state.time", clock)
    s = State(ServerConfig(lease_ttl_s=10.0, agent_ttl_s=100.0))
    for agent in ("a0", "a1", "reader"):
        s.register_agent(agent, agent, Labels(), Reliability.RELIABLE)
    manifest = Manifest((TensorSpec("w", "float32", (1000,), 4000),))
    for agent in ("a0", "a1"):
        s.publish(agent_id=agent, replica_id=f"{agent}.1", model="m", version=1, manifest=manifest,
                  held=check_held(manifest, []), chunk_size=4096, memory=None, complete=True, bitmap=b"",
                  origin=True)
    lease = s.acquire_lease("reader", ["a0.1", "a1.1"])
    assert lease.expires_at == 1010.0
    clock.now = 1006.0
    s.heartbeat("a0", ["a0.1"])
    s.heartbeat("a1", [])  # a1 began withdrawing: it no longer lists its replica
    s.heartbeat("a0", ["a1.1"])  # another agent's word does not count
    s.renew_lease("reader", lease.lease_id)
    assert lease.expires_at == 1010.0  # a1 last confirmed at 1000
    assert s.acquire_lease("reader", ["a0.1", "a1.1"]).replica_ids == ["a0.1", "a1.1"]
    clock.now = 1010.5
    with pytest.raises(StateError, match="went silent") as err:
        s.renew_lease("reader", lease.lease_id)
    assert err.value.code == "NOT_FOUND" and lease.lease_id not in s.leases
    fresh = s.acquire_lease("reader", ["a0.1", "a1.1"])
    assert fresh.replica_ids == ["a0.1"] and fresh.expires_at == 1016.0
    s.report_chunks("a1", "a1.1", [], False)  # a chunk report confirms too
    assert s.acquire_lease("reader", ["a1.1"]).expires_at == 1020.5


class Proxy:
    """A TCP forwarder to ``target``; ``cut()`` drops every connection and
    refuses new ones until ``restore()``."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._open = True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._open:
                client.close()
                continue
            upstream = socket.create_connection(self._target)
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass  # cut: the other pump sees it too
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the cut

    def cut(self) -> None:
        self._open = False
        with self._lock:
            for s in self._sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed
                s.close()
            self._sockets.clear()

    def restore(self) -> None:
        self._open = True

    def close(self) -> None:
        self.cut()
        self._listener.close()


@contextlib.contextmanager
def trainer_behind_a_proxy(lease_ttl_s: float, **reader_config):
    """A server, a trainer that reaches it through a ``Proxy`` (and has
    published version 1, seed 1) and a reader that reaches it directly."""
    with ServerProcess(lease_ttl_s=lease_ttl_s, agent_ttl_s=60) as server:
        proxy = Proxy(server.address)
        with contextlib.closing(proxy), HubProcess(proxy.address, name="trainer") as trainer, \
                HubProcess(server.address, name="reader", **reader_config) as reader:
            trainer.call("publish", model="m", version=1, specs=SPECS, seed=1, chunk_size=CHUNK)
            yield proxy, trainer, reader


def test_a_holder_cut_off_from_the_server_is_never_read_after_its_unpublish(tmp_path):
    progress = str(tmp_path / "progress")
    with trainer_behind_a_proxy(3, read_workers=1) as (proxy, trainer, reader):
        reader.send("pull", model="m", version=1, specs=SPECS, expect_seed=1, pace_s=2.0,
                    progress_file=progress, timeout=30)
        wait_for_progress(progress, at_least=1)
        proxy.cut()
        took = trainer.call("unpublish", model="m", version=1, timeout=10)
        trainer.call("overwrite", model="m", version=1, seed=2)  # what the optimizer does next
        try:
            got = reader.result(timeout=60)
        except RemoteError as e:  # the only holder went away: a typed failure, never wrong bytes
            assert e.type_name != "IntegrityError", e
            assert e.type_name in ("SourceLost", "TransferStalled", "VersionNotFound"), e
        else:
            assert got["mismatched"] == []
        assert took["end"] - took["start"] >= 2.5  # it waited for the reader's lease to end


def test_a_replica_whose_unpublish_timed_out_is_unpublished_before_the_version_is_published_again():
    """Found by the fault campaign (13 AlreadyPublished in 10 minutes): a serving
    pull failed while the server was out of reach, and the unpublish of its
    partial replica timed out; the server still counted that replica, so the
    next serving pull of the same version was refused ("unpublish it first")."""
    with trainer_behind_a_proxy(2) as (proxy, trainer, reader):
        proxy.cut()
        trainer.send("unpublish", model="m", version=1, timeout=0.5)
        with pytest.raises(RemoteError, match="UnpublishTimeout"):
            trainer.result(timeout=30)
        proxy.restore()
        deadline = time.monotonic() + 20
        while True:  # until the trainer's channel has reconnected
            try:
                trainer.call("versions", model="m")
                break
            except RemoteError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        trainer.call("publish", model="m", version=1, specs=SPECS, seed=1, chunk_size=CHUNK)
        assert reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=1)["mismatched"] == []


def test_a_replica_let_go_while_the_server_was_out_of_reach_is_withdrawn_once_it_is_back():
    """Found by the fault campaign (AlreadyPublished again, after the fix above):
    an unpublish that waited out the lease TTL behind a cut link closed the
    replica, but the server, never told, kept listing it while the agent lived."""
    with trainer_behind_a_proxy(2) as (proxy, trainer, reader):
        proxy.cut()
        trainer.call("unpublish", model="m", version=1, timeout=10)  # waits one TTL, then lets go
        assert reader.call("versions", model="m") == [1]  # the server was not told
        proxy.restore()
        deadline = time.monotonic() + 20
        while reader.call("versions", model="m") != []:  # told once a heartbeat gets through
            assert time.monotonic() < deadline, "the server still lists the replica the trainer let go"
            time.sleep(0.5)
        trainer.call("publish", model="m", version=1, specs=SPECS, seed=2, chunk_size=CHUNK)
        assert reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=2)["mismatched"] == []


def test_a_late_announce_first_tells_the_server_of_a_replica_let_go_behind_a_cut():
    """Found by the fault campaign (7 AlreadyPublished per 10 minutes, each a
    serving pull seconds after the server's link came back): the pull's
    publish could not deliver the withdraw notice of its failed predecessor's
    replica (server still out of reach), its announce on the reports thread
    got through a moment later, and the server refused a second replica of
    the version. In this process, with heartbeats paused, so only the
    announce can deliver the notice."""
    from tensorhub import Hub, ServerUnavailable

    with ServerProcess(lease_ttl_s=1, agent_ttl_s=60) as server:
        proxy = Proxy(server.address)
        with contextlib.closing(proxy), Hub.connect(proxy.address, name="reader", rpc_timeout_s=2) as hub:
            holdings = hub._holdings
            holdings._heartbeat_once = lambda: None
            first = hub.publish("m", 1, {"w": torch.arange(1 << 18, dtype=torch.float32)}, chunk_size=CHUNK)
            proxy.cut()
            first.unpublish(timeout=10)  # waits one TTL behind the cut, lets go: a withdraw notice is due
            late = holdings.publish("m", 1, first.manifest, first.parts, CHUNK, origin=False, announce=False)
            proxy.restore()
            # gRPC may not have reconnected yet ("failed to connect": nothing was
            # sent), as a reports thread's next try would find it back.
            deadline = time.monotonic() + 10
            while True:
                try:
                    holdings.announce(late)  # AlreadyPublished before the fix
                    break
                except ServerUnavailable as e:
                    if e.maybe_applied or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert [p.replica_id for p in holdings.publications()] == [late.replica_id]
            late.unpublish(timeout=5)


def test_a_publish_whose_answer_was_lost_is_withdrawn_before_it_fails():
    """Found by the fault campaign (IntegrityErrors seconds after a server's
    link was cut): a trainer's publish timed out, but the server had taken it
    and leased the replica to readers; the trainer, told the publish failed,
    freed the memory and its next version landed there. The readers' checksums
    caught it. Now a publish whose answer was lost withdraws the replica (as
    an unpublish would: readers drain, or their leases run out) before it
    raises; a request that never left (no connection) fails at once. The
    server, in this process, takes the first publish but answers it late."""
    from tensorhub import Hub, ServerUnavailable
    from tensorhub.server import EmbeddedServer

    with EmbeddedServer(lease_ttl_s=1.0) as server:
        publish = server.state.publish
        slow = [True]

        def takes_then_stalls(**kwargs):
            out = publish(**kwargs)
            if slow and slow.pop():
                time.sleep(1.5)  # past the client's deadline: its answer is lost
            return out

        server.state.publish = takes_then_stalls
        with Hub.connect(server.address, name="trainer", rpc_timeout_s=1) as hub:
            with pytest.raises(ServerUnavailable, match="DEADLINE_EXCEEDED"):
                hub.publish("m", 1, {"w": torch.ones(1 << 16)}, chunk_size=CHUNK)
            assert not server.state.replicas  # taken, then withdrawn before the publish failed

        proxy = Proxy(server.address)
        with contextlib.closing(proxy), Hub.connect(proxy.address, name="cut", rpc_timeout_s=1) as hub:
            proxy.cut()  # no connection at all: nothing was sent, nothing to withdraw
            t0 = time.monotonic()
            with pytest.raises(ServerUnavailable, match="failed to connect"):
                hub.publish("m", 2, {"w": torch.ones(1 << 16)}, chunk_size=CHUNK)
            assert time.monotonic() - t0 < 1.5
            proxy.restore()
