"""The steady state's answer (``server/named.py``): a reader names the holders
it read before, by layout, and the server answers with their replicas of the
version alone, waits a bounded time for one that may still come, and answers
as usual (ranked) for one that will not. A real server in this process, raw
requests; ``test_steady_state.py`` has the real Hubs."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc
from tensorhub.proto import wire
from tensorhub.server import EmbeddedServer

CHUNK = 1 << 16


def _publish(stub, agent: str, version: int, *, addr: int = 1 << 32, state=pb.REPLICA_STATE_COMPLETE) -> None:
    stub.Publish(pb.PublishRequest(
        agent_id=agent, replica_id=f"{agent}.{version}", model="m", version=version, chunk_size=CHUNK,
        origin=agent.startswith("t"), state=state,
        manifest=pb.Manifest(tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[256, 256], nbytes=1 << 18)]),
        memory=pb.ReplicaMemory(kind=pb.MEMORY_KIND_DRAM, nixl_metadata=agent.encode(),
                                regions=[pb.MemoryRegion(addr=addr, size=1 << 18)])))


def _layouts(answer) -> dict[str, bytes]:
    return {r.replica_id.rpartition(".")[0]: r.layout for r in answer.replicas}


def _named(stub, reader: str, version: int, layouts, wait_s: float = 0.0, **kw):
    return stub.Resolve(pb.ResolveRequest(agent_id=reader, model="m", version=version, named_layouts=layouts,
                                          named_wait_s=wait_s, **kw), timeout=30)


def _counters(stub) -> tuple[int, int]:
    c = stub.Describe(pb.DescribeRequest(model="none")).control
    return c.answers_named, c.named_missed


@pytest.fixture
def stub():
    with EmbeddedServer(retain=0) as srv, grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.ReferenceServiceStub(channel)
        for agent in ("t0", "t1", "t2", "r1", "r2", "reader"):
            stub.RegisterAgent(pb.RegisterAgentRequest(agent_id=agent, name=agent))
        for agent in ("t0", "t1", "t2"):
            _publish(stub, agent, 1)
        yield stub


def test_the_holders_named_come_alone_and_leased(stub):
    v1 = _layouts(stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=1)))
    for agent in ("t0", "t1", "t2"):
        _publish(stub, agent, 2)  # the same memory: the same layouts
    answer = _named(stub, "reader", 2, [v1["t0"], v1["t2"]], lease=True)
    assert answer.named and sorted(r.replica_id for r in answer.replicas) == ["t0.2", "t2.2"]
    lease = stub.AcquireReadLease(pb.AcquireReadLeaseRequest(agent_id="reader", replica_ids=["t1.2"]))
    assert lease.granted == ["t1.2"]  # the answer's lease was the named ones' alone: t1 is leased only now
    assert _counters(stub) == (1, 0)


def test_a_holder_laid_out_anew_or_gone_is_not_waited_for(stub):
    v1 = _layouts(stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=1)))
    _publish(stub, "t0", 2)
    _publish(stub, "t1", 2, addr=2 << 32)  # fresh buffers: another layout, and t1 holds version 2
    stub.Unpublish(pb.UnpublishRequest(agent_id="t2", replica_id="t2.1"))
    started = time.monotonic()
    answer = _named(stub, "reader", 2, [v1["t0"], v1["t1"]], wait_s=5.0)
    assert not answer.named and {r.replica_id for r in answer.replicas} == {"t0.2", "t1.2"}  # ranked as usual
    assert time.monotonic() - started < 4.0  # not the wait: t1's layout will never come
    answer = _named(stub, "reader", 2, [b"\x01" * 16], wait_s=5.0)  # a layout no agent ever had
    assert not answer.named and time.monotonic() - started < 4.0
    assert _counters(stub) == (0, 2)


def test_a_holder_not_yet_published_is_waited_for_within_the_bound(stub):
    v1 = _layouts(stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=1)))
    _publish(stub, "t0", 2)
    got = {}

    def ask() -> None:
        started = time.monotonic()
        got["answer"], got["s"] = _named(stub, "reader", 2, [v1["t0"], v1["t1"]], wait_s=5.0), time.monotonic() - started

    asker = threading.Thread(target=ask)
    asker.start()
    time.sleep(0.5)
    _publish(stub, "t1", 2)  # t1's step comes late: the reader's answer waited for it
    asker.join(30)
    assert got["answer"].named and sorted(r.replica_id for r in got["answer"].replicas) == ["t0.2", "t1.2"]
    assert 0.4 < got["s"] < 4.0
    # One that never comes: the wait's bound, then ranked (t0.2 covers the version).
    started = time.monotonic()
    answer = _named(stub, "reader", 2, [v1["t2"]], wait_s=0.5)
    assert not answer.named and 0.4 < time.monotonic() - started < 4.0


def test_two_relays_that_name_each_other_do_not_wait_for_each_other(stub):
    for relay in ("r1", "r2"):
        _publish(stub, relay, 1)
    v1 = _layouts(stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=1)))
    _publish(stub, "t0", 2)
    got = {}

    def first() -> None:
        got["r1"] = _named(stub, "r1", 2, [v1["r2"]], wait_s=5.0)

    waiting = threading.Thread(target=first)
    waiting.start()
    time.sleep(0.3)  # r1 waits for r2's replica of version 2
    started = time.monotonic()
    second = _named(stub, "r2", 2, [v1["r1"]], wait_s=5.0)
    assert not second.named and time.monotonic() - started < 4.0  # r1 waits itself: r2 is answered at once
    _publish(stub, "r2", 2, state=pb.REPLICA_STATE_FILLING)  # r2 starts its pull: r1's wait ends
    waiting.join(30)
    assert got["r1"].named and [r.replica_id for r in got["r1"].replicas] == ["r2.2"]


def test_a_members_own_layout_is_left_out_not_waited_for(stub):
    """A TP worker may read a sibling's replicated tensors as they land (a
    refresh finds the sibling filling); the group's next Resolve then names the
    sibling, who cannot publish before the group has its answer. That layout is
    left out at once (it waited the whole bound before: a second per update of
    a vLLM TP=2 engine), and the others are the named answer."""
    _publish(stub, "r2", 1)
    v1 = _layouts(stub.Resolve(pb.ResolveRequest(agent_id="r1", model="m", version=1)))
    _publish(stub, "t0", 2)
    started = time.monotonic()
    answer = _named(stub, "r1", 2, [v1["t0"], v1["r2"]], wait_s=5.0, group="engine", lease=True, members=["r2"])
    assert time.monotonic() - started < 4.0  # not the wait
    assert answer.named and [r.replica_id for r in answer.replicas] == ["t0.2"]
    only_members = _named(stub, "r1", 2, [v1["r2"]], wait_s=5.0, group="engine", lease=True, members=["r2"])
    assert not only_members.named and time.monotonic() - started < 4.0  # nothing else named: ranked at once


@pytest.mark.parametrize("fields, want", [
    ({"named_wait_s": 60.0}, "named_wait_s"),
    ({"named_layouts": [b"x" * 65]}, "named_layouts"),
    ({"named_layouts": [b"x"] * 4097}, "named_layouts"),
])
def test_a_bad_naming_is_refused_clearly(stub, fields, want):
    with pytest.raises(grpc.RpcError) as e:
        stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=1, **fields))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and want in e.value.details()


def test_the_answers_pace_grows_with_the_versions_filling_relays(stub):
    """``ResolveResponse.pace_s`` (``pacing.server_pace_s``): how often, at
    least, the version's pulls whose news flows ask and report; it counts the
    relays still filling the version and those of the version before (named
    answers too)."""
    from tensorhub.pacing import PACE_PER_RELAY_S

    def pace(**kw) -> float:
        return stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=1, **kw)).pace_s

    assert pace() == 0.0  # the three trainers, complete
    for agent in ("r0", "r1", "r2"):
        stub.RegisterAgent(pb.RegisterAgentRequest(agent_id=agent, name=agent))
        _publish(stub, agent, 1, addr=(5 + int(agent[1])) << 32, state=pb.REPLICA_STATE_FILLING)
    assert pace() == pytest.approx(3 * PACE_PER_RELAY_S)
    stub.ReportChunks(pb.ReportChunksRequest(agent_id="r0", replica_id="r0.1", chunks=[0, 1, 2, 3], complete=True))
    stub.Unpublish(pb.UnpublishRequest(agent_id="r1", replica_id="r1.1"))
    v1 = _layouts(stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=1)))
    assert pace(named_layouts=[v1["t0"]]) == pytest.approx(PACE_PER_RELAY_S)  # r2 alone fills
    # The next version: the relays of this one are about to pull it (r0 complete, r2 filling still)
    for agent in ("t0", "t1", "t2"):
        _publish(stub, agent, 2)
    answer = stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=2))
    assert answer.pace_s == pytest.approx(2 * PACE_PER_RELAY_S)


def test_a_lean_replica_shares_its_layout_and_a_new_agent_record_gets_its_own(stub):
    """A replica published by layout (``PublishRequest.layout``: the same
    memory and regions as before) is answered with the same layout key and
    memory as the one it follows; the server keeps their wire parts per agent
    record, so an agent that registered again (other labels) gets them anew."""
    full = pb.PublishRequest(
        agent_id="r1", replica_id="r1.1", model="m", version=1, chunk_size=CHUNK, state=pb.REPLICA_STATE_COMPLETE,
        manifest=pb.Manifest(tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[256, 256], nbytes=1 << 18)]),
        memory=pb.ReplicaMemory(kind=pb.MEMORY_KIND_DRAM, nixl_metadata=b"r1",
                                regions=[pb.MemoryRegion(addr=9 << 32, size=1 << 18)]))
    stub.Publish(full)
    fingerprint = stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=1)).fingerprint

    def lean(version: int) -> None:
        stub.Publish(pb.PublishRequest(agent_id="r1", replica_id=f"r1.{version}", model="m", version=version,
                                       chunk_size=CHUNK, state=pb.REPLICA_STATE_COMPLETE,
                                       manifest_fingerprint=fingerprint, layout=wire.publish_layout(full)))

    def held_by_r1(version: int):
        answer = stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=version))
        return next(r for r in answer.replicas if r.agent_id == "r1")

    for agent in ("t0", "t1", "t2"):
        _publish(stub, agent, 2)
        _publish(stub, agent, 3)
    lean(2)
    first, second = held_by_r1(1), held_by_r1(2)
    assert second.replica_id == "r1.2" and second.layout == first.layout and second.memory == first.memory
    stub.RegisterAgent(pb.RegisterAgentRequest(agent_id="r1", name="r1", labels=pb.Labels(host="h2")))
    lean(3)
    third = held_by_r1(3)
    assert third.labels.host == "h2" and third.layout != first.layout and third.memory == first.memory
