"""One rank of a 2-rank FSDP2 LoRA trainer (gloo, CPU) publishing through
vLLM's own trainer-side API (``WeightTransferTrainerFactory``, backend
``tensorhub``) with ``TensorHubTrainerInitInfo(lora=True)``. Lives in the
OpenRLHF suite because its environment is the one with both vLLM and PEFT.
The PEFT model: ``get_peft_model(..., target_modules="all-linear")`` on the
vLLM suite's tiny Qwen2, then ``fully_shard`` per layer and whole, so the LoRA
matrices are DTensors split over the ranks.

Reads commands on stdin, answers ``result <json>``:
    step N   set the LoRA matrices (an optimizer step), send_weights(), save PEFT's
             own adapter state (rank 0) to OUT_DIR/step-N.safetensors, then change
             the matrices again at once (training goes on: the published copy must not)
The ranks meet at MASTER_ADDR / MASTER_PORT in the environment.

    python vllm_trainer_lora_rank.py HUB MODEL_DIR MODEL_KEY RANK WORLD OUT_DIR
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tensorhub.testing import peft_fsdp2_model


def set_lora(model: torch.nn.Module, seed: int) -> None:
    with torch.no_grad():
        for i, param in enumerate(p for n, p in model.named_parameters() if "lora_" in n):
            local = param.to_local()
            g = torch.Generator().manual_seed(100_000 * seed + 10 * i + dist.get_rank())
            local.copy_((0.2 * torch.randn(local.shape, generator=g)).to(local.dtype))


def main(hub: str, model_dir: str, key: str, rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from peft.utils.save_and_load import get_peft_model_state_dict
    from safetensors.torch import save_file
    from tensorhub_vllm.trainer import TensorHubTrainerInitInfo
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    model = peft_fsdp2_model(model_dir, world, rank=8)
    base_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    engine = WeightTransferTrainerFactory.trainer_init(
        TensorHubTrainerInitInfo(hub=hub, model=key, rank=rank, lora=True, hub_config={"connect_timeout_s": 60.0}),
        client=None, source=ModuleSource(model))
    print("result ready", flush=True)
    for line in sys.stdin:
        step = int(line.split()[1])
        set_lora(model, step)
        engine.send_weights()
        state = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
                 for n, t in get_peft_model_state_dict(model).items()}
        if rank == 0:
            save_file(state, f"{out_dir}/step-{step}.safetensors")
        set_lora(model, step + 1000)  # the optimizer writes again before any engine pulled
        print("result " + json.dumps({"version": engine.version, "published_bytes": engine.published_bytes,
                                      "base_bytes": base_bytes}), flush=True)
    engine.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], int(a[3]), int(a[4]), a[5])
