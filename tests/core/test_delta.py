"""Delta versions: the codec (byte-exact over dtypes, layouts and densities)
and delta pulls between real Hub processes over NIXL, through a real server."""

from __future__ import annotations

import itertools

import pytest
import torch

from tensorhub.delta.codec import BLOCK, DeltaPart, encode, patch
from tensorhub.errors import InvalidRequest
from tensorhub.regions import Region
from tensorhub.testing import RemoteError, stepped_tensors, take

SHAPE = (300, 700)  # 210,000 elements: four blocks, the last one partial
REGIONS = {
    "whole": Region(),
    "rows": Region(box=((40, 260), (0, 700))),
    "cols": Region(box=((0, 300), (100, 450))),
    "box": Region(box=((17, 233), (3, 611))),
    "flat": Region(flat=(12_345, 150_001)),
}
DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.int8, torch.float64]


def _versions(dtype: torch.dtype, density: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = (torch.randn(SHAPE, generator=gen) * 100).to(dtype)
    new = old.clone()
    if density == "all":
        new = (old.to(torch.float64) + 1).to(dtype)
    else:
        fraction = {"none": 0.0, "sparse": 0.02, "tenth": 0.1, "half": 0.5}[density]
        mask = torch.rand(SHAPE, generator=gen) < fraction
        if density == "half":  # and rows that changed whole: dense entries beside sparse ones
            mask[50:120] = True
        new[mask] = (old[mask].to(torch.float64) + 1).to(dtype)
    return old, new


def _part(region: Region, full: torch.Tensor) -> DeltaPart:
    return DeltaPart(0, SHAPE, region, take(full, region).contiguous())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", ["none", "sparse", "tenth", "half", "all"])
def test_patch_is_byte_exact_for_every_publisher_and_reader_layout(dtype, density):
    old, new = _versions(dtype, density)
    for (pname, preg), (rname, rreg) in itertools.product(REGIONS.items(), REGIONS.items()):
        delta = encode([_part(preg, new)], [_part(preg, old)], from_version=3, to_version=4)
        assert delta.check(3, 4) is None
        dest = _part(rreg, old)
        patch(delta, [dest])
        # v where the publisher held it, u elsewhere: a reader patches only what the delta covers
        expected = old.clone()
        mask = torch.zeros(SHAPE, dtype=torch.bool)
        if preg.flat is not None:
            mask.view(-1)[preg.flat[0]:preg.flat[1]] = True
        else:
            mask[tuple(slice(a, b) for a, b in preg.bounds(SHAPE))] = True
        expected[mask] = new[mask]
        got, want = dest.tensor.view(torch.uint8), take(expected, rreg).contiguous().view(torch.uint8)
        assert torch.equal(got, want), f"{dtype} {density}: published {pname}, read {rname}"


def test_sizes_follow_the_changed_elements():
    old, new = _versions(torch.bfloat16, "sparse")
    whole = old.numel() * old.element_size()
    sparse = encode([_part(Region(), new)], [_part(Region(), old)], from_version=0, to_version=1)
    assert sparse.nbytes <= 0.05 * whole  # 2% changed: 4 bytes each, plus the index
    none = encode([_part(Region(), old)], [_part(Region(), old)], from_version=0, to_version=1)
    assert none.nbytes < 200  # a header and padding
    old, new = _versions(torch.bfloat16, "tenth")  # bitmaps: 1/8 byte per element beside the values
    tenth = encode([_part(Region(), new)], [_part(Region(), old)], from_version=0, to_version=1)
    assert set(tenth.index[1:, 2].tolist()) == {2} and tenth.nbytes <= (0.1 + 1 / 16 + 0.005) * whole
    old, new = _versions(torch.bfloat16, "all")
    dense = encode([_part(Region(), new)], [_part(Region(), old)], from_version=0, to_version=1)
    assert whole <= dense.nbytes <= whole + 4 * 56 + 200  # every block whole: values plus one index row each
    assert dense.index.shape[0] - 1 == -(-old.numel() // BLOCK)


def test_a_delta_of_another_version_or_layout_is_refused():
    old, new = _versions(torch.float32, "sparse")
    delta = encode([_part(Region(), new)], [_part(Region(), old)], from_version=1, to_version=2)
    assert "not 2 to 3" in delta.check(2, 3)
    with pytest.raises(InvalidRequest, match="do not match"):
        encode([_part(Region(), new)], [_part(REGIONS["rows"], old)], from_version=1, to_version=2)


# ------------------------------------------------------------------ between processes

SPECS = [("emb", "bfloat16", (512, 256)), ("w1", "bfloat16", (256, 1024)), ("w2", "float32", (1024, 96)),
         ("norm", "float32", (256,)), ("steps", "int64", (33,)), ("scalar", "float32", ())]
SEED, CHANGED = 5, 0.02
STEP = (SEED, CHANGED)
FULL = sum(t.numel() * t.element_size() for t in stepped_tensors(SPECS, SEED, 0, CHANGED).values())


def _publish(hub, version, **kw):
    return hub.call("publish_step", model="m", version=version, specs=SPECS, seed=SEED, changed=CHANGED, **kw)


def test_a_reader_that_holds_u_reads_only_the_delta(hubs):
    trainer, reader = hubs("trainer"), hubs("reader")
    _publish(trainer, 1)
    first = reader.call("pull", model="m", version=1, specs=SPECS, keep="b", expect_step=STEP)
    assert first["mismatched"] == [] and first["delta_from"] is None
    info = _publish(trainer, 2, delta_from=1)
    assert info["deltas"] and info["delta_bytes"] < 0.05 * FULL
    got = reader.call("pull", model="m", version=2, specs=SPECS, keep="b", have=1, expect_step=STEP)
    assert got["mismatched"] == [] and got["in_place"]
    assert got["delta_from"] == 1 and got["nbytes"] == FULL
    assert got["path"] == "delta" and "delta pull" in got["not_replayed"]  # PullResult.path
    assert got["read_bytes"] == got["delta_bytes"] <= 0.05 * FULL  # 2% changed: at most 5% of the bytes move
    assert got["verified"] == FULL  # every chunk checked against v's checksums
    # A reader that holds no u, or holds one nobody published a delta from, reads v whole.
    other = hubs("other")
    whole = other.call("pull", model="m", version=2, specs=SPECS, expect_step=STEP)
    assert whole["mismatched"] == [] and whole["delta_from"] is None and whole["read_bytes"] == FULL
    stale = other.call("pull", model="m", version=2, specs=SPECS, have=0, expect_step=STEP)
    assert stale["mismatched"] == [] and stale["delta_from"] is None


def test_deltas_of_sharded_publishers_cover_a_whole_reader(hubs):
    ranks = [hubs(f"rank{r}") for r in range(2)]
    for version in (1, 2):
        for r, rank in enumerate(ranks):
            _publish(rank, version, how="rows", rank=r, world=2, delta_from=None if version == 1 else 1)
    reader = hubs("reader")
    # the reader holds v1 (it pulls it whole), then patches it to v2 from both ranks' deltas
    assert reader.call("pull", model="m", version=1, specs=SPECS, keep="b", expect_step=STEP)["mismatched"] == []
    got = reader.call("pull", model="m", version=2, specs=SPECS, keep="b", have=1, expect_step=STEP)
    assert got["mismatched"] == [] and got["delta_from"] == 1 and got["verified"] == FULL
    assert len(got["sources"]) == 2 and got["read_bytes"] <= 0.05 * FULL
    # a tensor-parallel slice reads the same deltas, patches only its own columns
    tp = hubs("tp")
    assert tp.call("pull", model="m", version=1, specs=SPECS, keep="s", read=("tp", 1, 2))["nbytes"]
    sliced = tp.call("pull", model="m", version=2, specs=SPECS, keep="s", have=1, expect_step=STEP)
    assert sliced["mismatched"] == [] and sliced["delta_from"] == 1


def test_a_wrong_delta_is_caught_by_the_checksums_and_v_is_pulled_whole(hubs):
    trainer, reader = hubs("trainer"), hubs("reader")
    _publish(trainer, 1)
    reader.call("pull", model="m", version=1, specs=SPECS, keep="b")
    # computed against v2 itself (a trainer that kept no copy of v1): empty, so patching v1 leaves it v1
    _publish(trainer, 2, delta_from=1, previous_step=2)
    got = reader.call("pull", model="m", version=2, specs=SPECS, keep="b", have=1, expect_step=STEP)
    assert got["mismatched"] == [] and got["delta_from"] is None  # read whole after the check failed
    assert got["read_bytes"] == FULL


def test_a_relay_serves_v_and_its_delta(hubs):
    trainer, seed_reader, zone_reader = hubs("trainer"), hubs("seed"), hubs("zone")
    _publish(trainer, 1)
    for reader in (seed_reader, zone_reader):
        reader.call("pull", model="m", version=1, specs=SPECS, keep="b")
    _publish(trainer, 2, delta_from=1)
    got = seed_reader.call("pull", model="m", version=2, specs=SPECS, keep="b", have=1, serve=True, expect_step=STEP)
    assert got["mismatched"] == [] and got["delta_from"] == 1
    trainer.call("unpublish", model="m", version=2)  # its delta goes with it: only the relay holds either now
    relayed = zone_reader.call("pull", model="m", version=2, specs=SPECS, keep="b", have=1, expect_step=STEP)
    assert relayed["mismatched"] == [] and relayed["delta_from"] == 1
    assert [s.split("-")[0] for s in relayed["sources"]] == ["seed"]
    assert relayed["read_bytes"] <= 0.05 * FULL


def test_a_serving_reader_patches_only_after_its_readers_of_u_are_done(hubs, tmp_path):
    trainer, relay, late = hubs("trainer"), hubs("relay"), hubs("late")
    _publish(trainer, 1, chunk_size=64 << 10)  # many chunks: the late reader below is slow
    relay.call("pull", model="m", version=1, specs=SPECS, keep="b", serve=True)
    _publish(trainer, 2, delta_from=1)
    trainer.call("unpublish", model="m", version=1)  # the relay is u's only holder now
    # Writing into memory it still serves is refused, and nothing is written.
    with pytest.raises(RemoteError, match="still serves"):
        relay.call("pull", model="m", version=2, specs=SPECS, keep="b", have=1)
    # A slow reader of u from the relay, reading for longer than a lease TTL (5 s); the
    # relay's patch waits for it (unpublish drains it, confirming the replica meanwhile).
    progress = str(tmp_path / "progress")
    late.send("pull", model="m", version=1, specs=SPECS, expect_step=STEP, pace_s=0.45, progress_file=progress)
    from tensorhub.testing import wait_for_progress
    wait_for_progress(progress)
    got = relay.call("pull", model="m", version=2, specs=SPECS, keep="b", have=1, unpublish_first=1,
                     expect_step=STEP)
    slow = late.result(timeout=120)
    assert slow["mismatched"] == [] and slow["version"] == 1  # u stayed u under its reader
    assert got["mismatched"] == [] and got["delta_from"] == 1
    assert got["end"] >= slow["end"]


def test_a_version_that_changed_mostly_goes_without_a_delta(hubs):
    trainer, reader = hubs("trainer"), hubs("reader")
    _publish(trainer, 1)
    reader.call("pull", model="m", version=1, specs=SPECS, keep="b")
    info = trainer.call("publish_step", model="m", version=2, specs=SPECS, seed=SEED, changed=0.9, delta_from=1)
    assert info["deltas"] == [] and info["delta_bytes"] == 0  # the delta would be about as large as v
    got = reader.call("pull", model="m", version=2, specs=SPECS, keep="b", have=1, expect_step=(SEED, 0.9))
    assert got["mismatched"] == [] and got["delta_from"] is None and got["read_bytes"] == FULL


def test_memory_overlap_is_found_by_one_sweep():
    from tensorhub.client.delta import _overlaps
    from tensorhub.shard import Part

    buf = torch.zeros(1000, dtype=torch.uint8)

    def part(a: int, b: int) -> Part:
        return Part("x", (b - a,), Region(), buf[a:b])

    assert _overlaps([part(0, 10), part(500, 600)], [part(590, 700)])
    assert _overlaps([part(100, 900)], [part(0, 10), part(400, 410)])  # inside a longer one
    assert not _overlaps([part(0, 10), part(20, 30)], [part(10, 20), part(30, 40)])  # touching is not sharing
    assert not _overlaps([], [part(0, 10)])
    many = [part(i, i + 1) for i in range(0, 1000, 2)]
    assert not _overlaps(many, [part(i, i + 1) for i in range(1, 1000, 2)])
    assert _overlaps(many, [part(998, 1000)])
