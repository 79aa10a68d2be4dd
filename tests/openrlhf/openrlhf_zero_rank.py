"""One trainer rank of OpenRLHF's policy model on CPU, as a Ray actor: real
DeepSpeed ZeRO-3 (gloo) over OpenRLHF's own ``Actor`` and ZeRO config, driving
``TensorHubActorPPOTrainer.broadcast_to_vllm`` (the subclass's real code).

Three seams differ from a GPU run, all because they need CUDA:
* ``ActorPPOTrainer.__init__`` builds its replay buffer on the current CUDA
  device, so the trainer is made without ``__init__`` and given what
  ``broadcast_to_vllm`` reads (strategy.args.ds, actor, vllm_engines).
* DeepSpeed's CPU accelerator compiles a shared-memory all-reduce with the C++
  toolchain on first use (about a minute); gloo runs the same collectives, so
  that build is skipped.
* ZeRO-3 gathers parameters one collective at a time
  (``stage3_allgather_sequential``). Its default gather of several parameters
  starts one async all-gather each and waits for the last one only: right with
  NCCL, which runs them in order on one stream, wrong with gloo, which runs
  them on two threads, so an earlier one may still be writing when the gather
  returns. Then ``from_pretrained``'s load (one gather per module, rank 0 loads
  into it, then broadcasts) had a module's weight overwritten by the gathered,
  never initialised partitions: whole partitions of q_proj or k_proj held
  garbage, NaNs included, on both ranks, and the first training step made the
  LoRA matrices NaN. ``differs_from_checkpoint`` checks the load.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


class ZeroRank:
    def __init__(self, rank: int, world: int, dist_env: dict[str, str], model_dir: str, engines: list[Any],
                 lora_rank: int = 0) -> None:
        os.environ.update(dist_env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        import deepspeed
        from openrlhf.models import Actor
        from openrlhf.utils.deepspeed.deepspeed_utils import get_train_ds_config
        from tensorhub_openrlhf.actors import TensorHubActorPPOTrainer

        # by module: `import deepspeed.comm.torch as x` binds deepspeed.comm's attribute `torch` (PyTorch)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))
        torch.manual_seed(rank)
        config = get_train_ds_config(offload=False, adam_offload=False, stage=3, param_dtype="bf16", zpg=1)
        config.update(train_micro_batch_size_per_gpu=1, train_batch_size=world)
        for key, value in list(config["zero_optimization"].items()):
            if value == "auto":  # OpenRLHF's strategy fills these from the model; DeepSpeed's defaults here
                del config["zero_optimization"][key]
        config["zero_optimization"]["stage3_allgather_sequential"] = True  # gloo: see the module docstring
        # lora_rank > 0: OpenRLHF's own PEFT wrapping (--ds.lora.rank), all linear layers
        self.actor = Actor(model_dir, attn_implementation="eager", param_dtype="bf16", ds_config=config,
                           lora_rank=lora_rank, lora_alpha=16, target_modules="all-linear")
        optimizer = torch.optim.AdamW(self.actor.model.parameters(), lr=0.05)
        self.actor.model, self.optimizer, _, _ = deepspeed.initialize(model=self.actor.model, optimizer=optimizer,
                                                                      config=config)
        self.trainer = object.__new__(TensorHubActorPPOTrainer)
        self.trainer.strategy = SimpleNamespace(args=SimpleNamespace(ds=SimpleNamespace(tensor_parallel_size=1)))
        self.trainer.actor = self.actor
        self.trainer.vllm_engines = engines
        self.rank, self.world = rank, world

    def set_engines(self, engines: list[Any]) -> None:
        self.trainer.vllm_engines = engines

    def sync(self) -> dict[str, Any]:
        self.trainer.broadcast_to_vllm()
        return dict(self.trainer.tensorhub_stats)

    def train_step(self) -> int:
        """One real optimizer step, after withdrawing the published step (what
        TensorHubPolicyModelActor.fit does before OpenRLHF's fit)."""
        self.trainer.tensorhub_withdraw()
        engine = self.actor.model
        ids = torch.randint(0, 500, (1, 24), generator=torch.Generator().manual_seed(100 + self.rank))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return engine.global_steps

    def withdraw(self) -> float:
        return self.trainer.tensorhub_withdraw()

    def partitions(self) -> dict[str, tuple[int, int, int]]:
        """Each parameter's ZeRO-3 partition on this rank: (full numel, ds_tensor numel, data_ptr)."""
        return {n: (int(p.ds_numel), p.ds_tensor.numel(), p.ds_tensor.data_ptr())
                for n, p in self.actor.model.module.named_parameters()}

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """PEFT's own saved state of the adapter (``get_peft_model_state_dict``),
        gathered by DeepSpeed (all ranks call this together)."""
        import deepspeed
        from peft.utils.save_and_load import get_peft_model_state_dict

        model = self.actor.model.module
        with deepspeed.zero.GatheredParameters([p for n, p in model.named_parameters() if "lora_" in n]):
            return {n: t.detach().clone() for n, t in get_peft_model_state_dict(model).items()}

    def adapter_config(self) -> dict[str, Any]:
        """PEFT's settings of the adapter, as its adapter_config.json holds them."""
        config = self.actor.model.module.peft_config["default"].to_dict()
        return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}

    def differs_from_checkpoint(self, model_dir: str) -> list[str]:
        """The base parameters whose ZeRO-3 partition on this rank is not its
        slice of the saved weights (a rank must start from the checkpoint)."""
        from safetensors.torch import load_file
        from tensorhub_openrlhf.partitions import partition_range

        saved: dict[str, torch.Tensor] = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            saved.update(load_file(path))
        differ = []
        for name, param in self.actor.model.module.named_parameters():
            if "lora_" in name:
                continue  # PEFT initialises the adapter; it is not loaded
            key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            if key not in saved:
                raise KeyError(f"{name!r} ({key!r}) is not in the checkpoint at {model_dir}")
            start, stop = partition_range(int(param.ds_numel), self.rank, self.world)
            mine = param.ds_tensor.view(-1)[:stop - start]
            if digest(mine) != digest(saved[key].reshape(-1)[start:stop].to(mine.dtype)):
                differ.append(name)
        return differ

    def base_bytes(self) -> int:
        return sum(2 * int(p.ds_numel) for n, p in self.actor.model.module.named_parameters() if "lora_" not in n)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every full parameter, gathered by DeepSpeed (all ranks call this together)."""
        import deepspeed

        params = list(self.actor.model.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.data.detach().clone() for n, p in params}

    def full_digests(self) -> dict[str, str]:
        """sha256 of every full parameter (all ranks call this together)."""
        return {n: digest(t) for n, t in self.full_parameters().items()}
