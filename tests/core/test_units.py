"""Pure parts: manifests, chunk layout, bitmaps, the source planner, config."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tensorhub.chunks import ChunkLayout, bitmap_count, bitmap_empty, bitmap_full, bitmap_has, bitmap_set
from tensorhub.client.config import HubConfig
from tensorhub.errors import ManifestMismatch
from tensorhub.manifest import Manifest, TensorSpec
from tensorhub.planner import Source, choose_sources
from tensorhub.topology import Labels, Reliability


def test_chunk_segments_cover_every_byte_exactly_once():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 1, 2, 7, 4096, 5000, 70000]) for _ in range(rng.randint(0, 12))]
        layout = ChunkLayout(sizes, 4096)
        seen = [bytearray(s) for s in sizes]
        for chunk in range(layout.num_chunks):
            segs = layout.segments(chunk)
            assert sum(s.length for s in segs) == layout.chunk_bytes(chunk)
            for s in segs:
                assert s.length > 0
                for i in range(s.offset, s.offset + s.length):
                    assert seen[s.tensor][i] == 0
                    seen[s.tensor][i] = 1
        assert all(all(b) for b in seen)
        assert layout.num_chunks == -(-sum(sizes) // 4096)


def test_chunk_size_bounds():
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkLayout([10], 100)
    with pytest.raises(IndexError):
        ChunkLayout([10], 4096).segments(1)


def test_bitmap_roundtrip():
    bits = bitmap_empty(20)
    for c in (0, 7, 8, 19):
        bitmap_set(bits, c)
    assert [c for c in range(20) if bitmap_has(bits, c)] == [0, 7, 8, 19]
    assert bitmap_count(bits) == 4
    assert bitmap_count(bitmap_full(13)) == 13
    assert not bitmap_has(b"", 3)


def test_manifest_fingerprint_depends_on_names_shapes_dtypes():
    a = {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    base = Manifest.of(a).fingerprint
    assert Manifest.of({"w": torch.ones(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}).fingerprint == base
    assert Manifest.of({"w": torch.zeros(3, 2), "b": a["b"]}).fingerprint != base
    assert Manifest.of({"w": a["w"], "b": torch.zeros(3)}).fingerprint != base
    assert Manifest.of({"x": a["w"], "b": a["b"]}).fingerprint != base
    assert Manifest.of({"b": a["b"], "w": a["w"]}).fingerprint != base  # order is part of the layout


def test_manifest_validate_rejects_inconsistent_entries():
    for bad in (
        (TensorSpec("w", "float32", (2,), 4),),
        (TensorSpec("w", "complex64", (2,), 16),),
        (TensorSpec("", "float32", (1,), 4),),
        (TensorSpec("w", "float32", (-1,), 4),),
        (TensorSpec("w", "float32", (1,), 4), TensorSpec("w", "float32", (1,), 4)),
    ):
        with pytest.raises(ValueError):
            Manifest(bad).validate()


def test_check_destination_names_every_problem():
    manifest = Manifest.of({"w": torch.zeros(2, 3), "b": torch.zeros(3)})
    manifest.check_destination({"w": torch.zeros(2, 3), "b": torch.zeros(3)}, model="m", version=1)
    cases = {
        "missing 'b'": {"w": torch.zeros(2, 3)},
        "not in the version 'x'": {"w": torch.zeros(2, 3), "b": torch.zeros(3), "x": torch.zeros(1)},
        "version has float32[2, 3], destination torch.float32[3, 2]": {"w": torch.zeros(3, 2), "b": torch.zeros(3)},
        "destination torch.float16[3]": {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.float16)},
        "not contiguous": {"w": torch.zeros(3, 2).t(), "b": torch.zeros(3)},
    }
    for needle, into in cases.items():
        with pytest.raises(ManifestMismatch, match="Nothing was transferred") as err:
            manifest.check_destination(into, model="m", version=1)
        assert needle in str(err.value)
        assert "'m' version 1" in str(err.value)


def _src(rid, host="h0", rack="r0", zone="z0", **kw):
    return Source(replica_id=rid, agent_name=rid, labels=Labels(host, rack, zone), **kw)


def test_planner_prefers_near_reliable_rollouts_then_spreads_load():
    reader = Labels("h1", "r0", "z0")
    trainer = _src("trainer", host="h9", origin=True)
    same_host = _src("a", host="h1")
    same_rack = _src("b", host="h2")
    other_zone = _src("c", host="h3", rack="r9", zone="z9")
    spot = _src("d", host="h1", reliability=Reliability.SPOT)
    plan = choose_sources(range(4), [trainer, same_rack, other_zone, spot, same_host], reader)
    assert all(order[0] == "a" for order in plan.order.values())
    assert plan.order[0] == ["a", "d", "b", "trainer", "c"]  # host > spot-on-host > rack > origin > elsewhere


def test_planner_uses_partial_replicas_only_for_chunks_they_hold():
    bits = bitmap_empty(4)
    bitmap_set(bits, 1)
    filling = _src("filling", complete=False, bitmap=bytes(bits))
    trainer = _src("trainer", host="h9", origin=True)
    plan = choose_sources(range(4), [filling, trainer], Labels("h0", "r0", "z0"))
    assert plan.order[1][0] == "filling"
    assert all(plan.order[c] == ["trainer"] for c in (0, 2, 3))


def test_planner_spreads_ties_and_reports_unavailable():
    a, b = _src("a"), _src("b")
    plan = choose_sources(range(10), [a, b], Labels("h0"))
    assert plan.primary_load() == {"a": 5, "b": 5}
    plan = choose_sources(range(3), [a, b], Labels("h0"), exclude=frozenset({"a", "b"}))
    assert plan.unavailable == [0, 1, 2]
    busy = _src("busy", active_reads=3)
    plan = choose_sources(range(4), [busy, _src("idle")], Labels("h0"))
    assert plan.primary_load() == {"idle": 4}


def test_planner_exhaustive_small_cases_always_pick_a_holder():
    """Every chunk any usable source holds is assigned, first to a holder."""
    labels = [Labels("h0", "r0", "z0"), Labels("h1", "r0", "z0"), Labels("h2", "r1", "z1")]
    for bits_a, bits_b in itertools.product(range(16), repeat=2):
        a = _src("a", complete=False, bitmap=bytes([bits_a]))
        b = Source("b", "b", labels[bits_b % 3], complete=False, bitmap=bytes([bits_b]))
        plan = choose_sources(range(4), [a, b], labels[0])
        for chunk in range(4):
            holders = {s.replica_id for s in (a, b) if s.has(chunk)}
            if holders:
                assert plan.order[chunk][0] in holders and set(plan.order[chunk]) == holders
            else:
                assert chunk in plan.unavailable


def test_config_from_dict_names_bad_fields():
    cfg = HubConfig.from_dict({"chunk_size": 1 << 20, "labels": {"zone": "z1"}, "reliability": "spot"})
    assert cfg.labels.zone == "z1" and cfg.reliability is Reliability.SPOT
    with pytest.raises(ValueError, match="chunk_sise"):
        HubConfig.from_dict({"chunk_sise": 1})
    with pytest.raises(ValueError, match="reliability"):
        HubConfig.from_dict({"reliability": "sometimes"})
    with pytest.raises(ValueError, match="label"):
        HubConfig.from_dict({"labels": {"planet": "earth"}})
