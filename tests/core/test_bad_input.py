"""Malformed RPCs get a clear status; the server never crashes and loses nothing."""

from __future__ import annotations

import grpc
import pytest
import torch

from tensorhub import Hub
from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.ReferenceServiceStub(channel), channel


def _code(call, request):
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=10)
    return err.value.code(), err.value.details()


def _manifest(shape=(4,)):
    n = 1
    for d in shape:
        n *= d
    return pb.Manifest(tensors=[pb.TensorSpec(name="w", dtype="float32", shape=shape, nbytes=4 * n)])


def _publish(agent="a1", replica="a1.0", model="m", version=1, shape=(4,), metadata=b"md", regions=None):
    n = 4
    for d in shape:
        n *= d
    return pb.PublishRequest(
        agent_id=agent, replica_id=replica, model=model, version=version, manifest=_manifest(shape),
        chunk_size=1 << 20, state=pb.REPLICA_STATE_COMPLETE, origin=True,
        memory=pb.ReplicaMemory(kind=pb.MEMORY_KIND_DRAM, nixl_metadata=metadata,
                                regions=regions if regions is not None else [pb.Region(addr=4096, size=n)]),
    )


def test_bad_requests_get_clear_statuses_and_nothing_is_lost(server, stub):
    s, channel = stub
    with Hub.connect(server.address, name="holder") as holder:
        keep = {"w": torch.arange(16, dtype=torch.float32)}
        holder.publish("kept", 1, keep)
        s.RegisterAgent(pb.RegisterAgentRequest(agent_id="a1", name="raw"), timeout=10)
        s.Publish(_publish(), timeout=10)

        cases = [
            (s.Resolve, pb.ResolveRequest(agent_id="a1", model="unknown", latest=True), grpc.StatusCode.NOT_FOUND, "unknown"),
            (s.Resolve, pb.ResolveRequest(agent_id="a1", model="m", version=-3), grpc.StatusCode.INVALID_ARGUMENT, "negative"),
            (s.Resolve, pb.ResolveRequest(agent_id="a1", model="m", version=7), grpc.StatusCode.NOT_FOUND, "pullable versions: [1]"),
            (s.Resolve, pb.ResolveRequest(agent_id="a1", model="m"), grpc.StatusCode.INVALID_ARGUMENT, "which version"),
            (s.Resolve, pb.ResolveRequest(model="m", latest=True), grpc.StatusCode.INVALID_ARGUMENT, "agent_id"),
            (s.Publish, _publish(shape=(8,), replica="a1.1"), grpc.StatusCode.ALREADY_EXISTS, "already held with manifest"),
            (s.Publish, _publish(agent="nobody"), grpc.StatusCode.FAILED_PRECONDITION, "not registered"),
            (s.Publish, _publish(version=-1), grpc.StatusCode.INVALID_ARGUMENT, "negative"),
            (s.Publish, _publish(model=""), grpc.StatusCode.INVALID_ARGUMENT, "model key"),
            (s.Publish, _publish(metadata=b"x" * (2 << 20), version=2), grpc.StatusCode.INVALID_ARGUMENT, "nixl_metadata"),
            (s.Publish, _publish(metadata=b"", version=2), grpc.StatusCode.INVALID_ARGUMENT, "nixl_metadata is missing"),
            (s.Publish, _publish(regions=[], version=2), grpc.StatusCode.INVALID_ARGUMENT, "0 memory regions for 1 tensors"),
            (s.Publish, pb.PublishRequest(agent_id="a1", replica_id="a1.9", model="m", version=3),
             grpc.StatusCode.INVALID_ARGUMENT, "manifest is missing"),
            (s.ReportChunks, pb.ReportChunksRequest(agent_id="a1", replica_id="a1.0", chunks=[99]),
             grpc.StatusCode.INVALID_ARGUMENT, "chunk 99"),
            (s.Unpublish, pb.UnpublishRequest(agent_id="a1", replica_id="a1.0", drain_timeout_s=-1),
             grpc.StatusCode.INVALID_ARGUMENT, "drain_timeout_s"),
            (s.Unpublish, pb.UnpublishRequest(agent_id="a1", replica_id=holder.publications()[0].replica_id),
             grpc.StatusCode.PERMISSION_DENIED, "another agent"),
            (s.RenewReadLease, pb.RenewReadLeaseRequest(agent_id="a1", lease_id="nope"), grpc.StatusCode.NOT_FOUND, "unknown"),
        ]
        for call, request, code, needle in cases:
            got, detail = _code(call, request)
            assert got == code, (request, got, detail)
            assert needle in detail, (needle, detail)

        garbage = channel.unary_unary("/tensorhub.v1.ReferenceService/Publish")
        for payload in (b"\xff" * 64, b"\x0a\xff\xff\xff\xff\x0f"):
            with pytest.raises(grpc.RpcError) as err:
                garbage(payload, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid PublishRequest" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            garbage(b"\x00" * (20 << 20), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        unknown = channel.unary_unary("/tensorhub.v1.ReferenceService/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as err:
            unknown(b"", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED

        # Still serving, nothing lost: the earlier publications are intact and pullable.
        assert s.ListVersions(pb.ListVersionsRequest(model="m"), timeout=10).versions[0].version == 1
        with Hub.connect(server.address, name="reader") as reader:
            assert reader.versions("kept") == [1]
            result = reader.pull("kept", 1)
            assert torch.equal(result.tensors["w"], keep["w"])
