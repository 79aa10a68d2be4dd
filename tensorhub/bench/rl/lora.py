"""LoRA mode of ``tensorhub bench rl`` (``lora_rank > 0``): the base weights
(``size`` bytes) are frozen and reach the rollouts once, before the run (a
joiner, elastic: when it joins); each trainer step makes only a new adapter
version, and that is what every method moves per step.

The adapter's shape comes from a decoder of Qwen3's proportions that fills the
base: ``lora_layers`` layers of hidden size h, attention q/o of width h, k/v
of width h/4 (GQA), an MLP of 3h, bf16 (embeddings, norms: the rest of the
``size`` bytes, not adapted). h is the largest multiple of 64 whose layers fit
in ``size``. The adapter is PEFT's all-linear LoRA of that decoder: for each of
q/k/v/o/gate/up/down of every layer, A (rank x fan_in) and B (fan_out x rank),
bf16, under PEFT's saved names. At 16 GiB and 36 layers that is h = 4544, and
a rank-32 adapter is 1.1% of the base (Qwen3-8B's is about 1.1% too).

``Adapter`` is TensorHub's trainer side (``via_tensorhub.trainer``); the
rollouts' is ``via_tensorhub_lora``, the baselines' in their own modules.
"""

from __future__ import annotations

from typing import Any

from tensorhub.bench.rl import proc

MODEL = "bench/rl/lora"  # the adapter's own model key, beside the base's (proc.MODEL)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BF16 = 2  # bytes per element
_ALIGN = 64  # h is a multiple of this (so h/4 is a whole number of elements)


def _layer_params(h: int) -> int:
    # q, o: h x h; k, v: h/4 x h; gate, up, down: 3h x h
    return 2 * h * h + 2 * (h // 4) * h + 3 * 3 * h * h


def hidden(size: int, layers: int) -> int:
    """The decoder's hidden size for a base of ``size`` bytes (at least 64)."""
    h = _ALIGN
    while layers * _layer_params(h + _ALIGN) * BF16 <= size:
        h += _ALIGN
    return h


def shapes(size: int, layers: int, rank: int) -> dict[str, tuple[int, ...]]:
    """The adapter's matrices, PEFT name -> shape, in a fixed order."""
    h = hidden(size, layers)
    dims = {"q_proj": (h, h), "k_proj": (h // 4, h), "v_proj": (h // 4, h), "o_proj": (h, h),
            "gate_proj": (3 * h, h), "up_proj": (3 * h, h), "down_proj": (h, 3 * h)}  # (fan_out, fan_in)
    out: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        for module in TARGETS:
            kind = "self_attn" if module in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{i}.{kind}.{module}"
            fan_out, fan_in = dims[module]
            out[f"{prefix}.lora_A.weight"] = (rank, fan_in)
            out[f"{prefix}.lora_B.weight"] = (fan_out, rank)
    return out


def matrix_bytes(cfg: Any) -> int:
    """Bytes of the adapter's A/B matrices (what a step moves, less the settings tensor)."""
    return sum(a * b for a, b in shapes(cfg.size, cfg.lora_layers, cfg.lora_rank).values()) * BF16


def peft_config(rank: int) -> dict:
    """The adapter's settings as PEFT writes them (alpha 2r: a common choice)."""
    return {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none",
            "peft_type": "LORA", "task_type": "CAUSAL_LM"}


def adapter_bytes(cfg: Any) -> int:
    """Bytes of one adapter version as published: the matrices and the settings tensor."""
    from tensorhub.lora import AdapterConfig

    return matrix_bytes(cfg) + AdapterConfig.from_dict(peft_config(cfg.lora_rank)).to_tensor().numel()


def version_bytes(cfg: Any) -> int:
    """What one trainer step makes new: the adapter in LoRA mode, else the whole version."""
    return adapter_bytes(cfg) if cfg.lora_rank else cfg.size


def matrices(cfg: Any) -> dict[str, Any]:
    """A trainer's LoRA parameters: a tensor each, as a PEFT model holds them."""
    import torch

    return {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes(cfg.size, cfg.lora_layers, cfg.lora_rank).items()}


def flat(cfg: Any) -> Any:
    """The adapter as one flat byte buffer: what a collective moves (one broadcast per step)."""
    import torch

    return torch.zeros(matrix_bytes(cfg), dtype=torch.uint8)


def write_version(tensors: dict[str, Any], version: int) -> None:
    """The optimizer step on the adapter: every byte of every matrix becomes ``version``'s marker."""
    import torch

    for t in tensors.values():
        proc.write_version(t.view(-1).view(dtype=torch.uint8), version)


def holds(tensors: dict[str, Any], version: int) -> bool:
    """Every matrix's first and last byte carry ``version``'s marker."""
    import torch

    mark = proc.marker(version)
    for t in tensors.values():
        b = t.contiguous().view(-1).view(dtype=torch.uint8)
        if int(b[0]) != mark or int(b[-1]) != mark:
            return False
    return True


class Adapter:
    """What the trainer makes each step in LoRA mode (``via_tensorhub.trainer``
    publishes it): the adapter's matrices, as a PEFT trainer holds them, over a
    frozen base that its first publish makes available once."""

    def __init__(self, cfg: Any) -> None:
        self.base = proc.weights(cfg.size)
        proc.write_version(self.base, 0)
        self.matrices = matrices(cfg)
        write_version(self.matrices, 0)
        self.config = peft_config(cfg.lora_rank)
        self.base_pub: Any = None

    def publish(self, hub: Any, version: int) -> Any:
        from tensorhub.lora import publish_adapter

        if self.base_pub is None:  # frozen: published once, never again
            self.base_pub = hub.publish(proc.MODEL, 0, {"w": self.base})
        return publish_adapter(hub, MODEL, version, self.matrices, self.config)

    def step(self, report: Any, version: int) -> None:
        write_version(self.matrices, version)

    def close(self) -> None:
        if self.base_pub is not None:
            self.base_pub.unpublish(timeout=proc.WAIT_TIMEOUT_S)
