"""LoRA adapter versions served from memory (tensorhub_vllm.adapter_versions):
a trainer publishes adapters (tensorhub.lora), one engine pulls them without
writing a file, and generates what a fresh engine that loaded the same
adapter from PEFT files on disk generates, token for token.

One LoRA engine serves every test of this module (engine starts dominate the
suite's time); the fresh disk engine runs once, first, for all references."""

from __future__ import annotations

import gc
import os
import sys

import pytest
from conftest import HERE, HUB_CONFIG

sys.path.insert(0, str(HERE))
from vllm_tiny_adapter import adapter, config, save_peft

MODEL = "tiny-qwen2/lora/math"
# Longer than one KV block (the CPU backend's is 128 tokens), so a repeated
# prompt is served from the prefix cache.
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)
PROMPTS = ["the quick brown", "weights move from", LONG]
ADAPTERS = {1: 1, 2: 2}  # version -> seed
ENGINE_ARGS = {"dtype": "bfloat16", "max_model_len": 256, "enforce_eager": True, "enable_lora": True,
               "max_loras": 2, "max_lora_rank": 16, "enable_prefix_caching": True}


def generate(llm, lora=None, prompts=PROMPTS) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), lora_request=lora, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def fresh(tiny_model, tmp_path_factory):
    """What a fresh engine generates for the base and for each adapter loaded
    from PEFT files (vLLM's own disk path): the references of this module."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    llm = LLM(model=str(tiny_model), **ENGINE_ARGS)
    out = {"base": generate(llm)}
    for version, seed in ADAPTERS.items():
        path = save_peft(tmp_path_factory.mktemp(f"peft-{version}"), adapter(seed), config())
        out[version] = generate(llm, LoRARequest(f"disk-{version}", version, str(path)))
    del llm
    gc.collect()
    assert out[1] != out["base"] and out[2] != out[1]  # each adapter changes the tokens: the checks below can fail
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

    llm = LLM(model=str(tiny_model), **ENGINE_ARGS,
              worker_extension_cls="tensorhub_vllm.extension.TensorHubWorkerExtension")
    adapters = AdapterVersions(llm, hub=hub_server.address, model=MODEL, hub_config=HUB_CONFIG)
    yield llm, adapters
    adapters.close()
    del llm
    gc.collect()


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
