"""The planner weighs holders' layouts (planner rule 5): of two relays a TP
reader could read its column slice from, the one laid out like it (worker k of
the engine before: the slice in one contiguous run) serves it, not the one
holding whole rows (a READ descriptor per row). Real NIXL, real gRPC."""

from __future__ import annotations

SPECS = [("norm", "bfloat16", (64,)), ("down", "bfloat16", (4096, 64))]  # "tp" reads down's columns


def test_a_tp_reader_reads_from_the_relay_cut_like_it(hubs):
    trainer = hubs("trainer")
    rows, like_me, reader = hubs("a-rows"), hubs("b-like-me"), hubs("reader")
    trainer.call("publish", model="m", version=1, specs=SPECS, seed=1, chunk_size=1 << 20)
    assert rows.call("pull", model="m", version=1, specs=SPECS, expect_seed=1, serve=True)["mismatched"] == []
    got = like_me.call("pull", model="m", version=1, specs=SPECS, expect_seed=1, serve=True, read=("tp", 0, 2))
    assert got["mismatched"] == []
    trainer.call("unpublish", model="m", version=1)
    got = reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=1, read=("tp", 0, 2))
    assert got["mismatched"] == []
    # by name and load alone "a-rows" ranks first and would send 4,096 rows of 64 bytes
    assert got["sources"] == {"b-like-me": got["nbytes"]}, got["sources"]
    assert got["descriptors"] <= 4
