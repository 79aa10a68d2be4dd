"""``tensorhub bench vllm --tp N``: a weight update of a running vLLM engine
through TensorHub, per worker (bytes pulled against the checkpoint, seconds
pulling, seconds applying), beside vLLM reloading the same weights from a local
safetensors file (``reload_weights(weights_path=...)``, page cache warm after
the first repetition) in the same run.

One process drives it: a trainer Hub publishing a random Qwen2-style
checkpoint (``--model moe``: a random Qwen3-MoE, ``--experts`` per layer, the
checkpoint's per-expert tensors; ``--quantization fp8_per_channel``: an engine
serving FP8, both paths re-quantizing the bf16 weights) and an engine (its core in this process, its TP workers in their
own). The reference server runs in its own process, as it does in production:
inside the driver its calls wait for the GIL while vLLM's engine core polls
for the workers' replies (a worker's pull: 0.064-0.068 s so, 0.054-0.056 s
with the server in its own process, one run of ``--reps 5`` each).
Methods alternate within each repetition so machine noise hits both alike; the
first repetition is a warm-up. JSON rows:

    {"method": "tensorhub", "rank", "pulled_bytes", "checkpoint_bytes", "pull_seconds", "apply_seconds", "seconds"}
    {"method": "tensorhub-update", "seconds"}     the whole update as the driver sees it (all workers)
    {"method": "disk-reload", "seconds"}          vLLM's own reload from the local file (all workers)

Every ``seconds`` is a median over repetitions; ``samples`` lists them.
For MoE, ``disk-reload`` is vLLM's reload as it is, which on CPU skips the
experts' repack (and so serves other weights: docs/vllm-moe-reload.md); the
TensorHub update includes that repack, and so does the extra row
``{"method": "disk-reload-repack", "seconds"}`` (a correct reload from disk).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MODEL = "bench/vllm"


@dataclass(kw_only=True, slots=True)
class VllmBenchConfig:
    hidden: int = 1024
    layers: int = 4
    vocab: int = 16384
    reps: int = 3
    tp: int = 1
    model: str = "dense"  # or "moe"
    experts: int = 32  # per MoE layer (top-4), expert intermediate hidden / 4
    overread: float = 0.2  # the engine's init_info.overread: bytes read as whole rows beyond the read set
    lora_rank: int = 0  # > 0: LoRA adapter versions of this rank instead of base weights (bench_lora)
    # vLLM's quantization of the engine (e.g. "fp8_per_channel"): the versions stay bf16, and both the
    # TensorHub update and the reload from disk re-quantize them as vLLM's layer-wise reload does
    quantization: str = ""
    # The workers' announces in a round of their own, as before they went with the Resolve (HubConfig.announce_ahead)
    announces_apart: bool = False


def _build_moe(path: Path, cfg: VllmBenchConfig) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.hidden * 2,
                            moe_intermediate_size=cfg.hidden // 4, num_experts=cfg.experts, num_experts_per_tok=4,
                            num_hidden_layers=cfg.layers, num_attention_heads=max(1, cfg.hidden // 64),
                            num_key_value_heads=max(cfg.tp, cfg.hidden // 512), head_dim=64,
                            max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="bfloat16")
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def _build_model(path: Path, cfg: VllmBenchConfig) -> None:
    if cfg.model == "moe":
        _build_moe(path, cfg)
        return
    if cfg.model != "dense":
        raise ValueError(f"--model must be dense or moe, not {cfg.model!r}")
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.hidden * 11 // 4,
                         num_hidden_layers=cfg.layers, num_attention_heads=max(1, cfg.hidden // 64),
                         num_key_value_heads=max(cfg.tp, cfg.hidden // 512), max_position_embeddings=512,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def _env(cfg: VllmBenchConfig) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    cores = sorted(os.sched_getaffinity(0))
    if cfg.tp > 1 and len(cores) >= cfg.tp:
        # vLLM's automatic CPU binding wants a NUMA node per worker; one core each instead
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in cores[:cfg.tp]))


def _stop_when_started(started: cf.Future) -> None:
    try:
        server = started.result(timeout=60)
    except (RuntimeError, OSError, cf.TimeoutError):  # it never started: nothing to stop
        return
    server.stop()


@contextlib.contextmanager
def bench_engine(cfg: VllmBenchConfig):  # -> Iterator[tuple[LLM, ServerProcess, Path, dict]]
    """A reference server, the random checkpoint (its directory and its tensors)
    and an engine on it whose workers' TensorHub extension is initialised
    (serve: true, the default: staging allocated and registered once, kept between updates).
    With ``cfg.lora_rank``: an engine serving LoRA adapters up to that rank
    instead, its base-weight extension not initialised (only adapters move)."""
    _env(cfg)
    from safetensors.torch import load_file
    from vllm import LLM

    from tensorhub.local.serverprocess import ServerProcess

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        # The server process starts (~1.3 s: a Python importing gRPC) while the
        # checkpoint and the engine are built.
        starting = cf.ThreadPoolExecutor(max_workers=1)
        started = starting.submit(ServerProcess)
        starting.shutdown(wait=False)
        stack.callback(_stop_when_started, started)
        model_dir = Path(tmp)
        _build_model(model_dir, cfg)
        state = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            state.update(load_file(str(f)))
        # LoRA: two versions resident while one replaces the other, and the disk adapter beside them
        lora = {"enable_lora": True, "max_loras": 2, "max_cpu_loras": 4, "max_lora_rank": cfg.lora_rank} \
            if cfg.lora_rank else {}
        quantized = {"quantization": cfg.quantization} if cfg.quantization else {}
        llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256,
                  enforce_eager=True, tensor_parallel_size=cfg.tp, **lora, **quantized,
                  worker_extension_cls="tensorhub_vllm.extension.TensorHubWorkerExtension")
        server = started.result(timeout=60)
        if not cfg.lora_rank:
            llm.collective_rpc("tensorhub_init",
                               args=({"hub": server.address, "model": MODEL, "overread": cfg.overread,
                                      "hub_config": {"announce_ahead": not cfg.announces_apart}},))
        try:
            yield llm, server, model_dir, state
        finally:
            llm.collective_rpc("tensorhub_close")


def reload_with_repack(worker, weights_path: str) -> None:
    """vLLM's reload from disk with the experts' repack our apply adds (run in
    each worker by ``collective_rpc``): what a correct reload of a MoE model costs."""
    from tensorhub_vllm.vllm_internals import moe_finalize_on_update

    with moe_finalize_on_update(worker.model_runner.model):
        worker.reload_weights(weights_path=weights_path, is_checkpoint_format=True)


def one_round(llm, trainer, version: int, state: dict, model_dir: Path,
              messages: list[dict] | None = None, control=None) -> tuple[float, float, list[dict]]:
    """Publish ``state`` as ``version``, update the engine through TensorHub,
    withdraw it, then reload the same weights from the file: (update seconds,
    disk reload seconds, each worker's ``tensorhub_stats``). ``messages``: the
    update's control messages to the server, by method, appended (the
    announces sent ahead with the engine's Resolve under "announces_ahead"),
    as ``control()`` (the server's ``ControlView``) counts them."""
    pub = trainer.publish(MODEL, version, state)
    before = control() if messages is not None else None
    start = time.perf_counter()
    llm.collective_rpc("tensorhub_update", args=(version,))
    update = time.perf_counter() - start
    if before is not None:
        after = control()
        sent = {k: n - before.calls.get(k, 0) for k, n in after.calls.items()
                if n > before.calls.get(k, 0) and k not in ("Describe", "Heartbeat")}
        messages.append(sent | {"announces_ahead": after.announces_ahead - before.announces_ahead})
    stats = llm.collective_rpc("tensorhub_stats")
    pub.unpublish()
    start = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir), "is_checkpoint_format": True})
    return update, time.perf_counter() - start, stats


def measure(cfg: VllmBenchConfig) -> list[dict]:
    """The rows (see the module docstring)."""
    from tensorhub import Hub
    from tensorhub.client.rpc import ReferenceClient

    workers: list[list[dict]] = [[] for _ in range(cfg.tp)]
    updates: list[float] = []
    disk: list[float] = []
    disk_repack: list[float] = []
    messages: list[dict] = []
    with bench_engine(cfg) as (llm, server, model_dir, state), \
            Hub.connect(server.address, name="bench-trainer") as trainer, \
            contextlib.closing(ReferenceClient(server.address)) as client:
        for rep in range(cfg.reps + 1):  # the first is warm-up
            update, reload, stats = one_round(llm, trainer, rep, state, model_dir, messages,
                                              lambda: client.describe().control)
            if cfg.model == "moe":
                start = time.perf_counter()
                llm.collective_rpc(reload_with_repack, args=(str(model_dir),))
                disk_repack.append(time.perf_counter() - start)
            if rep:
                disk.append(reload)
                updates.append(update)
                for rank, s in enumerate(stats):
                    workers[rank].append(s)
    rows = []
    for rank, samples in enumerate(workers):
        seconds = [s["pull_s"] + s["apply_s"] for s in samples]
        rows.append({"method": "tensorhub", "rank": rank, "pulled_bytes": samples[-1]["nbytes"],
                     "checkpoint_bytes": samples[-1]["checkpoint_nbytes"],
                     "pull_seconds": statistics.median(s["pull_s"] for s in samples),
                     "apply_seconds": statistics.median(s["apply_s"] for s in samples),
                     "seconds": statistics.median(seconds), "samples": seconds,
                     # per update: the pull's path, whether the server named its holders, its refreshes; the
                     # last one's bytes by holder (a sibling worker's replicated tensors show here)
                     "paths": [s.get("path", "") for s in samples], "named": [s.get("named", False) for s in samples],
                     "refreshes": [s.get("refreshes", 0) for s in samples],
                     "not_replayed": [s.get("not_replayed", "") for s in samples],
                     "bytes_by_source": samples[-1].get("bytes_by_source", {})})
    # Per update, the messages the server received (the engine's: the trainer publishes before), by method
    rows.append({"method": "tensorhub-update", "seconds": statistics.median(updates), "samples": updates,
                 "messages": messages})
    rows.append({"method": "disk-reload", "seconds": statistics.median(disk), "samples": disk})
    if disk_repack:
        rows.append({"method": "disk-reload-repack", "seconds": statistics.median(disk_repack[1:]),
                     "samples": disk_repack[1:]})
    return rows


def _print(rows: list[dict], cfg: VllmBenchConfig) -> None:
    from rich.console import Console
    from rich.table import Table

    disk = next(r["seconds"] for r in rows if r["method"] == "disk-reload")
    ckpt = next(r["checkpoint_bytes"] for r in rows if r["method"] == "tensorhub")
    served = f", served as {cfg.quantization}" if cfg.quantization else ""
    table = Table(title=f"vLLM weight update ({cfg.model}{served}), TP={cfg.tp}, {ckpt / 2**20:.0f} MiB checkpoint "
                        f"(median of {cfg.reps})")
    for col in ("method", "rank", "pulled / checkpoint", "pull s", "apply s", "seconds", "vs disk-reload"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        share = f"{r['pulled_bytes'] / r['checkpoint_bytes']:.2f}" if "pulled_bytes" in r else ""
        table.add_row(r["method"], str(r.get("rank", "")), share, f"{r['pull_seconds']:.3f}" if share else "",
                      f"{r['apply_seconds']:.3f}" if share else "", f"{r['seconds']:.3f}",
                      f"{r['seconds'] / disk:.2f}x")
    Console().print(table)
    messages = next(r["messages"] for r in rows if r["method"] == "tensorhub-update")
    if messages:  # the steady state's: the last update's
        last = messages[-1]
        Console().print(f"control messages of the last update: {sum(n for k, n in last.items() if k != 'announces_ahead')}"
                        f" ({', '.join(f'{k} {n}' for k, n in sorted(last.items()) if k != 'announces_ahead')}); "
                        f"announces sent ahead with the Resolve: {last['announces_ahead']}")


def run(cfg: VllmBenchConfig, json_path: str | None = None) -> int:
    if cfg.lora_rank:
        from tensorhub_vllm.bench_lora import measure_lora, print_lora

        rows = measure_lora(cfg)
        print_lora(rows, cfg)
    else:
        rows = measure(cfg)
        _print(rows, cfg)
    if json_path:
        Path(json_path).write_text(json.dumps({"results": rows, "bench": "vllm", "config": asdict(cfg)}, indent=2) + "\n")
    return 0
