"""Two real TP=2 engines (CPU): each worker pulls only the slices its loaders
read (its read set, from a dry run of the loaders at init), and serves exactly
those, so worker k of the second engine pulls from worker k of the first with
the trainer's copy withdrawn.

Engine A starts from the original weights; engine B, a fresh engine, from the
perturbed ones. A updated to the perturbed version must then generate what B
generates from its own files, token for token (same TP, same rounding), and
B updated to the original version what A generated at start."""

from __future__ import annotations

import pytest
from conftest import engine_pair, perturbed_copy, update_and_relay

PROMPTS = ["the quick brown", "weights move from", "tensorhub pulls versions"]


@pytest.fixture(scope="module")
def perturbed_model(tiny_model, tmp_path_factory):
    """The tiny model's directory with the trainer's "perturbed" weights in its files."""
    return perturbed_copy(tiny_model, tmp_path_factory.mktemp("tiny-qwen2-perturbed"))


@pytest.fixture(scope="module")
def engines(tp_env, tiny_model, perturbed_model, hub_server):
    yield from engine_pair(tiny_model, perturbed_model, hub_server.address)


def test_each_worker_reads_its_slices_only(engines):
    a, _ = engines
    stats = a.collective_rpc("tensorhub_stats", args=("backend",))
    sets = a.collective_rpc("tensorhub_read_set", args=("backend",))
    assert len(stats) == 2
    for s in stats:
        assert s["read_set_nbytes"] <= 0.6 * s["checkpoint_nbytes"], s
    # the TP-split tensors are read in complementary halves: rows for column-parallel
    # layers (embedding, qkv, gate_up, lm_head), columns for row-parallel ones
    b0, b1 = (s["boxes"] for s in sets)
    assert b0["model.embed_tokens.weight"] == [[[0, 256], [0, 128]]]
    assert b1["model.embed_tokens.weight"] == [[[256, 512], [0, 128]]]
    assert b0["model.layers.1.mlp.down_proj.weight"] == [[[0, 128], [0, 128]]]
    assert b1["model.layers.1.mlp.down_proj.weight"] == [[[0, 128], [128, 256]]]
    assert "model.norm.weight" not in b0  # replicated: read whole
    assert sets[0]["fallbacks"] == sets[1]["fallbacks"] == {}
    # Columns are rows of 128-256 B, one READ descriptor each: within the 0.2
    # over-read budget the narrowest are read as whole rows instead (o_proj's
    # 128 B gaps, then layer 0's down_proj), the loaders viewing their columns.
    for s in sets:
        assert s["widened"] == {"model.layers.0.self_attn.o_proj.weight": 128 * 64 * 2,
                                "model.layers.1.self_attn.o_proj.weight": 128 * 64 * 2,
                                "model.layers.0.mlp.down_proj.weight": 128 * 128 * 2}, s["widened"]
        assert not set(s["widened"]) & set(s["boxes"])  # whole tensors now


def _control(address: str):
    from tensorhub.client.rpc import ReferenceClient

    client = ReferenceClient(address)
    try:
        return client.describe().control
    finally:
        client.close()


def test_update_matches_a_fresh_engine_and_serves_slices_to_the_next(engines, trainer, hub_server):
    a, b = engines
    before = _control(hub_server.address)
    update_and_relay(a, b, trainer, (31, 32), PROMPTS, share=0.6)
    # Three updates of TP=2 engines, one Resolve each: the first worker resolves
    # for both (groupshare), the second adopts its answer. A pull slower than
    # its refresh interval asks again mid-pull (a loaded machine; ``PullResult.refreshes``),
    # so the Resolves are 3 and a few; one per worker would be 6.
    after = _control(hub_server.address)
    assert after.answers_shared - before.answers_shared == 3
    assert 3 <= after.resolves - before.resolves < 6, after.resolves - before.resolves
