"""A reader pulling into the same buffers keeps its plans (``client/plancache``):
the holder tables and every chunk's READs (checked pieces, wide spans) are
made once and reused, also for the next version published from the same
buffers (new replicas: the cached READs are bound to them), and never for
holders laid out elsewhere. The bytes are checked every time. Real NIXL,
real gRPC, two row-sharded trainer ranks, a TP reader of rows and columns."""

from __future__ import annotations

from dataclasses import asdict

from tensorhub.client.rpc import ReferenceClient

# tensor 0 read by rows, tensor 1 by columns (64-byte runs of 512-byte rows: wide reads)
SPECS = [("a", "bfloat16", (2048, 256)), ("b", "bfloat16", (2048, 256))]
CHUNK = 256 << 10
TP = ("tp", 0, 4)


def _publish_both(ranks, version: int, seed: int) -> None:
    for rank, hub in enumerate(ranks):
        hub.call("publish_shard", model="m", version=version, specs=SPECS, seed=seed, how="rows", rank=rank,
                 world=len(ranks), chunk_size=CHUNK)


def _control(server) -> dict:
    client = ReferenceClient(server.address)
    try:
        return asdict(client.describe().control)
    finally:
        client.close()


def test_plans_are_reused_for_the_same_layouts_only(server, hubs):
    ranks = [hubs("rank0"), hubs("rank1")]
    reader = hubs("reader")
    _publish_both(ranks, 1, seed=1)

    first = reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=1, read=TP, keep="dest")
    assert first["mismatched"] == [] and first["plans_reused"] == 0
    assert first["path"] == "planned" and "first pull" in first["not_replayed"]
    assert first["read_bytes"] > first["nbytes"]  # the columns went wide: a plan worth keeping
    chunks = -(-first["nbytes"] // CHUNK)

    again = reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=1, read=TP, keep="dest")
    assert again["mismatched"] == [] and again["plans_reused"] == chunks
    assert (again["read_bytes"], again["descriptors"]) == (first["read_bytes"], first["descriptors"])

    # The trainer's next step: the same buffers, new bytes, new replicas.
    for hub in ranks:
        hub.call("unpublish", model="m", version=1)
        hub.call("overwrite", model="m", version=1, seed=2)
    for rank, hub in enumerate(ranks):
        hub.call("republish", model="m", version=2, of=1, how="rows", rank=rank, world=2, chunk_size=CHUNK)
    before = _control(server)
    step = reader.call("pull", model="m", version=2, specs=SPECS, expect_seed=2, read=TP, keep="dest")
    assert step["mismatched"] == [] and step["plans_reused"] == chunks
    assert set(step["sources"]) == {"rank0", "rank1"}
    # The steady state: both holders came lean (no regions, no memory), the pull replayed.
    assert step["path"] == "replayed", step["not_replayed"]
    after = _control(server)
    assert after["holders_full"] == before["holders_full"]
    assert after["holders_lean"] >= before["holders_lean"] + 2
    assert after["publishes_lean"] >= 2  # the ranks named their layouts instead of sending them

    # Fresh buffers (another layout in the holders' memory): planned anew, never the old addresses.
    _publish_both(ranks, 3, seed=3)
    fresh = reader.call("pull", model="m", version=3, specs=SPECS, expect_seed=3, read=TP, keep="dest")
    assert fresh["mismatched"] == [] and fresh["plans_reused"] == 0
    assert fresh["path"] == "planned" and "layout this reader had not seen" in fresh["not_replayed"]

    # Another destination layout (the whole tensors): its own plans.
    whole = reader.call("pull", model="m", version=3, specs=SPECS, expect_seed=3)
    assert whole["mismatched"] == [] and whole["plans_reused"] == 0
