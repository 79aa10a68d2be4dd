"""vLLM's trainer-side API (``tensorhub_vllm.trainer``) with ``lora=True``:
a PEFT-wrapped FSDP2 module on two ranks publishes only its LoRA adapter as
an adapter version, and a reader gets PEFT's own tensors, which vLLM's
``LoRAModel.from_lora_tensors`` takes. (In the OpenRLHF suite: its
environment is the one with both vLLM and PEFT installed.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import child_pythonpath

from tensorhub import Hub
from tensorhub.lora import ADAPTER_CONFIG, pull_adapter
from tensorhub.server import EmbeddedServer
from tensorhub.testing import ask_ranks, rank_result, rendezvous

KEY = "tiny/lora/default"


def test_fsdp2_peft_ranks_publish_only_the_adapter(tiny_model, tmp_path):
    from safetensors.torch import load_file

    script = Path(__file__).with_name("vllm_trainer_lora_rank.py")
    with EmbeddedServer() as server, rendezvous(2) as dist_env, Hub.connect(server.address, name="reader") as hub:
        env = {**os.environ, **dist_env, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath()}
        ranks = [subprocess.Popen([sys.executable, str(script), server.address, str(tiny_model), KEY, str(r), "2",
                                   str(tmp_path)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for r in range(2)]

        try:
            assert [rank_result(p) for p in ranks] == ["ready", "ready"]
            for step in (1, 2):
                sent = ask_ranks(ranks, f"step {step}")
                assert [s["version"] for s in sent] == [step, step]
                # the ranks have written their matrices again: the version is what was sent
                peft = load_file(str(tmp_path / f"step-{step}.safetensors"))
                got = pull_adapter(hub, KEY, step, timeout=60)
                assert set(got.tensors) == set(peft)
                assert all(torch.equal(got.tensors[n], t) for n, t in peft.items())
                adapter_bytes = sum(t.numel() * t.element_size() for t in peft.values())
                side = got.result.tensors[ADAPTER_CONFIG].numel()
                assert got.result.nbytes == adapter_bytes + side  # only the adapter
                assert got.result.nbytes < sent[0]["base_bytes"] / 4
                # each rank its shards (about half), plus the settings tensor each
                assert sum(s["published_bytes"] for s in sent) == adapter_bytes + 2 * side
                assert all(abs(s["published_bytes"] - adapter_bytes / 2) < 0.1 * adapter_bytes for s in sent)
                print(json.dumps({"version": step, "adapter_bytes": adapter_bytes, "read_bytes": got.result.nbytes,
                                  "base_bytes": sent[0]["base_bytes"],  # docs/history/vllm.md
                                  "published_bytes": [s["published_bytes"] for s in sent]}))
            _vllm_builds_it(got)
        finally:
            for proc in ranks:
                proc.kill()
                proc.wait(timeout=30)


def _vllm_builds_it(adapter):
    """vLLM's own tensor path builds a LoRA model of the pulled adapter: a
    LoRA for every projection of every layer, names parsed as vLLM parses them."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict({**adapter.config.to_peft_dict(), "vllm_max_position_embeddings": 512})
    lora = LoRAModel.from_lora_tensors(lora_model_id=1, tensors=dict(adapter.tensors), peft_helper=helper,
                                       device="cpu", dtype=torch.bfloat16, model_vocab_size=512)
    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert {m.rsplit(".", 1)[-1] for m in lora.loras} == projections and len(lora.loras) == 2 * len(projections)
    assert all(m.startswith("model.layers.") for m in lora.loras)


def test_lora_needs_the_peft_module():
    from tensorhub_vllm.trainer import TensorHubTrainerInitInfo, TensorHubTrainerWeightTransferEngine
    from vllm.distributed.weight_transfer.base import WeightSource

    with pytest.raises(ValueError, match=r"TensorHubTrainerInitInfo\.cut: the readers' cut is for base weights"):
        TensorHubTrainerInitInfo(hub="127.0.0.1:1", model=KEY, rank=0, lora=True, cut="readers")
    with pytest.raises(ValueError, match=r"TensorHubTrainerInitInfo\.lora: must be True or False"):
        TensorHubTrainerInitInfo(hub="127.0.0.1:1", model=KEY, rank=0, lora="yes")

    class Tensors(WeightSource):  # a source without a module: nothing to read the adapter from
        def metadata(self):
            return []

        def __iter__(self):
            return iter([])

    with pytest.raises(ValueError, match=r"lora: the adapter is read from the PEFT model itself"):
        TensorHubTrainerWeightTransferEngine.trainer_init(
            TensorHubTrainerInitInfo(hub="127.0.0.1:1", model=KEY, rank=0, lora=True), client=None, source=Tensors())
