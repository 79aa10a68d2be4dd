"""``tensorhub bench vllm``: how long a weight update of a running vLLM engine
takes through TensorHub, split into pull (all bytes into the staging buffer,
checked) and apply (vLLM's layer-wise reload), beside vLLM reloading the same
weights from a local safetensors file (``reload_weights(weights_path=...)``, the
page cache warm after the first repetition).

One process: a reference server, a trainer Hub publishing a random Qwen2-style
checkpoint, and an in-process engine (CPU or GPU, whatever vLLM runs on).
Methods alternate within each repetition so machine noise hits both alike.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tensorhub.bench.report import Row, print_table, write_json

MODEL = "bench/vllm"


@dataclass(kw_only=True, slots=True)
class VllmBenchConfig:
    hidden: int = 1024
    layers: int = 4
    vocab: int = 16384
    reps: int = 3


def _build_model(path: Path, cfg: VllmBenchConfig) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.hidden * 11 // 4,
                         num_hidden_layers=cfg.layers, num_attention_heads=max(1, cfg.hidden // 64),
                         num_key_value_heads=max(1, cfg.hidden // 512), max_position_embeddings=512,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def run(cfg: VllmBenchConfig, json_path: str | None = None) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine's worker in this process
    from safetensors.torch import load_file
    from vllm import LLM

    from tensorhub import Hub
    from tensorhub.server import EmbeddedServer

    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer() as server:
        model_dir = Path(tmp)
        _build_model(model_dir, cfg)
        state = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            state.update(load_file(str(f)))
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256,
                  enforce_eager=True, worker_extension_cls="tensorhub_vllm.extension.TensorHubWorkerExtension")
        llm.collective_rpc("tensorhub_init", args=({"hub": server.address, "model": MODEL},))
        samples: dict[str, list[float]] = {"tensorhub update": [], "tensorhub pull": [], "tensorhub apply": [],
                                           "vllm reload from safetensors": []}
        with Hub.connect(server.address, name="bench-trainer") as trainer:
            for rep in range(cfg.reps + 1):  # the first is warm-up
                pub = trainer.publish(MODEL, rep, state)
                start = time.perf_counter()
                llm.collective_rpc("tensorhub_update", args=(rep,))
                total = time.perf_counter() - start
                (stats,) = llm.collective_rpc("tensorhub_stats")
                pub.unpublish()
                start = time.perf_counter()
                llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir),
                                                             "is_checkpoint_format": True})
                disk = time.perf_counter() - start
                if rep:
                    for key, value in (("tensorhub update", total), ("tensorhub pull", stats["pull_s"]),
                                       ("tensorhub apply", stats["apply_s"]), ("vllm reload from safetensors", disk)):
                        samples[key].append(value)
        llm.collective_rpc("tensorhub_close")
    rows = [Row.of(method, 1, nbytes, values) for method, values in samples.items()]
    print_table(f"vLLM weight update, {nbytes / 2**20:.0f} MiB checkpoint", rows,
                {"tensorhub update": "vllm reload from safetensors"})
    if json_path:
        write_json(json_path, rows, bench="vllm", config=asdict(cfg))
    return 0
