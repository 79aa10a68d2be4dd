"""vLLM's trainer side over an FSDP2 MoE module, and an engine whose checkpoint
was saved fused.

A 2-rank FSDP2 trainer holding the tiny Qwen3-MoE as transformers 5 builds it
(experts fused: gate_up_proj [E, 2I, H], down_proj [E, H, I], each rank
Shard(0): whole experts) updates the OpenAI-compatible server (TP=2) through
vLLM's WeightTransferTrainerFactory. The server's own checkpoint is saved fused
too, so versions published with the checkpoint's per-expert names reach it
expert by expert (``experts.per_expert_parts``). What a user checks: the server
then generates what a fresh server on those weights generates."""

from __future__ import annotations

import pytest
from conftest import HUB_CONFIG, MOE_KEY, PROMPT
from vllm_server import Server, fsdp_trainer_send


@pytest.fixture(scope="module")
def moe_server(moe_perturbed, tmp_path_factory):
    """The server started on the perturbed weights, saved fused: its text is
    the fresh engine's on them (``want``)."""
    from vllm_tiny_model import fused_copy

    fused = fused_copy(moe_perturbed, tmp_path_factory.mktemp("tiny-qwen3-moe-perturbed-fused"))
    s = Server(fused, tmp_path_factory.mktemp("moe-server") / "vllm-server.log")
    s.want = s.complete(PROMPT)
    yield s
    s.close()


def test_fsdp2_moe_trainer_and_per_expert_versions_update_a_fused_checkpoints_server(moe_server, moe_trainer, moe_perturbed,
                                                                 hub_server, tmp_path):
    import torch
    from tensorhub_vllm.receiver import checkpoint_layout

    server = moe_server
    server.post("/init_weight_transfer_engine", {"init_info": {"hub": hub_server.address, "model": MOE_KEY,
                                                                 "hub_config": HUB_CONFIG}})
    moe_trainer.publish(50, "original")  # per-expert names, into a fused checkpoint's staging
    server.update(50)
    original = server.complete(PROMPT)
    assert original != server.want
    moe_trainer.unpublish(50)

    reports = fsdp_trainer_send(hub_server.address, server, moe_perturbed, MOE_KEY, 51, tmp_path)
    assert server.get("/weight_info") == {"weight_version": "51"}
    assert server.complete(PROMPT) == server.want  # the fresh engine's text on the trainer's weights

    checkpoint = sum(t.numel() * t.element_size() for t in checkpoint_layout(moe_perturbed, torch.bfloat16).values())
    for got in reports:
        assert got["version"] == 51
        assert any(n.endswith(".mlp.experts.gate_up_proj") for n in got["names"]), got["names"]  # fused
        assert not any(".experts.0." in n for n in got["names"])
        assert 0.4 * checkpoint <= got["published_bytes"] <= 0.6 * checkpoint, (got, checkpoint)

    # The per-expert versions again, the perturbed one last: exactly the fresh engine's weights
    for version, kind, text in ((52, "original", original), (53, "perturbed", server.want)):
        moe_trainer.publish(version, kind)
        server.update(version)
        assert server.complete(PROMPT) == text, kind
        moe_trainer.unpublish(version)
