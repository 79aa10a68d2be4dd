"""LoRA adapters of the tiny Qwen2 (vllm_tiny_model.build), built at test time:
PEFT-named tensors with random A and B (B is not zero, as it is at PEFT's
init, so every adapter visibly changes the tokens), and the same adapter
saved as PEFT saves it, for an engine that loads it from disk."""

from __future__ import annotations

import json
from pathlib import Path

import torch

HIDDEN, KV, INTERMEDIATE, LAYERS = 128, 64, 256, 2
# (in, out) of each targeted projection of the tiny model
SHAPES = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.v_proj": (HIDDEN, KV), "mlp.down_proj": (INTERMEDIATE, HIDDEN)}


def config(r: int = 8) -> dict:
    return {"r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj", "v_proj", "down_proj"], "bias": "none",
            "peft_type": "LORA", "task_type": "CAUSAL_LM"}


def adapter(seed: int, r: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(LAYERS):
        for module, (fan_in, fan_out) in SHAPES.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{prefix}.lora_A.weight"] = (0.2 * torch.randn(r, fan_in, generator=g)).to(torch.bfloat16)
            out[f"{prefix}.lora_B.weight"] = (0.2 * torch.randn(fan_out, r, generator=g)).to(torch.bfloat16)
    return out


def save_peft(path: Path, tensors: dict[str, torch.Tensor], peft_config: dict) -> Path:
    """As PEFT's ``save_pretrained`` writes an adapter: what vLLM's ``lora_path`` reads."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(peft_config))
    return path


def save_merged(model_dir: Path, path: Path, tensors: dict[str, torch.Tensor], peft_config: dict) -> Path:
    """``model_dir`` with the adapter merged into its weights (``tensorhub.lora.merge_lora``,
    what merged mode computes), at ``path``: a fresh engine's reference."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tensorhub.lora import AdapterConfig, base_weight_name, merge_lora

    shutil.copytree(model_dir, path, dirs_exist_ok=True)
    weights = load_file(str(model_dir / "model.safetensors"))
    scale = AdapterConfig.from_dict(peft_config).scale()
    for name, lora_a in tensors.items():
        if ".lora_A." in name:
            base = base_weight_name(name)
            weights[base] = merge_lora(weights[base].to(torch.bfloat16), lora_a,
                                       tensors[name.replace(".lora_A.", ".lora_B.")], scale)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
