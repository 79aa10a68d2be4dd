"""OpenRLHF with ``TENSORHUB_LORA=1`` end to end, on a real Ray cluster (CPU):
two DeepSpeed ZeRO-3 ranks of OpenRLHF's own ``Actor(lora_rank=8)`` publish
only the adapter, and a real vLLM engine made by OpenRLHF's own
``create_vllm_engines`` serves the adapter versions from memory: what it
generates through OpenRLHF's ``generate`` (the call its rollout executors
make) is what a fresh vLLM engine generates with the same adapter loaded from
PEFT files on disk. The engine starts after the first version is out and
loads it by itself; the next comes by ``tensorhub_update``, as every step's.

A module of its own: the engines read ``TENSORHUB_LORA`` from the Ray job's
environment, which test_openrlhf_sync.py's cluster does not set.
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
RANK = 8
PROMPTS = ["the quick brown", "weights move from", "tensorhub pulls versions"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster():
    env = {
        "TENSORHUB_ADDRESS": "auto", "TENSORHUB_MODEL": KEY, "TENSORHUB_LORA": "1",
        "TENSORHUB_LORA_MAX_RANK": str(RANK), "TENSORHUB_UPDATE_TIMEOUT_S": "120",
        "TENSORHUB_UNPUBLISH_TIMEOUT_S": "30", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": child_pythonpath(),
        "OMP_NUM_THREADS": "1",
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


def disk_reference(tiny_model, runs: dict, tmp_path) -> dict[str, list[list[int]]]:
    """A fresh vLLM engine with each adapter of ``runs`` (tag -> PEFT folder, None: the base alone) from
    PEFT files (vLLM's own path)."""
    spec = {"engine_args": {"dtype": "bfloat16", "max_model_len": 256, "enforce_eager": True, "seed": 7,
                            "enable_lora": True, "max_loras": 2, "max_lora_rank": RANK},
            "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "engines": [{"model": str(tiny_model), "runs": runs}]}
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


def test_engines_serve_the_adapter_versions_the_ranks_publish(cluster, tiny_model, tmp_path):
    from tensorhub_openrlhf.engines import create_vllm_engines
    from transformers import AutoTokenizer

    from tensorhub.testing import rendezvous

    prompt_ids = [AutoTokenizer.from_pretrained(tiny_model)(p)["input_ids"] for p in PROMPTS]
    rank_actor = ray.remote(num_cpus=1)(ZeroRank)
    with rendezvous(WORLD) as env:
        ranks = [rank_actor.remote(r, WORLD, env, str(tiny_model), [], lora_rank=RANK) for r in range(WORLD)]
        try:
            # Two steps train the adapter first: a fresh one (B = 0) generates what the base does.
            for _ in range(2):
                ray.get([r.train_step.remote() for r in ranks], timeout=300)
            first = sync(ranks)["version"]
            # An engine that starts now serves the newest adapter version by itself.
            (engine,) = create_vllm_engines(1, 1, str(tiny_model), 7, False, False, True, 256, None, 0.9, False)
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
    ref = disk_reference(tiny_model, {"base": None, "first": str(tmp_path / "first"),
                                      "second": str(tmp_path / "second")}, tmp_path)
    print(json.dumps({"served": {"first": got_first, "second": got_second}, "disk": ref}))
    assert got_first == ref["first"]
    assert got_second == ref["second"]
    # The adapter matters here (else the test could not fail), and each version's own is served.
    assert ref["first"] != ref["base"] and ref["second"] != ref["first"]
