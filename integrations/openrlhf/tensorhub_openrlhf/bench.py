"""``python -m tensorhub_openrlhf.bench``: one weight sync of a DeepSpeed
ZeRO-3 trainer through TensorHub, beside the part of OpenRLHF's own sync that
runs without a GPU.

W trainer ranks (real DeepSpeed ZeRO-3, gloo, bf16, a random Qwen2-style
model) and one reader standing in for a rollout engine (a process that pulls
the whole version into preallocated memory, as each engine worker does before
vLLM's reload, which both paths share and which is left out). Per repetition:

* tensorhub: every rank publishes its partitions in place; the reader pulls
  the version. Time = from the sync's start until the reader holds every byte.
  The reader's per-source byte counts are each rank's bytes sent.
* openrlhf gather: OpenRLHF's ``broadcast_to_vllm`` loop on the trainer side,
  ``GatheredParameters([param])`` for every parameter on every rank (what rank
  0 does before each NCCL broadcast), same ranks, same model. Its NCCL
  broadcast into the engines needs CUDA and is not run: rank 0 then sends the
  whole model into the group, which the table lists as bytes, not time.

Methods alternate within each repetition so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import importlib
import os
import queue as queues
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.multiprocessing as mp

MODEL = "bench/openrlhf"


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    ranks: int = 2
    hidden: int = 1024
    layers: int = 4
    vocab: int = 16384
    reps: int = 3


# How long a step of the ranks may take before the bench gives up: start-up
# (imports, DeepSpeed, the model) takes 10-20 s here, a step under a second.
_STEP_TIMEOUT_S = 120


def _rank(rank: int, cfg: BenchConfig, dist_env: dict[str, str], address: str, queue: mp.Queue,
          go: mp.Queue) -> None:
    os.environ.update(dist_env, RANK=str(rank), WORLD_SIZE=str(cfg.ranks), LOCAL_RANK=str(rank))
    import deepspeed
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tensorhub_openrlhf.publisher import WeightPublisher
    from tensorhub_openrlhf.settings import TensorHubSettings

    # A JIT-compiled CPU all-reduce (a minute of C++ on first use); gloo does the same collectives.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=_STEP_TIMEOUT_S))
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=torch.bfloat16):
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.hidden * 11 // 4,
            num_hidden_layers=cfg.layers, num_attention_heads=max(1, cfg.hidden // 64),
            num_key_value_heads=max(1, cfg.hidden // 512), tie_word_embeddings=False))
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    params = list(engine.module.named_parameters())
    publisher = WeightPublisher(TensorHubSettings(address=address, model=MODEL), rank=rank, world=cfg.ranks)
    for rep in range(cfg.reps + 1):
        go.get()
        dist.barrier()
        start = time.perf_counter()
        stats = publisher.publish(rep, params)
        queue.put(("published", rank, rep, stats.nbytes, time.perf_counter() - start))
        go.get()  # the reader has the version: withdraw, then the stock gather
        publisher.withdraw()
        dist.barrier()
        start = time.perf_counter()
        for _, param in params:
            with deepspeed.zero.GatheredParameters([param]):
                pass
        dist.barrier()
        queue.put(("gathered", rank, rep, 0, time.perf_counter() - start))
    publisher.close()
    dist.destroy_process_group()


def run(cfg: BenchConfig, json_path: str | None = None) -> int:
    from tensorhub import Hub
    from tensorhub.bench.report import Row, print_table, write_json
    from tensorhub.local.ports import rendezvous
    from tensorhub.server import EmbeddedServer

    ctx = mp.get_context("spawn")
    samples: dict[str, list[float]] = {"tensorhub sync (publish + pull)": [], "tensorhub publish (slowest rank)": [],
                                       "openrlhf gather (trainer side only)": []}
    sent: dict[str, int] = {}
    with EmbeddedServer() as server, rendezvous(cfg.ranks) as dist_env:
        queue, gos = ctx.Queue(), [ctx.Queue() for _ in range(cfg.ranks)]
        procs = [ctx.Process(target=_rank, args=(r, cfg, dist_env, server.address, queue, gos[r]), daemon=True)
                 for r in range(cfg.ranks)]
        for p in procs:
            p.start()
        with Hub.connect(server.address, name="engine") as reader:
            into = None
            for rep in range(cfg.reps + 1):  # the first is warm-up
                for go in gos:
                    go.put("publish")
                start = time.perf_counter()
                published = _collect(queue, procs, "publish")
                reader.wait_for_version(MODEL, rep, timeout=120)
                result = reader.pull(MODEL, rep, into=into)
                sync_s = time.perf_counter() - start
                into = result.tensors
                for go in gos:
                    go.put("gather")
                gathered = _collect(queue, procs, "gather")
                if rep:
                    samples["tensorhub sync (publish + pull)"].append(sync_s)
                    samples["tensorhub publish (slowest rank)"].append(max(p[4] for p in published))
                    samples["openrlhf gather (trainer side only)"].append(max(g[4] for g in gathered))
                    sent = dict(result.bytes_by_source)
        nbytes = result.nbytes
        deadline = time.monotonic() + _STEP_TIMEOUT_S
        for r, p in enumerate(procs):
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.exitcode != 0:
                p.kill()
                raise RuntimeError(f"rank {r} did not finish cleanly after the last step (exit code {p.exitcode})")
    rows = [Row.of(method, 1, nbytes, values) for method, values in samples.items()]
    print_table(f"OpenRLHF weight sync, {cfg.ranks} ZeRO-3 ranks, {nbytes / 2**20:.0f} MiB model", rows,
                {"tensorhub sync (publish + pull)": "openrlhf gather (trainer side only)"})
    per_rank = sorted(sent.values(), reverse=True)
    print(f"bytes each trainer rank sent (tensorhub): {per_rank} = "
          f"{[f'{b / nbytes:.2f}' for b in per_rank]} of the model; "
          f"openrlhf: rank 0 sends {nbytes:,} (the whole model) into the NCCL group per sync, "
          f"and every rank receives {nbytes * (cfg.ranks - 1) // cfg.ranks:,} in the gathers")
    print("median s: " + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in samples.items()))
    if json_path:
        write_json(json_path, rows, bench="openrlhf", config=asdict(cfg), bytes_sent_by_rank=per_rank)
    return 0


def _collect(queue: mp.Queue, procs: list, step: str) -> list[tuple]:
    """One message from every rank for ``step``. A rank that exits with an
    error fails the bench at once, naming it (its traceback is on stderr),
    rather than leaving the others and this process waiting out the deadline."""
    deadline = time.monotonic() + _STEP_TIMEOUT_S
    messages: list[tuple] = []
    while len(messages) < len(procs):
        try:
            messages.append(queue.get(timeout=0.5))
        except queues.Empty:
            failed = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"{', '.join(failed)} failed during {step}: see its traceback above") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(procs) - len(messages)} rank(s) sent nothing for {step} within "
                                   f"{_STEP_TIMEOUT_S} s") from None
    return messages


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tensorhub_openrlhf.bench", description=__doc__.split("\n")[0])
    defaults = BenchConfig()
    for name in ("ranks", "hidden", "layers", "vocab", "reps"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cfg = BenchConfig(**{k: v for k, v in vars(args).items() if k != "json"})
    raise SystemExit(run(cfg, args.json))


if __name__ == "__main__":
    main()
