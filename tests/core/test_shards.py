"""Sharded versions across real processes: each trainer rank publishes its own
regions in place, readers pull whole tensors or their slice from whichever
holders cover it, and a version is visible only once it has no hole."""

from __future__ import annotations

import math
import re
import time

import pytest

from tensorhub.manifest import itemsize
from tensorhub.testing import HubProcess, RemoteError, mixed_specs, read_region, wait_for_progress

SPECS = [*mixed_specs(98, largest_bytes=1 << 20), ("big.rows", "bfloat16", (1000, 64)), ("norm", "float32", (64,))]
REPLICATED = ("norm",)


def _bytes(specs, read=None) -> int:
    total = 0
    for i, (_, dtype, shape) in enumerate(specs):
        region = read_region(tuple(shape), i, *read) if read else None
        n = region.numel(tuple(shape)) if region is not None else math.prod(shape)
        total += n * itemsize(dtype)
    return total


def _publishers(hubs, world: int, **config):
    return [hubs(f"rank{r}", **config) for r in range(world)]


def _publish(ranks, version: int, how: str, specs=SPECS, only=None, **kw):
    world = len(ranks)
    return [rank.call("publish_shard", model="m", version=version, specs=specs, seed=version, how=how, rank=r,
                      world=world, replicated=REPLICATED, **kw)
            for r, rank in enumerate(ranks) if only is None or r in only]


def test_rows_over_four_ranks_pull_whole_from_all_four(hubs):
    ranks = _publishers(hubs, 4)
    published = _publish(ranks, 1, "rows")
    total = _bytes(SPECS)
    # Each rank holds about its share (the replicated tensor and small ones aside), never the model.
    assert all(p["nbytes"] < total * 0.5 for p in published)
    reader = hubs("reader")
    got = reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=1)
    assert got["mismatched"] == [] and got["in_place"] is True
    assert got["nbytes"] == total == sum(got["sources"].values())
    assert set(got["sources"]) == {"rank0", "rank1", "rank2", "rank3"}


@pytest.mark.parametrize("how", ["flat", "cols"])
def test_tp_halves_read_exactly_their_bytes_from_zero3_or_column_shards(hubs, how):
    ranks = _publishers(hubs, 4)
    _publish(ranks, 1, how)
    total = _bytes(SPECS)
    halves = []
    for tp in (0, 1):
        reader = hubs(f"tp{tp}")
        read = ("tp", tp, 2)
        got = reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=1, read=read)
        assert got["mismatched"] == [] and got["in_place"] is True
        assert got["nbytes"] == _bytes(SPECS, read) == sum(got["sources"].values())
        halves.append(got["nbytes"])
    assert all(h < 0.6 * total for h in halves)


def test_version_is_invisible_until_the_last_shard_and_latest_never_has_a_hole(hubs):
    specs = SPECS[:20] + SPECS[-2:]
    ranks = _publishers(hubs, 4)
    reader, waiter = hubs("reader"), hubs("waiter")
    _publish(ranks, 1, "rows", specs=specs, only={0, 1, 2})
    assert reader.call("versions", model="m") == []
    with pytest.raises(RemoteError) as err:
        reader.call("pull", model="m", version=1, specs=specs)
    assert err.value.type_name == "VersionNotFound" and "no complete holder has" in err.value.message and "largest elements 168521:262144" in err.value.message
    _publish(ranks, 1, "rows", specs=specs, only={3})
    assert reader.call("versions", model="m") == [1]

    # Version 2 arrives shard by shard while a reader pulls "latest" over and over.
    waiter.send("wait_for_version", model="m", at_least=2, timeout=60)
    reader.send("pull_latest_loop", model="m", specs=specs, times=200)
    time.sleep(0.5)
    for r in range(4):
        _publish(ranks, 2, "rows", specs=specs, only={r})
        time.sleep(0.2)
    looped = reader.result(timeout=120)
    assert looped["bad"] == [], "a pull returned a hole or a mix of versions"
    assert set(looped["versions"]) <= {1, 2} and sum(looped["versions"].values()) == 200
    assert waiter.result(timeout=60) == 2

    # One rank withdraws its shard of version 2: the version has a hole again.
    ranks[3].call("unpublish", model="m", version=2)
    assert reader.call("versions", model="m") == [1]
    with pytest.raises(RemoteError) as err:
        reader.call("pull", model="m", version=2, specs=specs)
    assert err.value.type_name == "VersionNotFound" and "largest elements 168521:262144" in err.value.message


def test_shard_holder_killed_mid_pull_names_the_region_or_fails_over_to_a_reader(hubs, tmp_path):
    big = [("w", "float32", (8192, 1024))]  # 32 MiB, 32 chunks of 1 MiB
    ranks = _publishers(hubs, 2)
    _publish(ranks, 1, "rows", specs=big, chunk_size=1 << 20)
    # A reader elsewhere serves the whole tensor; the next reader prefers the near shards.
    mirror = hubs("mirror", labels={"host": "elsewhere"})
    assert mirror.call("pull", model="m", version=1, specs=big, serve=True, expect_seed=1)["mismatched"] == []
    reader = hubs("reader", read_workers=1)
    marks = str(tmp_path / "progress")
    reader.send("pull", model="m", version=1, specs=big, expect_seed=1, pace_s=0.1, progress_file=marks)
    wait_for_progress(marks)
    ranks[1].kill()
    got = reader.result(timeout=60)
    assert got["mismatched"] == [] and got["lost"] == ["rank1"]
    assert got["sources"].get("mirror", 0) > 0

    # Without the mirror, the region rank1 held has no holder left: SourceLost names it.
    ranks = _publishers(hubs, 2)
    _publish(ranks, 2, "rows", specs=big, chunk_size=1 << 20)
    marks = str(tmp_path / "progress2")
    reader.send("pull", model="m", version=2, specs=big, pace_s=0.1, progress_file=marks)
    wait_for_progress(marks)
    ranks[1].kill()
    with pytest.raises(RemoteError) as err:
        reader.result(timeout=60)
    # It names what the reader still lacked of rank1's rows 3276:8192 (the chunks it
    # read before the kill are not lacking): one or more ranges, all inside them.
    lacking = [(int(a), int(b)) for a, b in re.findall(r"w rows (\d+):(\d+)", err.value.message)]
    assert err.value.type_name == "SourceLost" and lacking, err.value.message
    assert all(3276 <= a < b <= 8192 for a, b in lacking), err.value.message


def test_a_tp_reader_serves_exactly_its_slice_to_the_same_rank_of_the_next_engine(hubs):
    ranks = _publishers(hubs, 2, labels={"host": "trainer-node"})
    _publish(ranks, 1, "rows")
    read = ("tp", 0, 2)
    first = hubs("engine0-tp0")
    got = first.call("pull", model="m", version=1, specs=SPECS, read=read, serve=True, expect_seed=1)
    assert got["mismatched"] == []
    second = hubs("engine1-tp0")
    got = second.call("pull", model="m", version=1, specs=SPECS, read=read, expect_seed=1)
    assert got["mismatched"] == [] and got["sources"] == {"engine0-tp0": _bytes(SPECS, read)}


def test_retention_keeps_the_latest_version_whole_across_shard_holders(retaining_server):
    specs = SPECS[:10] + SPECS[-2:]
    address = retaining_server.address
    with HubProcess(address, name="rank0") as rank0, HubProcess(address, name="rank1") as rank1, \
            HubProcess(address, name="reader") as reader:
        ranks = [rank0, rank1]
        _publish(ranks, 1, "rows", specs=specs)
        for rank in ranks:  # each rank unpublishes and reuses its memory (the optimizer step)
            rank.call("unpublish", model="m", version=1)
            rank.call("overwrite", model="m", version=1, seed=99)
        got = reader.call("pull", model="m", specs=specs, expect_seed=1)
        assert got["version"] == 1 and got["mismatched"] == [], "each rank's host copy keeps its region"
        assert set(got["sources"]) == {"rank0", "rank1"}
