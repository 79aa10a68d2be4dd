"""A one-off check, not collected by pytest (two vLLM engine starts, about a
minute: too dear for CI): a PEFT model's adapter sent through vLLM's trainer
API with ``TensorHubTrainerInitInfo(lora=True)``, loaded by an engine from
memory (``AdapterVersions``), generates what a fresh engine that loads the
same adapter from PEFT's own ``save_pretrained`` files generates.
In the OpenRLHF environment, the one with vLLM and PEFT:

    PYTHONPATH=...:tests/openrlhf:tests/vllm .venv-openrlhf/bin/python tests/openrlhf/lora_engine_tokens.py WORKDIR
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PROMPTS = ["the quick brown", "weights move from", "tensorhub pulls versions"]
ENGINE_ARGS = {"dtype": "bfloat16", "max_model_len": 256, "enforce_eager": True, "enable_lora": True,
               "max_loras": 2, "max_lora_rank": 16}
KEY = "tiny/lora/default"


def main(work: Path) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, str(HERE.parent / "vllm"))
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM
    from vllm_tiny_model import build

    from tensorhub.server import EmbeddedServer

    model_dir = build(work / "tiny")
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16),
                          LoraConfig(task_type=TaskType.CAUSAL_LM, r=8, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():  # a trained adapter: B is not PEFT's zero init
        g = torch.Generator().manual_seed(3)
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=g))
    peft.save_pretrained(work / "peft")  # vLLM's disk path reads this
    spec = {"engine_args": ENGINE_ARGS, "prompts": PROMPTS, "max_tokens": 8,
            "engines": [{"model": str(model_dir), "runs": {"base": None, "disk": str(work / "peft")}}]}
    (work / "spec.json").write_text(json.dumps(spec))
    run = subprocess.run([sys.executable, str(HERE.parent / "vllm" / "vllm_lora_reference.py"),
                          str(work / "spec.json")], check=True, capture_output=True, text=True, timeout=600)
    reference = json.loads([line for line in run.stdout.splitlines() if line.startswith("REFERENCE ")][-1][10:])

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from tensorhub_vllm.adapter_versions import AdapterVersions
    from tensorhub_vllm.trainer import TensorHubTrainerInitInfo
    from vllm import LLM, SamplingParams
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    with EmbeddedServer() as server:
        trainer = WeightTransferTrainerFactory.trainer_init(
            TensorHubTrainerInitInfo(hub=server.address, model=KEY, rank=0, lora=True), client=None,
            source=ModuleSource(peft))
        trainer.send_weights()
        llm = LLM(model=str(model_dir), **ENGINE_ARGS, distributed_executor_backend="mp",
                  worker_extension_cls="tensorhub_vllm.extension.TensorHubWorkerExtension")
        adapters = AdapterVersions(llm, hub=server.address, model=KEY)
        adapters.load(trainer.version)
        with adapters.use() as lora:
            outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), lora_request=lora,
                                use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        trainer.shutdown()
    result = {"same_as_disk": got == reference["disk"], "adapter_changes_tokens": reference["disk"] != reference["base"],
              "memory": got, "disk": reference["disk"], "base": reference["base"]}
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0 if result["same_as_disk"] and result["adapter_changes_tokens"] else 1)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
