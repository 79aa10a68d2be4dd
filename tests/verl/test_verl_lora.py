"""verl with a LoRA adapter (``lora_rank > 0``) and ``lora: true``: the trainer
ranks publish only the adapter, each its FSDP2 shards of the A/B matrices in
place, and a rollout that pulls the adapter version gets PEFT's own tensors
under the names vLLM's ``LoRAModel.from_lora_tensors`` reads."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorhub_verl.engine import TensorHubCheckpointEngine
from tensorhub_verl.verl_internals import calling_workers_module
from verl_testlib import save_tiny_model

from tensorhub.lora import ADAPTER_CONFIG
from tensorhub.testing import ask_ranks, rank_result, rendezvous

KEY = "tiny/lora/default"


@pytest.fixture
def rollout(engine_kwargs):
    engine = TensorHubCheckpointEngine(bucket_size=0, **{**engine_kwargs, "model": KEY, "lora": True})
    yield engine
    engine.shutdown()


def receive(engine: TensorHubCheckpointEngine, step: int) -> list:
    async def collect():
        return [item async for item in engine.receive_weights(step)]
    return asyncio.run(collect())


def test_two_fsdp_ranks_publish_only_the_adapter_and_a_rollout_gets_pefts_tensors(server, rollout, tmp_path):
    model_dir = save_tiny_model(str(tmp_path / "tiny"))
    script = Path(__file__).with_name("verl_lora_rank.py")
    with rendezvous(2) as dist_env:
        env = {**os.environ, **dist_env, "OMP_NUM_THREADS": "1"}
        ranks = [subprocess.Popen([sys.executable, str(script), server.address, model_dir, KEY, str(r), "2",
                                   str(tmp_path)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for r in range(2)]
        try:
            _steps(ranks, rollout, tmp_path)
        finally:
            for proc in ranks:
                proc.kill()
                proc.wait(timeout=30)


def _steps(ranks, rollout, tmp_path):
    from safetensors.torch import load_file

    assert [rank_result(proc) for proc in ranks] == ["ready", "ready"]
    for step in (1, 2):
        metrics = ask_ranks(ranks, f"step {step}")
        peft = load_file(str(tmp_path / f"step-{step}.safetensors"))  # PEFT's own state dict, gathered
        adapter_bytes = sum(t.numel() * t.element_size() for t in peft.values())
        assert receive(rollout, step) == []  # the base is unchanged: nothing to load into it
        got = rollout.adapter
        assert got.version == step and rollout.received_version == step
        assert set(got.tensors) == set(peft)  # PEFT's saved names
        for name, want in peft.items():
            assert torch.equal(got.tensors[name], want), name
        assert got.config.r == 8 and got.config.lora_alpha == 16
        # only the adapter moved: the bytes read are the adapter (+ its settings), not the base
        read = got.result.nbytes
        assert read == adapter_bytes + got.result.tensors[ADAPTER_CONFIG].numel()
        assert read < metrics[0]["base_bytes"] / 3  # all-linear rank 8 of a 64-wide model: ~29% of it
        # each rank published its shards of the matrices, about half of the adapter, in place
        published = [m[f"tensorhub/rank{r}/published_mb"] * 2**20 for r, m in enumerate(metrics)]
        assert all(0.4 * adapter_bytes < p < 0.6 * adapter_bytes + 4096 for p in published), published
        assert metrics[0]["tensorhub/version"] == step
        print(json.dumps({"step": step, "adapter_bytes": adapter_bytes, "read_bytes": read,  # docs/history/verl.md
                          "base_bytes": metrics[0]["base_bytes"], "published_bytes": [round(p) for p in published]}))
        assert metrics[0]["checkpoint_engine/payload_mbytes"] * 2**20 == pytest.approx(read)
        # finalize withdraws the in-place shards (training writes them next); the rollout keeps serving
        assert ask_ranks(ranks, "finalize") == [{"published": False}] * 2
        assert rollout.hub.versions(KEY) == [step]
    _vllm_reads_the_names(rollout.adapter)


def _vllm_reads_the_names(adapter):
    """The names vLLM's ``LoRAModel.from_lora_tensors`` reads: PEFT's saved
    ones, as tests/vllm/vllm_tiny_adapter.py feeds the engine (vLLM is not in
    this venv): every projection of every layer, an A and a B each."""
    pattern = re.compile(r"base_model\.model\.model\.layers\.(\d)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight")
    matched = [pattern.fullmatch(name) for name in adapter.tensors]
    assert all(matched), [n for n, m in zip(adapter.tensors, matched) if not m]
    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert {m.group(3) for m in matched} == projections and len(matched) == 2 * 2 * len(projections)
    # "all-linear", resolved by PEFT (to module names or paths)
    assert {t.rsplit(".", 1)[-1] for t in adapter.config.target_modules} == projections


def test_verl_workers_call_send_weights_where_the_module_is_found():
    """verl_internals finds the module on the frame of the worker method that
    awaits ``send_weights``: verl's workers must still call it from a method
    of a worker holding its engine at ``self.actor.engine`` / ``self.engine``."""
    from tests.checkpoint_engine.test_utils import TrainingWorkerTest
    from verl.workers import engine_workers
    from verl.workers.engine.fsdp import transformer_impl

    source = inspect.getsource(engine_workers.ActorRolloutRefWorker.update_weights)
    assert "self.checkpoint_engine.send_weights(" in source and "self.actor.engine" in source
    assert "self.actor = " in inspect.getsource(engine_workers.ActorRolloutRefWorker)
    assert "self.checkpoint_engine.send_weights(" in inspect.getsource(TrainingWorkerTest.update_weights)
    assert re.search(r"self\.engine(: \w+)? = ", inspect.getsource(engine_workers.TrainingWorker.__init__))
    assert re.search(r"self\.module(: [\w.]+)? = ", inspect.getsource(transformer_impl.FSDPEngine))


def test_the_module_is_taken_from_the_awaiting_worker(engine_kwargs):
    """As verl's workers call it: a worker coroutine awaits ``send_weights``,
    and the engine publishes the adapter of ``self.actor.engine.module``."""
    from peft import LoraConfig, get_peft_model

    class Projections(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(16, 16, bias=False)

    class Engine:  # the attribute path of verl's training engines (checked against verl's source above)
        def __init__(self, module):
            self.module = module

    class Worker:
        def __init__(self, module, checkpoint_engine):
            self.actor = type("Actor", (), {})()
            self.actor.engine = Engine(module)
            self.checkpoint_engine = checkpoint_engine

        async def update_weights(self, global_steps):
            return await self.checkpoint_engine.send_weights(iter([]), global_steps=global_steps)

    peft = get_peft_model(Projections(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    trainer = TensorHubCheckpointEngine(bucket_size=0, is_master=True, **{**engine_kwargs, "model": KEY, "lora": True})
    try:
        metrics = asyncio.run(Worker(peft, trainer).update_weights(7))
        assert metrics["tensorhub/version"] == 7
        published = trainer.publication.tensors["base_model.model.q_proj.lora_A.weight"]
        assert published.data_ptr() == peft.base_model.model.q_proj.lora_A["default"].weight.data_ptr()  # in place
        trainer.finalize()
        assert trainer.publication is None
    finally:
        trainer.shutdown()
    with pytest.raises(ValueError, match="no verl worker with a training engine"):
        calling_workers_module()


def test_lora_without_a_worker_or_module_is_refused(engine_kwargs):
    trainer = TensorHubCheckpointEngine(bucket_size=0, is_master=True, **{**engine_kwargs, "model": KEY, "lora": True})
    try:
        with pytest.raises(ValueError, match="set TensorHubCheckpointEngine.module"):
            asyncio.run(trainer.send_weights(iter([]), global_steps=1))
        trainer.module = torch.nn.Linear(2, 2)
        with pytest.raises(ValueError, match="no PEFT adapter 'default'.*nothing was published"):
            asyncio.run(trainer.send_weights(iter([]), global_steps=1))
        assert trainer.hub.versions(KEY) == []
    finally:
        trainer.shutdown()


@pytest.mark.parametrize(("overrides", "match"), [
    ({"lora": "yes"}, r"TensorHubEngineConfig\.lora must be true or false"),
    ({"lora": True, "cut": "readers"}, r"TensorHubEngineConfig\.cut: the readers' cut is for base weights"),
])
def test_bad_lora_settings_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        TensorHubCheckpointEngine(bucket_size=0, address="127.0.0.1:1", model=KEY, **overrides)
