"""Two real TP=2 engines (CPU): each worker pulls only the slices its loaders
read (its read set, from a dry run of the loaders at init), and serves exactly
those, so worker k of the second engine pulls from worker k of the first with
the trainer's copy withdrawn.

Engine A starts from the original weights; engine B, a fresh engine, from the
perturbed ones. A updated to the perturbed version must then generate what B
generates from its own files, token for token (same TP, same rounding), and
B updated to the original version what A generated at start."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import MODEL_KEY, greedy_many, update

PROMPTS = ["the quick brown", "weights move from", "tensorhub pulls versions"]


def _tp_engine(model_dir, hub_address):
    from vllm import LLM

    llm = LLM(model=str(model_dir), dtype="bfloat16", max_model_len=256, enforce_eager=True, tensor_parallel_size=2,
              weight_transfer_config={"backend": "tensorhub"},
              worker_extension_cls="tensorhub_vllm.extension.TensorHubWorkerExtension")
    llm.init_weight_transfer_engine({"init_info": {"hub": hub_address, "model": MODEL_KEY}})
    return llm


@pytest.fixture(scope="module")
def tp_env():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("TP=2 needs two cores")
    cores = sorted(os.sched_getaffinity(0))[:2]
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    # vLLM's automatic binding wants one NUMA node per worker; bind one core each instead
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}|{cores[1]}"
    import vllm.envs

    vllm.envs.disable_envs_cache()  # an engine started earlier in this session cached the old value
    yield
    if old is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


@pytest.fixture(scope="module")
def perturbed_model(tiny_model, tmp_path_factory):
    """The tiny model's directory with the trainer's "perturbed" weights in its files."""
    from safetensors.torch import save_file
    from vllm_trainer import weights

    path = tmp_path_factory.mktemp("tiny-qwen2-perturbed")
    shutil.copytree(tiny_model, path, dirs_exist_ok=True)
    save_file(weights(tiny_model, "perturbed"), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def engines(tp_env, tiny_model, perturbed_model, hub_server):
    a = _tp_engine(tiny_model, hub_server.address)
    b = _tp_engine(perturbed_model, hub_server.address)
    yield a, b
    for llm in (a, b):
        llm.shutdown_weight_transfer_engine()


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


def test_update_matches_a_fresh_engine_and_serves_slices_to_the_next(engines, trainer):
    a, b = engines
    base = greedy_many(a, PROMPTS)
    fresh_perturbed = greedy_many(b, PROMPTS)
    assert base != fresh_perturbed

    trainer.publish(31, "perturbed")
    update(a, 31, "31")
    assert greedy_many(a, PROMPTS) == fresh_perturbed  # token for token
    for s in a.collective_rpc("tensorhub_stats", args=("backend",)):
        assert 0 < s["nbytes"] <= 0.6 * s["checkpoint_nbytes"], s
    trainer.unpublish(31)

    trainer.publish(32, "original")
    update(a, 32, "32")
    assert greedy_many(a, PROMPTS) == base
    trainer.unpublish(32)  # from now on only A's workers hold version 32, each its slices

    update(b, 32, "32")
    assert greedy_many(b, PROMPTS) == base
    a_agents = [s["agent"] for s in a.collective_rpc("tensorhub_stats", args=("backend",))]
    for rank, s in enumerate(b.collective_rpc("tensorhub_stats", args=("backend",))):
        sources = s["bytes_by_source"]
        assert set(sources) <= set(a_agents) and sum(sources.values()) == s["nbytes"], (rank, sources, a_agents)
        # its slices only worker k of A holds; replicated tensors (norms) either A worker may give
        assert max(sources, key=sources.get) == a_agents[rank], (rank, sources, a_agents)
