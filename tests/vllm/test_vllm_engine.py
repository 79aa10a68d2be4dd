"""A real vLLM engine (CPU) updated through the tensorhub backend and the worker
extension, from a trainer in another process."""

from __future__ import annotations

import pytest
from conftest import Trainer, greedy, update

from tensorhub import ManifestMismatch, SourceLost
from tensorhub.transport import nixl as nixl_transport


@pytest.fixture(scope="module")
def base_tokens(engine):
    return greedy(engine)


def test_perturbed_then_original_round_trips(engine, trainer, base_tokens):
    trainer.publish(1, "perturbed")
    update(engine, 1, "1")
    perturbed = greedy(engine)
    assert perturbed != base_tokens
    assert engine.get_weight_version() == "1"

    trainer.publish(2, "original")
    update(engine, "latest", "2")
    assert greedy(engine) == base_tokens  # token for token
    assert engine.get_weight_version() == "2"
    trainer.unpublish(1)


def test_manifest_mismatch_keeps_serving_old_weights(engine, trainer, base_tokens):
    trainer.publish(3, "wrong-vocab")
    with pytest.raises(ManifestMismatch, match="model.embed_tokens.weight"):
        update(engine, 3)
    assert greedy(engine) == base_tokens
    assert engine.get_weight_version() == "2"

    trainer.publish(4, "perturbed")
    update(engine, 4, "4")
    assert greedy(engine) != base_tokens
    trainer.unpublish(3)


def test_source_killed_mid_pull_keeps_serving_old_weights(engine, trainer, hub_server, tiny_model, base_tokens,
                                                          monkeypatch):
    perturbed = greedy(engine)  # version 4, from the test above
    doomed = Trainer(hub_server.address, tiny_model, chunk_size=64 << 10)  # ~14 chunks
    doomed.publish(5, "original")
    reads = 0
    real_post = nixl_transport.NixlAgent.post

    def post_then_kill(self, *args, **kwargs):  # the trainer dies after two chunks were read
        nonlocal reads
        reads += 1
        if reads == 3:
            doomed.kill()
        return real_post(self, *args, **kwargs)

    monkeypatch.setattr(nixl_transport.NixlAgent, "post", post_then_kill)
    with pytest.raises(SourceLost, match="lost its source"):
        update(engine, 5)
    assert reads >= 3
    monkeypatch.undo()
    assert greedy(engine) == perturbed
    assert engine.get_weight_version() == "4"

    trainer.publish(6, "original")  # the next good version applies
    update(engine, 6, "6")
    assert greedy(engine) == base_tokens


def test_worker_extension_pulls_and_reports(engine, trainer, hub_server, base_tokens):
    engine.collective_rpc("tensorhub_init", args=({"hub": hub_server.address, "model": "tiny-qwen2/policy"},))
    trainer.publish(7, "perturbed")
    assert engine.collective_rpc("tensorhub_update", args=("latest",)) == [7]
    assert engine.collective_rpc("tensorhub_version") == [7]
    assert greedy(engine) != base_tokens
    assert engine.collective_rpc("tensorhub_update", args=(6,)) == [6]
    assert greedy(engine) == base_tokens
    engine.collective_rpc("tensorhub_close")
