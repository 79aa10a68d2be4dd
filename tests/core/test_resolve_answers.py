"""What a Resolve answer carries on the wire: a holder's memory (its NIXL
metadata, most of the bytes) only when the reader does not already have it, and
holder fields that follow the agent's and the replica's changes although the
server keeps each holder's serialized form (service.py ``_replica_info``)."""

from __future__ import annotations

import grpc
import pytest

from tensorhub.client.rpc import ReferenceClient
from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc
from tensorhub.server.service import MAX_KNOWN_MEMORY
from tensorhub.topology import Labels, Reliability


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.ReferenceServiceStub(channel)


def _register(s, agent, host="h1"):
    s.RegisterAgent(pb.RegisterAgentRequest(agent_id=agent, name=agent, labels=pb.Labels(host=host)), timeout=10)


def _publish(s, agent, metadata):
    s.Publish(pb.PublishRequest(
        agent_id=agent, replica_id=f"{agent}.0", model="m", version=1, chunk_size=1 << 20,
        manifest=pb.Manifest(tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[4], nbytes=16)]),
        state=pb.REPLICA_STATE_COMPLETE, origin=True,
        memory=pb.ReplicaMemory(kind=pb.MEMORY_KIND_DRAM, nixl_metadata=metadata,
                                regions=[pb.MemoryRegion(addr=4096, size=16)])), timeout=10)


def _resolve(s, known=(), lease=False):
    return s.Resolve(pb.ResolveRequest(agent_id="reader", model="m", latest=True, lease=lease,
                                       known_memory=list(known)), timeout=10)


def test_memory_is_sent_only_to_readers_that_lack_it(stub):
    _register(stub, "holder")
    _register(stub, "reader")
    _publish(stub, "holder", b"metadata-1" * 100)
    first = _resolve(stub).replicas[0]
    digest = first.memory_digest
    assert len(digest) == 16 and first.memory.nixl_metadata == b"metadata-1" * 100
    lean = _resolve(stub, known=[digest], lease=True).replicas[0]
    assert not lean.HasField("memory") and lean.memory_digest == digest
    assert (lean.replica_id, lean.agent_id, lean.labels.host, lean.state) == ("holder.0", "holder", "h1",
                                                                               pb.REPLICA_STATE_COMPLETE)
    assert _resolve(stub, known=[digest]).replicas[0].active_reads == 1  # the lease above: load is current
    assert _resolve(stub, known=[b"x" * 16]).replicas[0].HasField("memory")  # a digest of something else
    # The agent re-registers with new labels and publishes new memory: both show, the old digest is stale.
    _register(stub, "holder", host="h2")
    _publish(stub, "holder", b"metadata-2")
    fresh = _resolve(stub, known=[digest]).replicas[0]
    assert fresh.labels.host == "h2" and fresh.memory.nixl_metadata == b"metadata-2" and fresh.memory_digest != digest
    with pytest.raises(grpc.RpcError) as err:
        _resolve(stub, known=[b"d"] * (MAX_KNOWN_MEMORY + 1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "known_memory" in err.value.details()


def test_client_lists_what_it_has_and_fills_it_in(server, stub):
    _register(stub, "holder")
    _publish(stub, "holder", b"nixl" * 500)
    client = ReferenceClient(server.address)
    try:
        client.register_agent("reader", "reader", Labels(), Reliability.RELIABLE)
        sent, answers = [], []
        resolve = client._stub.Resolve

        def recording(request, **kwargs):
            sent.append(list(request.known_memory))
            answers.append(resp := resolve(request, **kwargs))
            return resp

        client._stub.Resolve = recording
        a, b = client.resolve("reader", "m", None), client.resolve("reader", "m", None)
    finally:
        client.close()
    digest = answers[0].replicas[0].memory_digest
    # The second answer names the holder by its layout, packed: no memory, no regions sent again.
    assert sent == [[], [digest]] and not answers[1].replicas and len(answers[1].packed.flags) == 1
    ra, rb = a.replicas[0], b.replicas[0]
    assert ra.metadata == rb.metadata == b"nixl" * 500 and ra.kind == rb.kind
    assert ra.regions.tolist() == rb.regions.tolist() == [[4096, 16, 0]]
