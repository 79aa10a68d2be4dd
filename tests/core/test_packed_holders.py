"""Lean holders by number sent packed (ResolveRequest.packed_holders,
ResolveResponse.packed): a real server in this process, a real client; the
packed answer decodes to the same holders as the one-message-a-holder form."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from tensorhub.client.rpc import ReferenceClient
from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc
from tensorhub.proto import wire
from tensorhub.server import EmbeddedServer

CHUNK = 1 << 16  # 4 chunks of the 256 KiB tensor


def _publish(stub, agent: str, replica_id: str, version: int, *, complete: bool = True, crcs=()) -> None:
    stub.Publish(pb.PublishRequest(
        agent_id=agent, replica_id=replica_id, model="m", version=version, chunk_size=CHUNK, origin=True,
        state=pb.REPLICA_STATE_COMPLETE if complete else pb.REPLICA_STATE_FILLING,
        chunk_bitmap=b"" if complete else b"\x05", chunk_crc32=list(crcs),
        manifest=pb.Manifest(tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[256, 256], nbytes=1 << 18)]),
        memory=pb.ReplicaMemory(kind=pb.MEMORY_KIND_DRAM, nixl_metadata=agent.encode(),
                                regions=[pb.MemoryRegion(addr=1 << 32, size=1 << 18)])))


def _holders(resolved) -> dict[str, tuple]:
    return {r.source.replica_id: (r.source.complete, r.bitmap if not r.source.complete else b"",
                                  None if r.chunk_crc32 is None else r.chunk_crc32.tolist()) for r in resolved.replicas}


def test_packed_holders_decode_to_the_same_holders_in_fewer_bytes():
    with EmbeddedServer(retain=0) as srv, grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.ReferenceServiceStub(channel)
        for agent in ("a", "c", "d", "reader"):
            stub.RegisterAgent(pb.RegisterAgentRequest(agent_id=agent, name=agent))
        for version in (1, 2):
            _publish(stub, "a", f"a.{version}", version, crcs=[version, 2, 3, 0xFFFFFFFF])  # complete, checked
            _publish(stub, "c", f"c.{version}", version, complete=False)  # filling: chunks 0 and 2
            _publish(stub, "d", f"d.x{version}", version)  # an id not "<agent>.<number>": stays a message
        v1 = stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=1))
        known = {"layout_ids": v1.layout_ids, "known_layouts": [r.layout for r in v1.replicas]}
        plain = stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=2, **known))
        packed = stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=2, packed_holders=True, **known))
        assert [r.replica_suffix for r in packed.replicas] == ["x2"]  # by number, not packed
        assert list(packed.packed.replica_suffix) == [2, 2] and packed.packed.chunk_bitmap == [b"\x05"]
        assert packed.ByteSize() < plain.ByteSize()
        # An old reader (no numbering) gets every holder whole, nothing packed.
        assert not stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=2,
                                                  packed_holders=True)).HasField("packed")

        client = ReferenceClient(srv.address)
        try:
            client.resolve("reader", "m", 1)
            unpacked = client.resolve("reader", "m", 2, lease=True)
        finally:
            client.close()
        assert _holders(unpacked) == {"a.2": (True, b"", [2, 2, 3, 0xFFFFFFFF]), "c.2": (False, b"\x05", None),
                                      "d.x2": (True, b"", None)}
        assert all(r.lean for r in unpacked.replicas)
        # The reader's own lease is not a read in flight of a packed holder; a message's still counts it.
        assert {r.source.replica_id: r.source.active_reads for r in unpacked.replicas} == {"a.2": 0, "c.2": 0,
                                                                                           "d.x2": 1}


@pytest.mark.parametrize("crc_bytes, bitmaps, want", [
    (b"\0" * 12, [], "3 CRCs sent, its layout has 4"),
    (b"\0" * 20, [b"\1"], "sent 5 CRCs"),
    (b"\0" * 16, [], "no bitmap was sent"),
    (b"\0" * 16, [b"\1", b"\2"], "2 bitmaps"),
])
def test_malformed_packed_holders_are_refused_clearly(crc_bytes, bitmaps, want):
    msg = pb.PackedHolders(layout_id_step=[1], replica_suffix=[7], flags=[pb.PACKED_CRC32 | pb.PACKED_BITMAP],
                           chunk_crc32=crc_bytes, chunk_bitmap=bitmaps)
    with pytest.raises(ValueError, match=want):
        wire.packed_holders_from_wire(msg, lambda number: 4)


def test_packed_rows_round_trip():
    rows = [(5, 0, True, np.array([1, 2], "<u4").tobytes(), b"", 0), (6, 9, False, b"", b"\x01", 3),
            (2, 1 << 40, True, b"", b"", 0)]
    back = wire.packed_holders_from_wire(wire.packed_holders_to_wire(rows), lambda number: 2)
    assert [(n, s, c, None if k is None else k.tolist(), b, r) for n, s, c, k, b, r in back] == [
        (5, 0, True, [1, 2], b"", 0), (6, 9, False, None, b"\x01", 3), (2, 1 << 40, True, None, b"", 0)]
