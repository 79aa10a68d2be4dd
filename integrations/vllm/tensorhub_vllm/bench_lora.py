"""``tensorhub bench vllm --lora-rank R``: LoRA adapter versions served by a
running vLLM engine through TensorHub, beside the disk round trip frameworks
use today, in the same run.

Each repetition publishes a new version of an all-linear rank-R adapter of the
random checkpoint (q/k/v/o/gate/up/down of every layer), then

* ``tensorhub-adapter``: ``AdapterVersions.load``: every worker pulls its part
  of each A/B matrix (at TP > 1 the shard its LoRA layers keep) into memory and
  registers it with vLLM, no file;
* ``disk-adapter``: the same tensors written as PEFT's ``save_pretrained``
  writes them (``adapter_model.safetensors`` + ``adapter_config.json``; PEFT
  itself is not a vLLM dependency), then vLLM loads them in place
  (``add_lora`` with ``load_inplace``, what ``/v1/load_lora_adapter`` does).

Methods alternate within each repetition; the first is a warm-up. After the
last, both adapters generate from the same prompt: their tokens must match.
JSON rows:

    {"method": "tensorhub-adapter", "rank", "read_bytes", "share_bytes", "adapter_bytes", "pull_seconds", "register_seconds",
     "paths"}                                           each measured pull's path ("replayed", "planned")
    {"method": "tensorhub-adapter-update", "seconds"}    the load as the driver sees it (all workers)
    {"method": "disk-adapter", "seconds", "save_seconds", "load_seconds"}
    {"method": "tokens-match", "value": true|false}
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

LORA_MODEL = "bench/vllm/lora"
DISK_ID = 1 << 30  # the disk adapter's vLLM id; the versions' ids are hashes below 2**31
_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_config(rank: int) -> dict:
    return {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(_TARGETS), "bias": "none",
            "peft_type": "LORA", "task_type": "CAUSAL_LM"}


def random_adapter(state: dict[str, torch.Tensor], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """PEFT-named A/B matrices for every targeted projection of the checkpoint ``state``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, weight in state.items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in _TARGETS or weight.dim() != 2:
            continue
        fan_out, fan_in = weight.shape
        prefix = f"base_model.model.{module}"
        out[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in**0.5).to(torch.bfloat16)
        out[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) / rank).to(torch.bfloat16)
    return out


def save_like_peft(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """What PEFT's ``save_pretrained(safe_serialization=True)`` writes."""
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(config))


def _tokens(llm, lora) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": list(range(1, 33))}], SamplingParams(temperature=0, max_tokens=16),
                       lora_request=lora, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def measure_lora(cfg) -> list[dict]:
    """The rows (see the module docstring); ``cfg`` a ``bench.VllmBenchConfig``."""
    from vllm.lora.request import LoRARequest

    from tensorhub import Hub
    from tensorhub.lora import AdapterConfig, publish_adapter
    from tensorhub_vllm.adapter_versions import AdapterVersions
    from tensorhub_vllm.bench import bench_engine

    config = lora_config(cfg.lora_rank)
    side = AdapterConfig.from_dict(config).to_tensor().numel()
    workers: list[list[dict]] = [[] for _ in range(cfg.tp)]
    updates: list[float] = []
    saves: list[float] = []
    loads: list[float] = []
    with bench_engine(cfg) as (llm, server, _, state), Hub.connect(server.address, name="bench-trainer") as trainer, \
            tempfile.TemporaryDirectory() as disk_dir:
        adapters = AdapterVersions(llm, hub=server.address, model=LORA_MODEL)
        disk = LoRARequest("disk", DISK_ID, disk_dir, load_inplace=True)
        # The trainer's live LoRA parameters: every version is published in
        # place from this same memory, as a training loop publishes its step.
        tensors = random_adapter(state, cfg.lora_rank, seed=0)
        pub = None
        try:
            for rep in range(cfg.reps + 1):  # the first is warm-up
                if pub is not None:  # the engine holds its own copy: the trainer may step
                    pub.unpublish()
                for name, t in random_adapter(state, cfg.lora_rank, seed=rep).items():
                    tensors[name].copy_(t)
                pub = publish_adapter(trainer, LORA_MODEL, rep, tensors, config)
                start = time.perf_counter()
                adapters.load(rep)
                update = time.perf_counter() - start
                stats = [s["last"] for s in adapters.stats()]
                start = time.perf_counter()
                save_like_peft(Path(disk_dir), tensors, config)
                saved = time.perf_counter()
                llm.llm_engine.add_lora(disk)
                loaded = time.perf_counter()
                print(f"lora rep {rep}/{cfg.reps}: tensorhub {update:.3f}s, disk {loaded - start:.3f}s "
                      f"(save {saved - start:.3f}s)", file=sys.stderr, flush=True)
                if rep:
                    updates.append(update)
                    saves.append(saved - start)
                    loads.append(loaded - saved)
                    for rank, s in enumerate(stats):
                        workers[rank].append(s)
            match = _tokens(llm, adapters.request()) == _tokens(llm, disk)
        finally:
            adapters.close()
            if pub is not None:
                pub.unpublish()
    rows = []
    for rank, samples in enumerate(workers):
        last = samples[-1]
        rows.append({"method": "tensorhub-adapter", "rank": rank, "read_bytes": last["read_bytes"],
                     "share_bytes": last["nbytes"] - side, "adapter_bytes": last["adapter_nbytes"],
                     "pull_seconds": statistics.median(s["pull_s"] for s in samples),
                     "register_seconds": statistics.median(s["register_s"] for s in samples),
                     "paths": [s.get("path", "") for s in samples]})  # "replayed": the steady state
    rows.append({"method": "tensorhub-adapter-update", "seconds": statistics.median(updates), "samples": updates})
    disk_s = [s + lo for s, lo in zip(saves, loads)]
    rows.append({"method": "disk-adapter", "seconds": statistics.median(disk_s), "save_seconds": statistics.median(saves),
                 "load_seconds": statistics.median(loads), "samples": disk_s})
    rows.append({"method": "tokens-match", "value": match})
    return rows


def print_lora(rows: list[dict], cfg) -> None:
    from rich.console import Console
    from rich.table import Table

    disk = next(r for r in rows if r["method"] == "disk-adapter")
    update = next(r for r in rows if r["method"] == "tensorhub-adapter-update")
    adapter = next(r["adapter_bytes"] for r in rows if r["method"] == "tensorhub-adapter")
    table = Table(title=f"vLLM LoRA adapter update, rank {cfg.lora_rank}, TP={cfg.tp}, "
                        f"{adapter / 2**20:.1f} MiB adapter (median of {cfg.reps})")
    for col in ("method", "rank", "read / share", "share / adapter", "pull s", "register s", "seconds", "vs disk"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=col == "method")
    for r in rows:
        if r["method"] == "tensorhub-adapter":
            table.add_row(r["method"], str(r["rank"]), f"{r['read_bytes'] / r['share_bytes']:.3f}",
                          f"{r['share_bytes'] / r['adapter_bytes']:.3f}", f"{r['pull_seconds']:.4f}",
                          f"{r['register_seconds']:.4f}", "", "")
    table.add_row(update["method"], "", "", "", "", "", f"{update['seconds']:.4f}",
                  f"{update['seconds'] / disk['seconds']:.2f}x")
    table.add_row(disk["method"], "", "", "", f"save {disk['save_seconds']:.4f}", f"load {disk['load_seconds']:.4f}",
                  f"{disk['seconds']:.4f}", "1.00x")
    Console().print(table)
    match = next(r["value"] for r in rows if r["method"] == "tokens-match")
    Console().print(f"tokens of the TensorHub adapter and the disk adapter match: {match}")
