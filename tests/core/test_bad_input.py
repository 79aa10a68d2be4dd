"""Malformed RPCs get a clear status; the server never crashes and loses nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time

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


def _publish(agent="a1", replica="a1.0", model="m", version=1, shape=(4,), metadata=b"md", regions=None, held=()):
    n = 4
    for d in shape:
        n *= d
    return pb.PublishRequest(
        agent_id=agent, replica_id=replica, model=model, version=version, manifest=_manifest(shape),
        chunk_size=1 << 20, state=pb.REPLICA_STATE_COMPLETE, origin=True, held=list(held),
        memory=pb.ReplicaMemory(kind=pb.MEMORY_KIND_DRAM, nixl_metadata=metadata,
                                regions=regions if regions is not None else [pb.MemoryRegion(addr=4096, size=n)]),
    )


def _rows(a, b, tensor=0, cols=4):
    return pb.TensorRegion(tensor=tensor, start=[a, 0], stop=[b, cols])


def _mem(*sizes):
    return [pb.MemoryRegion(addr=4096 * (i + 1), size=size) for i, size in enumerate(sizes)]


def test_held_regions_that_do_not_fit_are_refused(server, stub):
    """Shards are checked against the manifest; the server stays up and keeps what it had."""
    s, _ = stub
    s.RegisterAgent(pb.RegisterAgentRequest(agent_id="a1", name="raw"), timeout=10)
    s.RegisterAgent(pb.RegisterAgentRequest(agent_id="a2", name="raw2"), timeout=10)
    shape = (8, 4)  # 8 rows of 4 float32: 16 bytes a row
    s.Publish(_publish(shape=shape, held=[_rows(0, 4)], regions=_mem(64)), timeout=10)
    bad = [
        ({"held": [_rows(0, 4, tensor=3)], "regions": _mem(64)}, "tensor #3"),
        ({"held": [_rows(4, 9)], "regions": _mem(80)}, "outside [0:8)"),
        ({"held": [pb.TensorRegion(tensor=0, start=[0], stop=[4])], "regions": _mem(64)}, "dimension"),
        ({"held": [pb.TensorRegion(tensor=0, start=[0, 0], stop=[4])], "regions": _mem(64)}, "starts"),
        ({"held": [pb.TensorRegion(tensor=0, start=[0] * 100, stop=[1] * 100)], "regions": _mem(4)}, "dimensions"),
        ({"held": [pb.TensorRegion(tensor=0, start=[5], stop=[3], flat=True)], "regions": _mem(8)}, "inverted"),
        ({"held": [_rows(4, 8)], "regions": _mem(60)}, "is 60 bytes, the region is 64"),
        ({"held": [_rows(4, 8)], "regions": _mem(64, 64)}, "2 memory regions for 1 held regions"),
        ({"held": [_rows(4, 8), _rows(6, 7)], "regions": _mem(64, 16)}, "overlaps"),
    ]
    for fields, needle in bad:
        code, detail = _code(s.Publish, _publish(agent="a2", replica="a2.0", shape=shape, **fields))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (fields, code, detail)
        assert needle in detail, (needle, detail)
    # The packed form (HeldRegions, memory as address gaps) gets the same checks.
    packed_bad = [
        (pb.HeldRegions(tensor_step=[3], cut=[0, 4, 0, 0]), None, "tensor #3"),
        (pb.HeldRegions(tensor_step=[0], cut=[4, 0]), None, "2 cuts for 1 held regions"),
        (pb.HeldRegions(tensor_step=[0], cut=[4, -1, 0, 0]), None, "outside [0:8)"),
        (pb.HeldRegions(tensor_step=[0], cut=[16, 16], flat_at=[0]), None, "inverted"),
        (pb.HeldRegions(tensor_step=[0], cut=[0, 0, 0, 0], flat_at=[5]), None, "flat region position"),
        (pb.HeldRegions(tensor_step=[0, 0], cut=[4, 0, 0, 0, 6, 1, 0, 0]), [0, 0], "overlaps"),
        (pb.HeldRegions(tensor_step=[0], cut=[4, 0, 0, 0]), [0, 0], "2 memory regions for 1 held regions"),
        (pb.HeldRegions(tensor_step=[0], cut=[4, 0, 0, 0]), [-8192], "negative address"),
    ]
    for table, gaps, needle in packed_bad:
        request = _publish(agent="a2", replica="a2.0", shape=shape)
        request.held_table.CopyFrom(table)
        request.memory.ClearField("regions")
        request.memory.packed = True
        request.memory.region_gap.extend([4096] if gaps is None else gaps)
        code, detail = _code(s.Publish, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (table, code, detail)
        assert needle in detail, (needle, detail)
    both = _publish(agent="a2", replica="a2.0", shape=shape, held=[_rows(4, 8)], regions=_mem(64))
    both.held_table.CopyFrom(pb.HeldRegions(tensor_step=[0], cut=[4, 0, 0, 0]))
    assert "both set" in _code(s.Publish, both)[1]
    # Half the rows are held: the version exists but is not visible, and says what is missing.
    code, detail = _code(s.Resolve, pb.ResolveRequest(agent_id="a2", model="m", latest=True))
    assert code == grpc.StatusCode.NOT_FOUND
    code, detail = _code(s.Resolve, pb.ResolveRequest(agent_id="a2", model="m", version=1))
    assert code == grpc.StatusCode.NOT_FOUND and "no complete holder has w rows 4:8" in detail, detail
    assert not s.WaitForVersion(pb.WaitForVersionRequest(model="m", at_least=1, timeout_s=0.05), timeout=10).found
    code, detail = _code(s.WaitForVersion, pb.WaitForVersionRequest(model="m", timeout_s=float("nan")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in detail
    # The other half arrives (as a flat range, with its own chunk size): visible.
    other = _publish(agent="a2", replica="a2.0", shape=shape, regions=_mem(64),
                     held=[pb.TensorRegion(tensor=0, start=[16], stop=[32], flat=True)])
    other.chunk_size = 8 << 10
    s.Publish(other, timeout=10)
    [summary] = s.ListVersions(pb.ListVersionsRequest(model="m"), timeout=10).versions
    assert summary.visible and summary.complete_replicas == 2
    assert s.WaitForVersion(pb.WaitForVersionRequest(model="m", at_least=1, timeout_s=5), timeout=10).version == 1
    res = s.Resolve(pb.ResolveRequest(agent_id="a1", model="m", latest=True), timeout=10)
    [info] = res.replicas  # a1's own replica is left out
    assert info.chunk_size == 8 << 10 and not info.held  # the server answers with the packed form:
    assert list(info.held_table.cut) == [16, 0] and list(info.held_table.flat_at) == [0]  # elements 16:32 of 32
    assert info.memory.packed and list(info.memory.region_gap) == [4096]


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
            (s.ReportChunks, pb.ReportChunksRequest(agent_id="a1", replica_id="a1.0", chunks=[0], chunk_crc32=[7, 8]),
             grpc.StatusCode.INVALID_ARGUMENT, "2 chunk checksums for 1 chunks"),
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


def test_a_nixl_agent_that_cannot_start_raises_a_typed_error(server):
    """Seen by tensorhub chaos: a process starting while its host's link is down got NIXL's
    own nixlBackendError out of Hub.connect. It must be TransportUnavailable, naming the fix."""
    code = (
        "import sys\n"
        "from tensorhub import Hub, TransportUnavailable\n"
        "try:\n"
        f"    Hub.connect({server.address!r}, name='no-device')\n"
        "except TransportUnavailable as e:\n"
        "    print('typed:', e)\n"
        "    sys.exit(0)\n"
        "sys.exit(3)\n"
    )
    env = {**os.environ, "UCX_NET_DEVICES": "no-such-device", "UCX_TLS": "tcp"}
    done = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "UCX_NET_DEVICES" in done.stdout


def test_a_serving_pull_of_a_version_this_process_serves_is_refused_before_any_read(server):
    """Found by the fault campaign (AlreadyPublished after a whole pull): a
    reader serving version 1 pulled 'latest' with serve=True just as newer
    versions stopped being visible; the server refuses a second replica of
    one version per process, but only once every byte had moved."""
    from tensorhub import AlreadyPublished

    with Hub.connect(server.address, name="trainer") as trainer, Hub.connect(server.address, name="reader") as reader:
        trainer.publish("m", 1, {"w": torch.arange(4096, dtype=torch.float32)})
        first = reader.pull("m", "latest", serve=True)
        with pytest.raises(AlreadyPublished, match="nothing was read"):
            reader.pull("m", "latest", serve=True)
        deadline = time.monotonic() + 5
        while server.state.leases:  # its lease is let go (asynchronously)
            assert time.monotonic() < deadline, "the refused pull's read lease was kept"
            time.sleep(0.05)
        first.publication.unpublish(timeout=5)
        again = reader.pull("m", 1, serve=True)  # once unpublished, it may serve it again
        assert torch.equal(again.tensors["w"], torch.arange(4096, dtype=torch.float32))
