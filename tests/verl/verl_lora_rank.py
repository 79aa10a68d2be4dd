"""One rank of a 2-rank FSDP2 LoRA trainer (gloo, CPU) with verl's
``tensorhub`` checkpoint engine at ``lora: true``. The PEFT model is built as
verl's FSDP engine builds it for ``lora_rank > 0`` (``get_peft_model`` with
``target_modules="all-linear"``, then ``fully_shard`` per layer and whole), so
its LoRA A/B matrices are DTensors sharded over the ranks. ``full_tensor`` is
made to fail while the engine sends: a gather anywhere in it fails the run.

Reads commands on stdin, answers ``result <json>``:
    step N     change the LoRA matrices (an optimizer step), send_weights(global_steps=N)
               as verl's worker does (with the base-weight stream verl passes), and
               save PEFT's own state dict of the adapter (rank 0) to OUT_DIR/step-N.safetensors
    finalize   verl's finalize after the rollouts have the step

    python verl_lora_rank.py ADDRESS MODEL_DIR MODEL_KEY RANK WORLD OUT_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch
import torch.distributed as dist

from tensorhub.testing import peft_fsdp2_model

RANK_LORA = 8


def perturb(model: torch.nn.Module, step: int) -> None:
    """An optimizer step on the adapter: every LoRA matrix changes (B too, so it is not PEFT's zero init)."""
    with torch.no_grad():
        lora = [p for n, p in model.named_parameters() if "lora_" in n]
        for i, param in enumerate(lora):
            local = param.to_local()
            g = torch.Generator().manual_seed(100_000 * step + 10 * i + dist.get_rank())
            local.copy_(torch.randn(local.shape, generator=g).to(local.dtype))


def peft_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's own saved state of the adapter (``get_peft_model_state_dict``), gathered (collective)."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for n, t in get_peft_model_state_dict(model).items()}


def main(address: str, model_dir: str, key: str, rank: int, world: int, out_dir: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from safetensors.torch import save_file
    from tensorhub_verl.engine import TensorHubCheckpointEngine
    from torch.distributed.tensor import DTensor

    model = peft_fsdp2_model(model_dir, world, rank=RANK_LORA)
    base_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    engine = TensorHubCheckpointEngine(bucket_size=1 << 20, is_master=rank == 0, address=address, model=key,
                                       lora=True, hub={"connect_timeout_s": 30.0, "chunk_size": 4096})
    engine.module = model  # what verl_internals finds on verl's worker (tested apart)
    gather = DTensor.full_tensor

    def no_gather(self, *args, **kwargs):
        raise AssertionError("full_tensor() was called: the trainer must publish its shards, not gather")

    print("result ready", flush=True)
    for line in sys.stdin:
        command, *arg = line.split()
        if command == "step":
            step = int(arg[0])
            perturb(model, step)
            stream = ((n, torch.zeros(1)) for n in ("model.embed_tokens.weight",))  # verl's stream: unread
            DTensor.full_tensor = no_gather
            try:
                metrics = asyncio.run(engine.send_weights(stream, global_steps=step))
            finally:
                DTensor.full_tensor = gather
            state = peft_state(model)
            if rank == 0:
                save_file(state, f"{out_dir}/step-{step}.safetensors")
            print("result " + json.dumps({**metrics, "base_bytes": base_bytes}), flush=True)
        elif command == "finalize":
            engine.finalize()
            print("result " + json.dumps({"published": engine.publication is not None}), flush=True)
    engine.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], int(a[3]), int(a[4]), a[5])
