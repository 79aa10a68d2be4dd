"""LoRA adapter versions served from memory (tensorhub_vllm.adapter_versions):
a trainer publishes adapters (tensorhub.lora), one engine pulls them without
writing a file, and generates what a fresh engine that loaded the same
adapter from PEFT files on disk generates, token for token.

One LoRA engine serves every test of this module (engine starts dominate the
suite's time); the fresh disk engine runs once, first, for all references."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import HERE, HUB_CONFIG, Trainer, perturbed_copy, update

sys.path.insert(0, str(HERE))
from vllm_tiny_adapter import adapter, config, save_merged, save_peft

MODEL = "tiny-qwen2/lora/math"
# Longer than one KV block (the CPU backend's is 128 tokens), so a repeated
# prompt is served from the prefix cache.
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)
PROMPTS = ["the quick brown", "weights move from", LONG]
ADAPTERS = {1: 1, 2: 2}  # version -> seed
MAX_TOKENS = 8
ENGINE_ARGS = {"dtype": "bfloat16", "max_model_len": 256, "enforce_eager": True, "enable_lora": True,
               "max_loras": 2, "max_lora_rank": 16, "enable_prefix_caching": True}


def generate(llm, lora=None, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate(prompts, _params(), lora_request=lora, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def fresh(tiny_model, tmp_path_factory):
    """What fresh engines generate for the base and for each adapter loaded
    from PEFT files (vLLM's own disk path), on the original base and on the
    perturbed one, and on the base with adapter version 1 merged into its
    files: the references of this module, computed in one other process."""
    tmp = tmp_path_factory.mktemp("lora-reference")
    perturbed = perturbed_copy(tiny_model, tmp / "perturbed")
    pefts = {v: str(save_peft(tmp / f"peft-{v}", adapter(seed), config())) for v, seed in ADAPTERS.items()}
    spec = {"engine_args": ENGINE_ARGS, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "engines": [
        {"model": str(tiny_model), "runs": {"base": None, **{str(v): p for v, p in pefts.items()}}},
        {"model": str(perturbed), "runs": {"perturbed": None, "perturbed+2": pefts[2]}},
        {"model": str(save_merged(tiny_model, tmp / "merged-1", adapter(ADAPTERS[1]), config())), "runs": {"merged": None}}]}
    (tmp / "spec.json").write_text(json.dumps(spec))
    run = subprocess.run([sys.executable, str(HERE / "vllm_lora_reference.py"), str(tmp / "spec.json")],
                         check=False, capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("REFERENCE ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("REFERENCE "))
    out = {int(k) if k.isdigit() else k: v for k, v in out.items()}
    # each adapter, and the new base, changes the tokens: the checks below can fail
    assert out[1] != out["base"] and out[2] != out[1] and out["perturbed+2"] != out[2] and out["merged"] != out["base"]
    return out


@pytest.fixture(scope="module")
def trainer_hub(hub_server):
    from tensorhub import Hub

    with Hub.connect(hub_server.address, name="lora-trainer") as hub:
        yield hub


@pytest.fixture(scope="module")
def lora_engine(tiny_model, hub_server, fresh):
    from tensorhub_vllm.adapter_versions import AdapterVersions
    from vllm import LLM

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core here, as the suite's other engines
    # Its worker in a process of its own ("mp"): shutting it down then leaves
    # alone the in-process engines of other modules of this session.
    llm = LLM(model=str(tiny_model), **ENGINE_ARGS, weight_transfer_config={"backend": "tensorhub"},
              distributed_executor_backend="mp",
              worker_extension_cls="tensorhub_vllm.extension.TensorHubWorkerExtension")
    adapters = AdapterVersions(llm, hub=hub_server.address, model=MODEL, hub_config=HUB_CONFIG)
    yield llm, adapters
    adapters.close()
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def published(trainer_hub):
    """Versions 1 and 2 of the adapter, published in place from the trainer's memory."""
    from tensorhub.lora import publish_adapter

    pubs = {v: publish_adapter(trainer_hub, MODEL, v, adapter(seed), config()) for v, seed in ADAPTERS.items()}
    yield pubs


def test_adapter_update_generates_what_a_disk_loaded_engine_generates(lora_engine, published, fresh):
    llm, adapters = lora_engine
    assert generate(llm) == fresh["base"]
    lora = adapters.load(1)
    assert lora.lora_name == f"{MODEL}@1"
    assert generate(llm, lora) == fresh[1]
    lora = adapters.load("latest")  # version 2
    assert lora.lora_name == f"{MODEL}@2"
    assert generate(llm, lora) == fresh[2]
    assert generate(llm) == fresh["base"]  # requests without an adapter: the base
    for s in adapters.stats():
        assert s["last"]["version"] == 2 and 0 < s["last"]["nbytes"] == s["last"]["bytes_by_source"]["lora-trainer"]



def _params():
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def add(engine, tag: str, lora) -> None:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{tag}/{i}", prompt, _params(), lora_request=lora)


def run_to_end(engine, after_first_step) -> dict[str, list[list[int]]]:
    """Step ``engine`` until its requests finish, calling ``after_first_step()``
    once while they are in flight; the tokens per tag, in prompt order."""
    done: dict[str, list[int]] = {}
    first = True
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if first:
            assert engine.has_unfinished_requests()  # in flight
            after_first_step()
            first = False
    tags = sorted({rid.split("/")[0] for rid in done})
    return {tag: [done[f"{tag}/{i}"] for i in range(len(PROMPTS))] for tag in tags}


def test_requests_in_flight_finish_on_their_version_and_the_old_one_drains(lora_engine, published, fresh):
    from tensorhub_vllm.adapters import adapter_id

    llm, adapters = lora_engine
    adapters.load(1)
    with adapters.use() as v1:
        add(llm.llm_engine, "v1", v1)

        def load_v2_and_use_it():
            v2 = adapters.load(2)
            assert adapters.resident() == [1, 2]  # v1 is retired, but in use
            add(llm.llm_engine, "v2", v2)

        got = run_to_end(llm.llm_engine, load_v2_and_use_it)
        assert got["v1"] == fresh[1]  # v2 arrived mid-flight: v1's requests still finished on v1
        assert got["v2"] == fresh[2]  # both versions served in the same batches
        assert adapters.resident() == [1, 2]
        for s in adapters.stats():
            assert s["held"] == sorted([adapter_id(MODEL, 1), adapter_id(MODEL, 2)])
    assert adapters.resident() == [2]  # its last use ended: dropped from every worker
    for s in adapters.stats():
        assert s["held"] == [adapter_id(MODEL, 2)] and adapter_id(MODEL, 1) not in s["cached"], s
    assert generate(llm, adapters.request()) == fresh[2]


def test_a_new_version_never_reuses_prefix_blocks_of_another(lora_engine, published, fresh):
    from tensorhub_vllm.adapters import adapter_id
    from vllm.lora.request import LoRARequest

    llm, adapters = lora_engine
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    llm.reset_prefix_cache()
    v1 = adapters.load(1)
    with adapters.use(1):  # kept resident for the control below
        assert generate(llm, v1, [LONG]) == [fresh[1][2]]  # its blocks are cached now
        v2 = adapters.load(2)
        assert generate(llm, v2, [LONG]) == [fresh[2][2]]  # the same prompt, the new version: not v1's blocks
        # Control: v2's weights under v1's name and path (what reusing one name
        # across versions would do) hit v1's cached blocks and give other tokens,
        # so the check above can fail.
        stale = LoRARequest(v1.lora_name, adapter_id(MODEL, 2), v1.lora_path)
        assert generate(llm, stale, [LONG]) != [fresh[2][2]]
    assert adapters.resident() == [2]

def test_a_failed_adapter_pull_keeps_the_previous_version_serving(lora_engine, published, fresh, trainer_hub):
    from tensorhub_vllm.adapters import adapter_id

    from tensorhub.lora import publish_adapter

    llm, adapters = lora_engine
    adapters.load(2)
    corrupt = adapter(3)
    publish_adapter(trainer_hub, MODEL, 3, corrupt, config())
    next(iter(corrupt.values())).add_(1)  # the trainer's memory changes under the published version: checksums differ
    # the worker's IntegrityError reaches this process as vLLM's RuntimeError ("Worker failed with error ...")
    with pytest.raises(RuntimeError, match="did not match their checksums"):
        adapters.load(3)
    too_wide = publish_adapter(trainer_hub, MODEL, 4, adapter(4, r=32), config(32))  # the engine serves rank <= 16
    with pytest.raises(RuntimeError, match="greater than max_lora_rank"):
        adapters.load(4)
    assert adapters.current == 2 and adapters.resident() == [2]
    for s in adapters.stats():
        assert s["held"] == [adapter_id(MODEL, 2)], s
    assert generate(llm, adapters.request()) == fresh[2]
    too_wide.unpublish()


def test_a_base_update_keeps_the_adapter_served(lora_engine, published, fresh, hub_server, tiny_model):
    """vLLM empties its adapter cache on every base-weight update
    (``reset_lora_state``); the next request naming a held version rebuilds
    it from memory, on the new base. vLLM keeps the prefix cache, though:
    ``base_updated`` drops it (measured: without it the long prompt gets
    tokens from v2's blocks computed on the old base). Reference: a fresh engine started on the
    new base that loaded the adapter from disk."""
    llm, adapters = lora_engine
    base_key = "tiny-qwen2/lora-base"
    v2 = adapters.load(2)
    trainer = Trainer(hub_server.address, tiny_model, model_key=base_key)
    try:
        trainer.publish(1, "perturbed")
        llm.init_weight_transfer_engine({"init_info": {"hub": hub_server.address, "model": base_key,
                                                     "hub_config": HUB_CONFIG}})
        update(llm, 1, "1")
        assert all(s["cached"] == [] for s in adapters.stats())  # vLLM dropped every adapter
        adapters.base_updated()  # without it, the long prompt reuses v2's blocks computed on the old base
        assert generate(llm) == fresh["perturbed"]
        assert generate(llm, v2) == fresh["perturbed+2"]
        assert all(s["cached"] == [v2.lora_int_id] for s in adapters.stats())
    finally:
        llm.shutdown_weight_transfer_engine()
        trainer.close()


def test_merged_mode_generates_what_a_fresh_engine_on_the_merged_weights_does(lora_engine, published, fresh,
                                                                              hub_server, tiny_model, trainer_hub):
    """Merged mode, for engines without LoRA support (this engine's is left
    unused: no request names an adapter): after a base update through
    TensorHub, the worker pulls only adapter version 1 and reloads the base
    merged with it. Reference: a fresh engine started on the merged files."""
    from tensorhub.lora import AdapterConfig

    llm, _ = lora_engine
    base_key = "tiny-qwen2/merge-base"
    trainer = Trainer(hub_server.address, tiny_model, model_key=base_key)
    try:
        trainer.publish(1, "original")
        llm.collective_rpc("tensorhub_init", args=({"hub": hub_server.address, "model": base_key,
                                                    "merge_adapter": MODEL, "hub_config": HUB_CONFIG},))
        with pytest.raises(RuntimeError, match="update the base weights through TensorHub first"):
            llm.collective_rpc("tensorhub_update_adapter", args=(1,))
        assert llm.collective_rpc("tensorhub_update", args=(1,)) == [1]
        llm.reset_prefix_cache()
        assert generate(llm) == fresh["base"]
        assert llm.collective_rpc("tensorhub_update_adapter", args=(1,)) == [1]
        llm.reset_prefix_cache()  # the weights changed under cached blocks
        assert generate(llm) == fresh["merged"]
        side = AdapterConfig.from_dict(config()).to_tensor().numel()
        adapter_bytes = sum(t.numel() * t.element_size() for t in adapter(ADAPTERS[1]).values())
        for s in llm.collective_rpc("tensorhub_stats"):  # only the adapter moved, from the trainer
            assert s["nbytes"] == adapter_bytes + side and s["bytes_by_source"] == {trainer_hub.name: s["nbytes"]}, s
    finally:
        llm.collective_rpc("tensorhub_close")
        trainer.close()
