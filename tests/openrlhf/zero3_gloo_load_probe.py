"""Probe (run by hand, not by pytest): does DeepSpeed ZeRO-3 on gloo load a
module's weights exactly, the way transformers' ``from_pretrained`` loads
them? Two processes; each trial makes a ``Linear(128, 128)`` with a bias (a
Qwen2 q_proj) under ``zero.Init``, gathers it with
``GatheredParameters(modifier_rank=0)``, rank 0 copies known values in, and
each rank compares its partition of the weight with them.

With DeepSpeed's default gather of several parameters (one async all-gather
each, waiting for the last only) a late all-gather on gloo's second thread
overwrites what rank 0 copied in; ``stage3_allgather_sequential`` (what
``openrlhf_zero_rank.ZeroRank`` sets) gathers one parameter at a time.

    .venv-openrlhf/bin/python tests/openrlhf/zero3_gloo_load_probe.py 300 0   # DeepSpeed's default
    .venv-openrlhf/bin/python tests/openrlhf/zero3_gloo_load_probe.py 300 1   # sequential
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from tensorhub.testing import rendezvous


def trial_loads(rank: int, world: int, dist_env: dict[str, str], trials: int, sequential: bool) -> None:
    os.environ.update(dist_env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # as ZeroRank: gloo runs it
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "stage3_allgather_sequential": sequential}}
    saved = torch.Generator().manual_seed(0)
    wrong = 0
    for _ in range(trials):
        with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
            layer = torch.nn.Linear(128, 128, bias=True)
        weight = torch.randn(128, 128, generator=saved).to(torch.bfloat16)
        bias = torch.randn(128, generator=saved).to(torch.bfloat16)
        with deepspeed.zero.GatheredParameters([layer.weight, layer.bias], modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    layer.weight.copy_(weight)
                    layer.bias.copy_(bias)
        per = layer.weight.ds_tensor.numel()
        mine = layer.weight.ds_tensor.view(-1)[:per].view(torch.int16)
        wrong += not torch.equal(mine, weight.reshape(-1)[rank * per:(rank + 1) * per].view(torch.int16))
    print(f"stage3_allgather_sequential={sequential} rank {rank}: {wrong}/{trials} loads left its partition "
          "of the weight other than the values loaded", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in ("0", "1"):
        sys.exit("usage: zero3_gloo_load_probe.py TRIALS SEQUENTIAL(0|1)")
    with rendezvous(2) as env:
        mp.spawn(trial_loads, args=(2, env, int(sys.argv[1]), sys.argv[2] == "1"), nprocs=2)
