"""A real TP=2 engine (CPU) updated by a delta: the trainer publishes the
next version with its delta from the one the engine runs (2% of the elements
changed); each serving worker, whose staging holds that version, pulls only
the deltas of its slices, patches the staging, and loads it. The engine must
then generate what a fresh TP=2 engine on the new weights generates, token
for token. That fresh engine is the same one at its start: it starts on the
new weights, takes the old ones whole, then the new ones by delta (one TP=2
engine start, not two)."""

from __future__ import annotations

import pytest
from conftest import engines_on, greedy_many, perturbed_copy, update

PROMPTS = ["the quick brown", "weights move from", "tensorhub pulls versions"]


@pytest.fixture(scope="module")
def sparse_model(tiny_model, tmp_path_factory):
    return perturbed_copy(tiny_model, tmp_path_factory.mktemp("tiny-qwen2-sparse"), "sparse")


@pytest.fixture(scope="module")
def sparse_engine(tp_env, sparse_model, hub_server):
    yield from engines_on([sparse_model], hub_server.address)


def test_an_update_by_delta_generates_what_a_fresh_engine_on_the_new_weights_does(sparse_engine, trainer):
    (a,) = sparse_engine
    fresh = greedy_many(a, PROMPTS)  # a fresh engine on the new weights
    trainer.publish(61, "original")
    update(a, 61)  # whole: the staging held nothing
    assert all(s["delta_from"] is None for s in a.collective_rpc("tensorhub_stats", args=("backend",)))
    assert greedy_many(a, PROMPTS) != fresh  # the old weights: the equality below means something

    trainer.publish(62, "sparse", delta_from=61)
    update(a, 62)
    assert greedy_many(a, PROMPTS) == fresh  # token for token
    for s in a.collective_rpc("tensorhub_stats", args=("backend",)):
        assert s["delta_from"] == 61, s
        # its whole read set again, from about 4% of the bytes
        assert s["nbytes"] > 0 and s["read_bytes"] <= 0.1 * s["nbytes"], s
    trainer.unpublish(62)
    trainer.unpublish(61)
