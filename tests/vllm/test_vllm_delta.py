"""A real TP=2 engine (CPU) updated by a delta: the trainer publishes the
next version with its delta from the one the engine runs (2% of the elements
changed); each serving worker, whose staging holds that version, pulls only
the deltas of its slices, patches the staging, and loads it. The engine must
then generate what a fresh TP=2 engine on the new weights generates, token
for token."""

from __future__ import annotations

import pytest
from conftest import engine_pair, greedy_many, perturbed_copy, update

PROMPTS = ["the quick brown", "weights move from", "tensorhub pulls versions"]


@pytest.fixture(scope="module")
def sparse_model(tiny_model, tmp_path_factory):
    return perturbed_copy(tiny_model, tmp_path_factory.mktemp("tiny-qwen2-sparse"), "sparse")


@pytest.fixture(scope="module")
def engines(tp_env, tiny_model, sparse_model, hub_server):
    yield from engine_pair(tiny_model, sparse_model, hub_server.address)


def test_an_update_by_delta_generates_what_a_fresh_engine_on_the_new_weights_does(engines, trainer):
    a, b = engines
    base, fresh = greedy_many(a, PROMPTS), greedy_many(b, PROMPTS)
    assert base != fresh
    trainer.publish(61, "original")
    update(a, 61)  # whole: the staging held nothing
    assert all(s["delta_from"] is None for s in a.collective_rpc("tensorhub_stats", args=("backend",)))
    assert greedy_many(a, PROMPTS) == base

    trainer.publish(62, "sparse", delta_from=61)
    update(a, 62)
    assert greedy_many(a, PROMPTS) == fresh  # token for token
    for s in a.collective_rpc("tensorhub_stats", args=("backend",)):
        assert s["delta_from"] == 61, s
        # its whole read set again, from about 4% of the bytes
        assert s["nbytes"] > 0 and s["read_bytes"] <= 0.1 * s["nbytes"], s
    trainer.unpublish(62)
    trainer.unpublish(61)
