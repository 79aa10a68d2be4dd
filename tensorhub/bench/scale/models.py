"""The tensors of four real MoE models, from their published config values (no
weights), and how each party cuts them.

Names and shapes follow the Hugging Face checkpoints (``../shared/research/moe.md``),
in bf16 as an RL trainer holds them: the FP8 releases of DeepSeek-V3 and Kimi-K2
add a ``weight_scale_inv`` per linear layer, which a bf16 trainer does not have,
and the MTP layer is left out.

Each tensor carries how vLLM's tensor parallelism cuts it (``tp``):
``rows``, ``cols`` (each rank reads chunk r of TP along that dimension),
``kv`` (KV heads fewer than ranks: rank r reads head r·heads/TP), or
``whole`` (replicated). That is what our vLLM adapter's read set records for
Qwen3-MoE (``tests/vllm/test_vllm_moe.py`` checks it on a tiny one); under
expert parallelism experts go whole to one rank each.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorhub.manifest import Manifest, TensorSpec


@dataclass(frozen=True, slots=True)
class Config:
    name: str
    vocab: int
    hidden: int
    layers: int
    dense_layers: int  # the first layers, with a dense MLP
    experts: int
    expert_inter: int
    heads: int
    kv_heads: int = 0  # GQA (Qwen3); 0: MLA (DeepSeek, Kimi)
    head_dim: int = 128
    dense_inter: int = 0
    shared_experts: int = 0


MODELS = {
    "qwen3-30b-a3b": Config("Qwen3-30B-A3B", 151_936, 2048, 48, 0, 128, 768, 32, kv_heads=4),
    "qwen3-235b-a22b": Config("Qwen3-235B-A22B", 151_936, 4096, 94, 0, 128, 1536, 64, kv_heads=4),
    "deepseek-v3": Config("DeepSeek-V3", 129_280, 7168, 61, 3, 256, 2048, 128, dense_inter=18_432, shared_experts=1),
    "kimi-k2": Config("Kimi-K2", 163_840, 7168, 61, 1, 384, 2048, 64, dense_inter=18_432, shared_experts=1),
}


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    tp: str  # rows | cols | kv | whole
    dtype: str = "bfloat16"
    expert: int = -1  # the routed expert it belongs to (-1: none), for expert parallelism


def tensors(cfg: Config) -> list[Tensor]:
    h = cfg.hidden
    out = [Tensor("model.embed_tokens.weight", (cfg.vocab, h), "rows")]
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        out += [Tensor(p + "input_layernorm.weight", (h,), "whole"),
                Tensor(p + "post_attention_layernorm.weight", (h,), "whole")]
        if cfg.kv_heads:  # GQA with q/k norms (Qwen3)
            q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
            out += [Tensor(p + "self_attn.q_proj.weight", (q, h), "rows"),
                    Tensor(p + "self_attn.k_proj.weight", (kv, h), "kv"),
                    Tensor(p + "self_attn.v_proj.weight", (kv, h), "kv"),
                    Tensor(p + "self_attn.o_proj.weight", (h, q), "cols"),
                    Tensor(p + "self_attn.q_norm.weight", (cfg.head_dim,), "whole"),
                    Tensor(p + "self_attn.k_norm.weight", (cfg.head_dim,), "whole")]
        else:  # MLA (DeepSeek-V3, Kimi-K2): q_lora 1536, kv_lora 512, rope 64
            out += [Tensor(p + "self_attn.q_a_proj.weight", (1536, h), "whole"),
                    Tensor(p + "self_attn.q_a_layernorm.weight", (1536,), "whole"),
                    Tensor(p + "self_attn.q_b_proj.weight", (cfg.heads * 192, 1536), "rows"),
                    Tensor(p + "self_attn.kv_a_proj_with_mqa.weight", (576, h), "whole"),
                    Tensor(p + "self_attn.kv_a_layernorm.weight", (512,), "whole"),
                    Tensor(p + "self_attn.kv_b_proj.weight", (cfg.heads * 256, 512), "rows"),
                    Tensor(p + "self_attn.o_proj.weight", (h, cfg.heads * 128), "cols")]
        if i < cfg.dense_layers:
            out += _mlp(p + "mlp.", h, cfg.dense_inter)
            continue
        out.append(Tensor(p + "mlp.gate.weight", (cfg.experts, h), "whole"))
        if not cfg.kv_heads:
            out.append(Tensor(p + "mlp.gate.e_score_correction_bias", (cfg.experts,), "whole", "float32"))
        if cfg.shared_experts:
            out += _mlp(p + "mlp.shared_experts.", h, cfg.expert_inter * cfg.shared_experts)
        for e in range(cfg.experts):
            out += _mlp(p + f"mlp.experts.{e}.", h, cfg.expert_inter, expert=e)
    out += [Tensor("model.norm.weight", (h,), "whole"), Tensor("lm_head.weight", (cfg.vocab, h), "rows")]
    return out


def _mlp(prefix: str, h: int, inter: int, expert: int = -1) -> list[Tensor]:
    return [Tensor(prefix + "gate_proj.weight", (inter, h), "rows", expert=expert),
            Tensor(prefix + "up_proj.weight", (inter, h), "rows", expert=expert),
            Tensor(prefix + "down_proj.weight", (h, inter), "cols", expert=expert)]


def manifest(model: list[Tensor]) -> Manifest:
    size = {"bfloat16": 2, "float32": 4}
    return Manifest(tuple(TensorSpec(t.name, t.dtype, t.shape, size[t.dtype] * _numel(t.shape)) for t in model))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def parameters(model: list[Tensor]) -> int:
    return sum(_numel(t.shape) for t in model)
