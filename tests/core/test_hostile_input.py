"""Hostile input against the real gRPC server (hypothesis): malformed, oversized,
out-of-order and replayed requests, regions that lie about their sizes, and one
agent naming another's replicas and leases. The server answers every request
with a clear status, stays up, and nothing of another agent's model changes."""

from __future__ import annotations

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorhub import Hub
from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc
from tensorhub.server import EmbeddedServer

# Every answer is one of these: a decision about the request, never UNKNOWN or INTERNAL.
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ALREADY_EXISTS}
ATTACKER = "attacker-1"
# Few examples, no shrinking database in the tree, the same examples every run.
FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

I64 = st.integers(-(2**63), 2**63 - 1)
U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
TEXT = st.text(max_size=40) | st.text(alphabet="abc-._:", min_size=1, max_size=12) | st.just("x" * 600)
DTYPES = st.sampled_from(["float32", "bfloat16", "int64", "uint8", "float128", ""])


@pytest.fixture(scope="module")
def hub_server():
    with EmbeddedServer(lease_ttl_s=30.0, agent_ttl_s=600.0, retain=0) as srv:
        yield srv


@pytest.fixture(scope="module")
def stub(hub_server):
    with grpc.insecure_channel(hub_server.address) as channel:
        yield pb_grpc.ReferenceServiceStub(channel)


def _strategies(victim_agent: str, victim_replica: str):
    """Requests of every method, fields drawn from valid, edge and garbage values.
    The attacker names the victim's replica where it would touch it, never as a
    reader (that is what readers may do), and never the victim's agent id (the
    shared token authenticates clients, not agent ids: see docs/operations/index.md, "Token and TLS")."""
    ids = st.sampled_from([ATTACKER, "attacker-2", "", "bad id", "x" * 200]) | TEXT
    replica_ids = st.sampled_from([victim_replica, f"{ATTACKER}.0", ""]) | TEXT
    own_replicas = st.sampled_from([f"{ATTACKER}.0", f"{ATTACKER}.1"]) | TEXT
    models = st.sampled_from(["attacker-model", "", "m" * 600, "tab\tmodel"]) | TEXT
    specs = st.builds(pb.TensorSpec, name=TEXT, dtype=DTYPES,
                      shape=st.lists(st.integers(-2, 2**40), max_size=4) | st.lists(st.just(1), min_size=65, max_size=70),
                      nbytes=I64)
    manifests = st.builds(pb.Manifest, tensors=st.lists(specs, max_size=4), fingerprint=TEXT)
    regions = st.builds(pb.TensorRegion, tensor=U32 | st.integers(0, 3), start=st.lists(I64, max_size=3),
                        stop=st.lists(I64, max_size=3), flat=st.booleans())
    memory = st.builds(pb.ReplicaMemory, kind=st.integers(0, 3), nixl_metadata=st.binary(max_size=32),
                       regions=st.lists(st.builds(pb.MemoryRegion, addr=U64, size=U64, device_id=U32), max_size=4))
    publishes = st.builds(pb.PublishRequest, agent_id=ids, replica_id=own_replicas, model=models, version=I64,
                          manifest=manifests, chunk_size=I64 | st.just(1 << 20), memory=memory,
                          state=st.integers(0, 4), chunk_bitmap=st.binary(max_size=8), origin=st.booleans(),
                          retained=st.booleans(), held=st.lists(regions, max_size=3))
    reports = st.builds(pb.ReportChunksRequest, agent_id=ids, replica_id=replica_ids, complete=st.booleans(),
                        chunks=st.lists(U32, max_size=6), chunk_crc32=st.lists(U32, max_size=6))
    releases = st.builds(pb.ReleaseReadLeaseRequest, agent_id=ids, lease_id=TEXT)
    return st.one_of(
        st.builds(pb.RegisterAgentRequest, agent_id=ids, name=TEXT, reliability=st.integers(0, 5),
                  labels=st.builds(pb.Labels, host=TEXT, rack=TEXT, zone=TEXT)),
        st.builds(pb.HeartbeatRequest, agent_id=ids, replica_ids=st.lists(replica_ids, max_size=4)),
        publishes,
        reports,
        # Several of them in one: each answered as alone, none touching the victim either.
        st.builds(pb.BatchRequest, publishes=st.lists(publishes, max_size=2), reports=st.lists(reports, max_size=2),
                  releases=st.lists(releases, max_size=2)),
        st.builds(pb.UnpublishRequest, agent_id=ids, replica_id=replica_ids, drain_timeout_s=FLOATS.filter(
            lambda x: not 0.05 < x), force=st.booleans()),
        st.builds(pb.ResolveRequest, agent_id=ids, model=models | st.just("victim-model"), version=I64,
                  group=TEXT, group_round=I64, known_fingerprint=TEXT, release_leases=st.lists(TEXT, max_size=2)),
        st.builds(pb.AcquireReadLeaseRequest, agent_id=ids, replica_ids=st.lists(own_replicas, max_size=3)),
        st.builds(pb.RenewReadLeaseRequest, agent_id=ids, lease_id=TEXT),
        releases,
        st.builds(pb.ReportLostRequest, agent_id=ids, replica_id=replica_ids, reason=TEXT),
        st.builds(pb.ListVersionsRequest, model=models),
        st.builds(pb.WaitForVersionRequest, model=models, at_least=I64, timeout_s=FLOATS.filter(lambda x: not 0.05 < x)),
    )


def _method(stub, request):
    return getattr(stub, type(request).__name__.removesuffix("Request"))


def _snapshot(state, model: str) -> list:
    """What another agent must not change: the model's versions and replicas."""
    return sorted(
        (version, r.replica_id, r.agent_id, id(r), r.complete, bytes(r.bitmap), r.withdrawn, r.chunk_size,
         entry.visible, entry.fingerprint)
        for version, entry in state.models.get(model, {}).items() for r in entry.replicas.values()
    )


def _answer(stub, request) -> grpc.StatusCode:
    try:
        _method(stub, request)(request, timeout=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        assert e.code() in CLEAR, (type(request).__name__, e.code(), e.details())
        assert e.details(), (type(request).__name__, e.code())
        return e.code()


def test_fuzzed_requests_get_clear_answers_and_leave_other_agents_alone(hub_server, stub):
    state = hub_server.state
    weights = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16)}
    with Hub.connect(hub_server.address, name="victim") as victim:
        pub = victim.publish("victim-model", 1, weights)
        before = _snapshot(state, "victim-model")
        assert before and before[0][-2]  # visible

        @FUZZ
        @given(st.lists(_strategies(victim.agent_id, pub.replica_id), min_size=1, max_size=6))
        def fuzz(requests):
            stub.RegisterAgent(pb.RegisterAgentRequest(agent_id=ATTACKER, name="attacker"), timeout=10)
            first = [_answer(stub, r) for r in requests]
            replay = [_answer(stub, r) for r in requests]  # the same requests again: still clear answers
            assert len(first) == len(replay)
            assert _snapshot(state, "victim-model") == before

        fuzz()
        # Still serving: the victim's version pulls byte-exact.
        with Hub.connect(hub_server.address, name="reader") as reader:
            result = reader.pull("victim-model", 1)
            assert all(torch.equal(result.tensors[k], v) for k, v in weights.items())


def _publish(agent: str, replica: str, *, shape=(8, 4), held=(), sizes=None, model="liar", version=1):
    rows = shape[0]
    spec = pb.TensorSpec(name="w", dtype="float32", shape=list(shape), nbytes=4 * rows * shape[1])
    return pb.PublishRequest(
        agent_id=agent, replica_id=replica, model=model, version=version, manifest=pb.Manifest(tensors=[spec]),
        chunk_size=1 << 20, state=pb.REPLICA_STATE_COMPLETE, origin=True, held=list(held),
        memory=pb.ReplicaMemory(kind=pb.MEMORY_KIND_DRAM, nixl_metadata=b"md", regions=[
            pb.MemoryRegion(addr=4096 * (i + 1), size=size) for i, size in enumerate(sizes or [4 * rows * shape[1]])]),
    )


@FUZZ
@given(rows=st.integers(1, 64), cols=st.integers(1, 64), data=st.data())
def test_regions_that_lie_about_their_size_are_refused(stub, rows, cols, data):
    """A held row range and a memory region: accepted exactly when the sizes agree."""
    a = data.draw(st.integers(0, rows - 1))
    b = data.draw(st.integers(a + 1, rows))
    truth = (b - a) * cols * 4
    size = data.draw(st.sampled_from([truth, truth + 1, truth - 1, truth * 2, 0, 2**64 - 1]))
    s = stub
    s.RegisterAgent(pb.RegisterAgentRequest(agent_id="liar", name="liar"), timeout=10)
    request = _publish("liar", "liar.0", shape=(rows, cols), model=f"liar-{rows}x{cols}",
                       held=[pb.TensorRegion(tensor=0, start=[a, 0], stop=[b, cols])], sizes=[size])
    try:
        s.Publish(request, timeout=10)
        accepted = True
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and f"the region is {truth}" in e.details(), e.details()
        accepted = False
    assert accepted == (size == truth)
    if accepted:
        s.Unpublish(pb.UnpublishRequest(agent_id="liar", replica_id="liar.0", force=True), timeout=10)


def test_one_agent_cannot_release_or_drop_what_another_reads_or_holds(hub_server, stub):
    s = stub
    for agent in ("holder", "reader", "other"):
        s.RegisterAgent(pb.RegisterAgentRequest(agent_id=agent, name=agent), timeout=10)
    s.Publish(_publish("holder", "holder.0", model="owned"), timeout=10)
    lease = s.AcquireReadLease(pb.AcquireReadLeaseRequest(agent_id="reader", replica_ids=["holder.0"]), timeout=10)
    assert list(lease.granted) == ["holder.0"]
    refused = [
        (s.ReleaseReadLease, pb.ReleaseReadLeaseRequest(agent_id="other", lease_id=lease.lease_id)),
        (s.Resolve, pb.ResolveRequest(agent_id="other", model="owned", latest=True, release_leases=[lease.lease_id])),
        (s.ReportLost, pb.ReportLostRequest(agent_id="other", replica_id="holder.0", reason="lies")),
        (s.Unpublish, pb.UnpublishRequest(agent_id="other", replica_id="holder.0", force=True)),
        (s.ReportChunks, pb.ReportChunksRequest(agent_id="other", replica_id="holder.0", chunks=[0])),
    ]
    for call, request in refused:
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (type(request).__name__, err.value.details())
    replica = hub_server.state.replicas["holder.0"]
    assert lease.lease_id in replica.leases and not replica.withdrawn
    # The reader itself may report its source lost (it holds a lease on it), and release its lease.
    s.ReleaseReadLease(pb.ReleaseReadLeaseRequest(agent_id="reader", lease_id=lease.lease_id), timeout=10)
    assert not replica.leases
    lease = s.AcquireReadLease(pb.AcquireReadLeaseRequest(agent_id="reader", replica_ids=["holder.0"]), timeout=10)
    s.ReportLost(pb.ReportLostRequest(agent_id="reader", replica_id="holder.0", reason="READ failed"), timeout=10)
    assert replica.lost and replica.withdrawn  # hidden; kept while the reader's lease is out (its holder is alive)
    s.ReleaseReadLease(pb.ReleaseReadLeaseRequest(agent_id="reader", lease_id=lease.lease_id), timeout=10)
    assert "holder.0" not in hub_server.state.replicas


def test_a_stalled_report_keeps_a_live_holder_listed_and_hides_a_silent_one(hub_server, stub):
    """A reader that heard nothing from a holder (no error) cannot tell slow from
    dead; the server can: a holder whose agent heartbeated within
    ``stall_alive_s`` stays listed for every reader (``kept``)."""
    s = stub
    for agent in ("holder", "reader"):
        s.RegisterAgent(pb.RegisterAgentRequest(agent_id=agent, name=agent), timeout=10)
    s.Publish(_publish("holder", "holder.0", model="slow"), timeout=10)
    s.AcquireReadLease(pb.AcquireReadLeaseRequest(agent_id="reader", replica_ids=["holder.0"]), timeout=10)
    stall = pb.ReportLostRequest(agent_id="reader", replica_id="holder.0", reason="no READ landed", stalled=True)
    replica = hub_server.state.replicas["holder.0"]
    assert s.ReportLost(stall, timeout=10).kept and not replica.lost and not replica.withdrawn
    hub_server.state.agents["holder"].expires_at -= hub_server.state.config.stall_alive_s + 1  # silent since
    assert not s.ReportLost(stall, timeout=10).kept and replica.lost and replica.withdrawn


def test_documented_limits_are_enforced(hub_server, stub):
    """docs/operations/index.md "Limits": oversized messages and manifests are refused with the limit named."""
    s = stub
    s.RegisterAgent(pb.RegisterAgentRequest(agent_id="big", name="big"), timeout=10)
    cases = [
        (pb.RegisterAgentRequest(agent_id="big", labels=pb.Labels(host="h" * 513)), "labels"),
        (pb.RegisterAgentRequest(agent_id="i" * 129), "agent_id"),
        (_publish("big", "big.0", model="m" * 513), "model key"),
        (pb.PublishRequest(agent_id="big", replica_id="big.0", model="big", version=1, manifest=pb.Manifest(
            tensors=[pb.TensorSpec(name="n" * 513, dtype="uint8", shape=[1], nbytes=1)])), "at most 512 characters"),
        (pb.PublishRequest(agent_id="big", replica_id="big.0", model="big", version=1, manifest=pb.Manifest(
            tensors=[pb.TensorSpec(name="d", dtype="uint8", shape=[1] * 65, nbytes=1)])), "64 dimensions"),
    ]
    for request, needle in cases:
        with pytest.raises(grpc.RpcError) as err:
            _method(s, request)(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details(), \
            err.value.details()
    big = _publish("big", "big.0", model="big")
    big.memory.nixl_metadata = b"\0" * (hub_server.state.config.max_message_bytes + 1)
    with pytest.raises(grpc.RpcError) as err:
        s.Publish(big, timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A chunk report lists each chunk at most once.
    s.Publish(_publish("big", "big.1", model="chunks"), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        s.ReportChunks(pb.ReportChunksRequest(agent_id="big", replica_id="big.1", chunks=[0, 0]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "has 1" in err.value.details()
