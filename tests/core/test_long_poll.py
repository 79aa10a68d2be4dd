"""A long-poll Resolve (server/changes.py): a reader that waits for peers'
chunks is answered as soon as a holder of the version reports one, publishes
or goes, and after its wait otherwise; bad waits are refused."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc
from tensorhub.server import changes
from tensorhub.server.changes import VersionChanges
from tensorhub.server.service import MAX_WAIT_CHANGE_S

_MANIFEST = pb.Manifest(tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[1 << 20], nbytes=4 << 20)])


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.ReferenceServiceStub(channel)


def _register(s, agent):
    s.RegisterAgent(pb.RegisterAgentRequest(agent_id=agent, name=agent, labels=pb.Labels(host=agent)), timeout=10)


def _publish(s, agent, state, version=1):
    s.Publish(pb.PublishRequest(
        agent_id=agent, replica_id=f"{agent}.{version}", model="m", version=version, chunk_size=1 << 20,
        manifest=_MANIFEST, state=state, origin=state == pb.REPLICA_STATE_COMPLETE,
        memory=pb.ReplicaMemory(kind=pb.MEMORY_KIND_DRAM, nixl_metadata=agent.encode(),
                                regions=[pb.MemoryRegion(addr=4096, size=4 << 20)])), timeout=10)


def _wait(s, seen, wait_s, version=1):
    started = time.monotonic()
    answer = s.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=version, wait_change_s=wait_s,
                                         seen_change=seen), timeout=wait_s + 10)
    return answer, time.monotonic() - started


def _later(delay_s, fn):
    timer = threading.Timer(delay_s, fn)
    timer.start()
    return timer


def test_a_waiting_reader_learns_a_peers_chunk_when_it_is_reported(stub):
    for agent in ("trainer", "peer", "reader"):
        _register(stub, agent)
    _publish(stub, "trainer", pb.REPLICA_STATE_COMPLETE)
    _publish(stub, "peer", pb.REPLICA_STATE_FILLING)
    first = stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=1), timeout=10)
    assert first.change > 0
    peer = next(r for r in first.replicas if r.agent_id == "peer")
    assert not any(peer.chunk_bitmap)

    # Nothing changes: the server holds the question for the wait, then answers as before.
    same, took = _wait(stub, first.change, 0.3)
    assert 0.25 <= took < 5 and same.change == first.change

    # The peer reports a chunk 0.2 s into a 5 s wait: the answer comes with it.
    timer = _later(0.2, lambda: stub.ReportChunks(
        pb.ReportChunksRequest(agent_id="peer", replica_id="peer.1", chunks=[2]), timeout=10))
    changed, took = _wait(stub, first.change, MAX_WAIT_CHANGE_S)
    timer.join()
    assert 0.15 <= took < 2.5, took
    assert changed.change > first.change
    peer = next(r for r in changed.replicas if r.agent_id == "peer")
    assert peer.chunk_bitmap[0] & (1 << 2)

    # A counter the reader has not seen yet (it changed meanwhile): answered at once.
    _, took = _wait(stub, first.change, MAX_WAIT_CHANGE_S)
    assert took < 1.0

    # A new holder of the version wakes the waiter too; another version's does not.
    _register(stub, "late")
    timer = _later(0.2, lambda: (_publish(stub, "late", pb.REPLICA_STATE_FILLING, version=2),
                                 _publish(stub, "late", pb.REPLICA_STATE_FILLING)))
    joined, took = _wait(stub, changed.change, MAX_WAIT_CHANGE_S)
    timer.join()
    assert took < 2.5 and any(r.agent_id == "late" for r in joined.replicas)


def test_bad_waits_are_refused_and_change_nothing(stub):
    _register(stub, "trainer")
    _register(stub, "reader")
    _publish(stub, "trainer", pb.REPLICA_STATE_COMPLETE)
    bad = [
        pb.ResolveRequest(agent_id="reader", model="m", version=1, wait_change_s=MAX_WAIT_CHANGE_S + 1),
        pb.ResolveRequest(agent_id="reader", model="m", version=1, wait_change_s=-1),
        pb.ResolveRequest(agent_id="reader", model="m", version=1, wait_change_s=float("nan")),
        pb.ResolveRequest(agent_id="reader", model="m", latest=True, wait_change_s=1),
        pb.ResolveRequest(agent_id="reader", model="m", version=1, wait_change_s=1, lease=True),
    ]
    for request in bad:
        with pytest.raises(grpc.RpcError) as err:
            stub.Resolve(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "wait_change_s" in err.value.details()
    answer = stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=1, lease=True), timeout=10)
    assert [r.active_reads for r in answer.replicas] == [1]  # no refused request left a lease behind


def test_changes_wake_waiters_and_forget_old_versions(monkeypatch):
    monkeypatch.setattr(changes, "_KEPT", 3)

    async def main():
        c = VersionChanges()
        assert c.seen("m", 1) == 0
        waiter = asyncio.create_task(c.wait("m", 1, 0, 5.0))
        other = asyncio.create_task(c.wait("m", 2, 0, 5.0))
        await asyncio.sleep(0.01)
        c.bump("m", 1)
        await asyncio.wait_for(waiter, 1.0)  # woken by its own version
        assert not other.done() and c.seen("m", 1) == 1
        await c.wait("m", 1, 0, 5.0)  # counter moved on already: no wait
        for v in (3, 4, 5):  # version 2's waiter is dropped from the kept ones: woken, not left to time out
            c.bump("m", v)
        await asyncio.wait_for(other, 1.0)
        assert c.seen("m", 1) == 0 and c.seen("m", 5) == 1
        started = time.monotonic()
        await c.wait("m", 9, 0, 0.05)  # nothing happens: the timeout ends it
        assert time.monotonic() - started >= 0.04

    asyncio.run(main())
