"""The server at the scale of a MoE model's tensor-parallel worker: a replica of
10^5 column-sliced tensors of 4,096 rows (a TP=8 worker of Qwen3-235B-A22B reads
the columns of 12,032 expert ``down_proj`` tensors of 4,096 rows, 49 million
element runs). The server keeps and sends such a replica as regions, not rows:
its memory grows by at most 100 bytes a region, and a Resolve that returns it
stays under 1 MiB (the goals of the paper-scale issue)."""

from __future__ import annotations

import gc
import tracemalloc

import grpc
import pytest

from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc
from tensorhub.proto import wire
from tensorhub.regions import Region
from tensorhub.regiontable import shapes_of as _shapes
from tensorhub.server import EmbeddedServer
from tensorhub.server.state import State, check_held

N = 100_000
ROWS, COLS, TP = 4096, 768, 8
WIDTH = COLS // TP
BYTES = ROWS * WIDTH * 2  # one column slice, bf16


def _manifest() -> pb.Manifest:
    return pb.Manifest(tensors=[pb.TensorSpec(name=f"model.layers.{i // 128}.mlp.experts.{i % 128}.down_proj.weight",
                                              dtype="bfloat16", shape=[ROWS, COLS], nbytes=ROWS * COLS * 2)
                                for i in range(N)])


def _columns(k: int) -> pb.HeldRegions:
    """Columns [96 k, 96 (k+1)) of every tensor, packed: 4 cuts a region."""
    return pb.HeldRegions(tensor_step=[0] + [1] * (N - 1), cut=[0, 0, WIDTH * k, COLS - WIDTH * (k + 1)] * N)


def _publish(agent: str, k: int, manifest: pb.Manifest) -> pb.PublishRequest:
    memory = pb.ReplicaMemory(kind=pb.MEMORY_KIND_DRAM, nixl_metadata=b"md" * 1000, packed=True,
                              region_gap=[1 << 32] + [0] * (N - 1))  # back to back in one buffer
    return pb.PublishRequest(agent_id=agent, replica_id=f"{agent}.1", model="m", version=1, chunk_size=64 << 20,
                             manifest=manifest, state=pb.REPLICA_STATE_COMPLETE, origin=True,
                             held_table=_columns(k), memory=memory)


def test_a_replica_of_1e5_column_slices_costs_under_100_bytes_a_region_to_keep():
    manifest = wire.manifest_from_wire(_manifest())
    state = State()
    for k in range(TP):
        state.register_agent(f"w{k}", f"w{k}", wire.labels_from_wire(pb.Labels()), wire.reliability_from_wire(0))
    tables = [check_held(manifest, wire.held_from_wire(_columns(k), _shapes(manifest))) for k in range(TP)]
    kept = []
    for k in range(TP - 1):
        kept.append(state.publish(agent_id=f"w{k}", replica_id=f"w{k}.1", model="m", version=1, manifest=manifest,
                                  held=tables[k], chunk_size=64 << 20, memory=None, complete=True, bitmap=b"",
                                  origin=True))
    assert not state.models["m"][1].visible
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    last = state.publish(agent_id=f"w{TP - 1}", replica_id=f"w{TP - 1}.1", model="m", version=1, manifest=manifest,
                         held=tables[-1], chunk_size=64 << 20, memory=None, complete=True, bitmap=b"", origin=True)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert state.models["m"][1].visible  # the 8 column slices cover every tensor
    assert last.held_count() == N
    # The table itself is kept (21 bytes a region); what the publish added besides
    # it is the version's coverage (8 bytes a tensor) and bookkeeping.
    assert grown <= (64 << 10) + 100 * N, grown / N
    # Withdrawing a slice makes it invisible again, naming the uncovered columns as boxes.
    state.withdraw(f"w{TP - 1}", f"w{TP - 1}.1")
    entry = state.models["m"][1]
    assert not entry.visible and entry.missing()[1] == N
    assert entry.describe_missing().startswith(f"model.layers.0.mlp.experts.0.down_proj.weight [0:4096, {COLS - WIDTH}:{COLS}]")


@pytest.fixture
def stub():
    # Agents send no heartbeats here: a TTL longer than the test.
    with EmbeddedServer(agent_ttl_s=600, retain=0) as server, grpc.insecure_channel(server.address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                        ("grpc.max_send_message_length", 64 << 20)]) as channel:
        yield pb_grpc.ReferenceServiceStub(channel)


def test_resolve_of_a_replica_of_1e5_column_slices_is_under_1_mib(stub):
    manifest = _manifest()
    for k in range(TP):
        stub.RegisterAgent(pb.RegisterAgentRequest(agent_id=f"w{k}", name=f"w{k}"), timeout=10)
        stub.Publish(_publish(f"w{k}", k, manifest), timeout=60)
    stub.RegisterAgent(pb.RegisterAgentRequest(agent_id="reader", name="reader"), timeout=10)
    parsed = wire.manifest_from_wire(manifest)
    fingerprint, shapes = parsed.fingerprint, _shapes(parsed)
    answer = stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", latest=True, max_sources=1,
                                            known_fingerprint=fingerprint), timeout=60)
    assert answer.version == 1 and not answer.HasField("manifest")
    for info in answer.replicas:
        assert info.ByteSize() < 1 << 20, info.ByteSize()
        table = wire.held_from_wire(info.held_table, shapes)
        assert len(table) == N
        k = int(info.agent_id[1:])
        assert table.region(N - 1, shapes) == Region(
            box=((0, ROWS), (WIDTH * k, WIDTH * (k + 1))))
        addrs = wire.memory_regions_from_wire(info.memory, table.nbytes(shapes))
        assert int(addrs[-1, 0]) == (1 << 32) + (N - 1) * BYTES and int(addrs[-1, 1]) == BYTES


def test_a_publish_may_name_a_manifest_the_server_holds_by_its_fingerprint(stub):
    """Each of 256 FSDP ranks would otherwise send the names of 10^5 tensors per version."""
    manifest = _manifest()
    fingerprint = wire.manifest_from_wire(manifest).fingerprint
    stub.RegisterAgent(pb.RegisterAgentRequest(agent_id="w0", name="w0"), timeout=10)
    by_name = _publish("w0", 0, manifest)
    by_name.ClearField("manifest")
    by_name.manifest_fingerprint = fingerprint
    with pytest.raises(grpc.RpcError) as err:  # nothing published with it yet
        stub.Publish(by_name, timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "manifest unknown" in err.value.details()
    stub.Publish(_publish("w0", 0, manifest), timeout=60)
    stub.RegisterAgent(pb.RegisterAgentRequest(agent_id="w1", name="w1"), timeout=10)
    second = _publish("w1", 1, manifest)
    second.ClearField("manifest")
    second.manifest_fingerprint = fingerprint
    shapes = _shapes(wire.manifest_from_wire(manifest))
    second.held_table.CopyFrom(wire.held_to_wire(wire.held_from_wire(_columns(1), shapes), shapes))  # as rules
    del second.memory.region_gap[1:]  # back to back: the first address says it all
    assert second.ByteSize() < 4096  # rules for the held columns, one address, NIXL metadata
    stub.Publish(second, timeout=60)
    [summary] = stub.ListVersions(pb.ListVersionsRequest(model="m"), timeout=10).versions
    assert summary.complete_replicas == 2


def test_trainer_cuts_beside_their_shards_leave_the_groups_as_the_shards_cut_them():
    """64 FSDP ranks publish their rows of 512 alike tensors and, beside
    them, a cut of the tensors dealt to each (every tensor it owns in the 8
    TP workers' column boxes). Counted for coverage, each cut would split the
    groups by owner (a group per rank and shape, thousands of groups for every
    coverage question to walk: the paper-scale simulation's 11.75 s a version);
    the shards cover the version alone, so cuts stay out of the grouping and
    are answered beside the covering holders. With the shards withdrawn the
    cuts still make the version visible."""
    ranks, tensors, rows, cols = 64, 512, 512, 64
    manifest = wire.manifest_from_wire(pb.Manifest(tensors=[
        pb.TensorSpec(name=f"t{i}", dtype="bfloat16", shape=[rows, cols], nbytes=rows * cols * 2)
        for i in range(tensors)]))
    state = State()
    step = rows // ranks
    boxes = [Region(box=((0, rows), (w * cols // TP, (w + 1) * cols // TP))) for w in range(TP)]
    for r in range(ranks):
        state.register_agent(f"rank{r}", f"rank{r}", wire.labels_from_wire(pb.Labels()), wire.reliability_from_wire(0))
        state.register_agent(f"reader{r}", f"reader{r}", wire.labels_from_wire(pb.Labels()),
                             wire.reliability_from_wire(0))
    for r in range(ranks):
        owned = range(r, tensors, ranks)
        state.publish(agent_id=f"rank{r}", replica_id=f"rank{r}.cut", model="m", version=1, manifest=manifest,
                      held=[(t, box) for t in owned for box in boxes], chunk_size=64 << 20, memory=None,
                      complete=True, bitmap=b"", origin=True, trainer_cut=True)
        state.publish(agent_id=f"rank{r}", replica_id=f"rank{r}.1", model="m", version=1, manifest=manifest,
                      held=[(t, Region.of((rows, cols), rows=(r * step, (r + 1) * step))) for t in range(tensors)],
                      chunk_size=64 << 20, memory=None, complete=True, bitmap=b"", origin=True)
    entry = state.models["m"][1]
    assert entry.visible and entry.grouping.count == 1  # one shape, cut alike by every shard
    answer = state.sources(entry, "reader0", k=4)
    assert sum(r.trainer_cut for r in answer) == ranks and sum(not r.trainer_cut for r in answer) == ranks
    for r in range(ranks):
        state.withdraw(f"rank{r}", f"rank{r}.1")
    assert entry.visible and entry.grouping.count == 1  # the cuts alone cover it, on a grouping of their own
    state.withdraw("rank0", "rank0.cut")
    assert not entry.visible and entry.missing()[1] == tensors // ranks  # rank 0's tensors: nobody has them
