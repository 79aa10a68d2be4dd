"""OpenRLHF's engines in the two modes that change what they serve, end to
end on a real Ray cluster (CPU): two DeepSpeed ZeRO-3 ranks of OpenRLHF's own
``Actor`` publish, and a real vLLM engine made by OpenRLHF's own
``create_vllm_engines`` loads each step. What it generates through OpenRLHF's
``generate`` (the call its rollout executors make) is what a fresh vLLM engine
generates from files on disk. The engine starts after the first version is
out and loads it by itself; the next comes by ``tensorhub_update``, as every
step's.

* ``TENSORHUB_LORA=1``: the ranks publish only the adapter (``Actor(lora_rank=8)``),
  the engine serves each adapter version from memory; the reference loads the
  same adapter from PEFT files.
* ``TENSORHUB_VLLM_QUANTIZATION=fp8_per_channel``: bf16 steps into an FP8
  engine, re-quantized as they load; the reference is a fresh FP8 engine on
  the step's weights saved as a checkpoint.

A module of its own: the engines read these settings from the Ray job's
environment (one cluster per mode), which test_openrlhf_sync.py's does not set.
The fresh engines of both modes run in one process by the last test (a vLLM
import and a process start fewer), against what each mode's test recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import ray
from conftest import HERE, child_pythonpath
from openrlhf_zero_rank import ZeroRank

KEY = "tiny/lora/engine"
WORLD = 2
LORA_ENV = {"TENSORHUB_MODEL": KEY, "TENSORHUB_LORA": "1"}
FP8_ENV = {"TENSORHUB_MODEL": "tiny/fp8/engine", "TENSORHUB_VLLM_QUANTIZATION": "fp8_per_channel"}
RANK = 8
PROMPTS = ["the quick brown", "weights move from", "tensorhub pulls versions"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(request):
    """A Ray cluster whose job environment has ``request.param``'s settings (parametrize indirectly)."""
    env = {
        "TENSORHUB_ADDRESS": "auto", "TENSORHUB_LORA_MAX_RANK": str(RANK), "TENSORHUB_UPDATE_TIMEOUT_S": "120",
        "TENSORHUB_UNPUBLISH_TIMEOUT_S": "30", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": child_pythonpath(),
        "OMP_NUM_THREADS": "1", **request.param,
    }
    ray.init(num_cpus=8, num_gpus=4, object_store_memory=256 << 20, include_dashboard=False,
             runtime_env={"env_vars": env}, log_to_driver=False)
    from tensorhub.server.ray_actor import resolve_address, shutdown_server

    yield resolve_address("auto")
    shutdown_server()
    ray.shutdown()


def sync(ranks) -> dict:
    stats = ray.get([r.sync.remote() for r in ranks], timeout=300)
    assert len({s["version"] for s in stats}) == 1, stats
    return stats[0]


def engine_tokens(engine, prompt_ids: list[list[int]]) -> list[list[int]]:
    """What OpenRLHF's rollout executors get: the actor's ``generate``, greedy."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = ray.get([engine.generate.remote(ids, params) for ids in prompt_ids], timeout=120)
    return [list(o.outputs[0].token_ids) for o in outs]


# What each mode's test served and the fresh engines on files that must match it,
# by mode: {"engines": [{"model", "runs", "engine_args"}], "served": {tag: tokens}}.
# The last test runs every mode's fresh engines in one process.
SERVED: dict[str, dict] = {}


def disk_reference(engines: list[dict], tmp_path) -> dict[str, list[list[int]]]:
    """Fresh vLLM engines on files (``vllm_lora_reference.py``): per engine its model folder,
    ``runs`` (tag -> PEFT folder, None: no adapter) and its own engine arguments; greedy tokens by tag."""
    spec = {"engine_args": {"dtype": "bfloat16", "max_model_len": 256, "enforce_eager": True, "seed": 7},
            "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "engines": engines}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run = subprocess.run([sys.executable, str(HERE.parent / "vllm" / "vllm_lora_reference.py"),
                          str(tmp_path / "spec.json")], check=False, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads([line for line in run.stdout.splitlines() if line.startswith("REFERENCE ")][-1][10:])


def save_peft(ranks, path) -> None:
    """The adapter as PEFT's save_pretrained writes it (its saved names and settings)."""
    from safetensors.torch import save_file

    state = ray.get([r.adapter_state.remote() for r in ranks], timeout=120)[0]
    path.mkdir()
    save_file({n: t.contiguous() for n, t in state.items()}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(ray.get(ranks[0].adapter_config.remote())))


def ranks_of(env: dict, tiny_model, lora_rank: int = 0) -> list:
    rank_actor = ray.remote(num_cpus=1)(ZeroRank)
    return [rank_actor.remote(r, WORLD, env, str(tiny_model), [], lora_rank=lora_rank) for r in range(WORLD)]


def start_engine(model_dir):
    """One engine through OpenRLHF's own ``create_vllm_engines`` (the adapter's wrapper)."""
    from tensorhub_openrlhf.engines import create_vllm_engines

    # OpenRLHF's positional arguments: engines, TP, model, seed, full determinism,
    # prefix caching, enforce eager, max length, shared pg, gpu memory, sleep.
    (engine,) = create_vllm_engines(1, 1, str(model_dir), 7, False, False, True, 256, None, 0.9, False)
    return engine


@pytest.mark.parametrize("cluster", [LORA_ENV], indirect=True, ids=["lora"])
def test_engines_serve_the_adapter_versions_the_ranks_publish(cluster, tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from tensorhub.testing import rendezvous

    prompt_ids = [AutoTokenizer.from_pretrained(tiny_model)(p)["input_ids"] for p in PROMPTS]
    with rendezvous(WORLD) as env:
        ranks = ranks_of(env, tiny_model, lora_rank=RANK)
        try:
            # Two steps train the adapter first: a fresh one (B = 0) generates what the base does.
            for _ in range(2):
                ray.get([r.train_step.remote() for r in ranks], timeout=300)
            first = sync(ranks)["version"]
            # An engine that starts now serves the newest adapter version by itself.
            engine = start_engine(tiny_model)
            assert ray.get(engine.tensorhub_version.remote(), timeout=300) == first
            save_peft(ranks, tmp_path / "first")
            got_first = engine_tokens(engine, prompt_ids)

            ray.get([r.set_engines.remote([engine]) for r in ranks])
            ray.get([r.train_step.remote() for r in ranks], timeout=300)
            stats = sync(ranks)  # rank 0 asks the engine to load it, as every step
            second = stats["version"]
            assert second > first and stats["engines_loaded"] == [0] and not stats["engines_failed"], stats
            assert ray.get(engine.tensorhub_version.remote(), timeout=60) == second
            save_peft(ranks, tmp_path / "second")
            got_second = engine_tokens(engine, prompt_ids)
        finally:
            for r in ranks:
                ray.kill(r)
    SERVED["lora"] = {"served": {"first": got_first, "second": got_second}, "engines": [{
        "model": str(tiny_model), "engine_args": {"enable_lora": True, "max_loras": 2, "max_lora_rank": RANK},
        "runs": {"base": None, "first": str(tmp_path / "first"), "second": str(tmp_path / "second")}}]}


def save_checkpoint(ranks, tiny_model, path) -> None:
    """The ranks' full parameters as a checkpoint folder beside the tiny model's config and tokenizer."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(tiny_model, path, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    full = ray.get([r.full_parameters.remote() for r in ranks], timeout=300)[0]
    save_file({n: t.clone().contiguous() for n, t in full.items()}, str(path / "model.safetensors"))


@pytest.mark.parametrize("cluster", [FP8_ENV], indirect=True, ids=["fp8"])
def test_fp8_engines_requantize_each_step_as_a_fresh_engine(cluster, tiny_model, tmp_path):
    """TENSORHUB_VLLM_QUANTIZATION=fp8_per_channel: the ranks publish bf16
    steps, the engine serves FP8, and after each step it generates what a
    fresh FP8 engine on that step's weights generates."""
    from transformers import AutoTokenizer

    from tensorhub.testing import rendezvous

    prompt_ids = [AutoTokenizer.from_pretrained(tiny_model)(p)["input_ids"] for p in PROMPTS]
    with rendezvous(WORLD) as env:
        ranks = ranks_of(env, tiny_model)
        try:
            first = sync(ranks)["version"]  # the checkpoint's weights
            engine = start_engine(tiny_model)  # loads the newest step by itself
            assert ray.get(engine.tensorhub_version.remote(), timeout=300) == first
            got_first = engine_tokens(engine, prompt_ids)
            ray.get([r.set_engines.remote([engine]) for r in ranks])
            ray.get([r.train_step.remote() for r in ranks], timeout=300)
            stats = sync(ranks)
            assert stats["engines_loaded"] == [0] and not stats["engines_failed"], stats
            assert ray.get(engine.tensorhub_version.remote(), timeout=60) == stats["version"] > first
            got_second = engine_tokens(engine, prompt_ids)
            save_checkpoint(ranks, tiny_model, tmp_path / "trained")
        finally:
            for r in ranks:
                ray.kill(r)
    fp8 = {"quantization": "fp8_per_channel"}
    SERVED["fp8"] = {"served": {"checkpoint": got_first, "trained": got_second}, "engines": [
        {"model": str(tiny_model), "engine_args": fp8, "runs": {"checkpoint": None}},
        {"model": str(tmp_path / "trained"), "engine_args": fp8, "runs": {"trained": None}}]}


def test_each_mode_serves_what_fresh_engines_on_files_generate(tmp_path):
    """What the tests above served, against fresh engines on files: with LoRA,
    each adapter version as vLLM loads it from PEFT files; with FP8, a fresh FP8
    engine on the checkpoint and on the trained step's weights saved as one."""
    if not SERVED:
        pytest.skip("needs a mode test of this module to have served in this run (run the module, not "
                    "this test alone); a mode test that failed before serving is red on its own")
    ref = disk_reference([e for mode in SERVED.values() for e in mode["engines"]], tmp_path)
    print(json.dumps({"served": SERVED, "fresh": ref}))
    for mode in SERVED.values():
        assert mode["served"] == {tag: ref[tag] for tag in mode["served"]}, (mode, ref)
    if "lora" in SERVED:  # the adapter matters here (else the test could not fail), and each version's own is served
        assert ref["first"] != ref["base"] and ref["second"] != ref["first"]
    if "fp8" in SERVED:  # the step changed the tokens: the equalities mean something
        assert ref["trained"] != ref["checkpoint"]
