"""Block-FP8 companions of bf16 versions: what a DeepSeek-V3 / Kimi-K2 style
checkpoint holds, quantized where the bytes are (the trainer's device), so that
an FP8 reader reads about half the bytes of the bf16 version.

The rule (``quantized``): a tensor is quantized when its name ends in
``.weight``, it is 2-D and floating point, and it is not one of those a
block-FP8 checkpoint keeps as it is (``KEPT``: the token embeddings, lm_head
and a MoE layer's router, ``mlp.gate``, as DeepSeek-V3 and Kimi-K2 ship them):
the linear layers. It becomes ``<name>`` in
float8_e4m3fn [N, K] plus ``<name>_scale_inv`` in fp32 [ceil(N/128),
ceil(K/128)], the per-block dequantization multiplier. Every other tensor
(norms, biases, buffers) goes into the companion unchanged, so the companion is
a whole model.

The rounding is vLLM's ``per_block_cast_to_fp8`` (``vllm.utils.deep_gemm``),
written again here with torch alone so that the core package never imports
vLLM: per block, ``scale = max(amax, 1e-4) / 448`` in fp32, elements multiplied
by ``1 / scale`` in fp32, then cast (round to nearest even, saturating at 448 by
construction). tests/vllm/test_vllm_fp8_block.py holds it bit-equal to vLLM's.
verl's kernel (``448 / amax``) rounds some elements otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: vLLM's get_fp8_min_max() off ROCm
AMAX_FLOOR = 1e-4
# Name endings of 2-D weights a block-FP8 checkpoint keeps unquantized (DeepSeek-V3, Kimi-K2): an engine
# loading the companion as its checkpoint finds them in the dtype it expects ("mlp.gate_proj" is not "mlp.gate").
KEPT = ("embed_tokens.weight", "lm_head.weight", ".mlp.gate.weight")
_TAG = "@fp8"


def fp8_model(model: str) -> str:
    """The model name of ``model``'s FP8 companions (same version numbers)."""
    return model + _TAG


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """``weight_scale_inv``'s shape for an [N, K] weight."""
    n, k = shape
    return math.ceil(n / BLOCK[0]), math.ceil(k / BLOCK[1])


def quantized(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether the FP8 companion holds ``name`` in block FP8 (the module docstring's rule)."""
    return (name.endswith(".weight") and not name.endswith(KEPT) and len(shape) == 2 and dtype.is_floating_point
            and dtype != FP8)


def quantize_block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] (any N, K) as (float8_e4m3fn [N, K], fp32 scale_inv
    [ceil(N/128), ceil(K/128)]), on its device, rounded as vLLM's
    ``per_block_cast_to_fp8``: edge blocks are padded with zeros for their amax."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"block FP8 quantizes 2-D floating point weights, got {weight.dtype} {list(weight.shape)}")
    n, k = weight.shape
    bn, bk = BLOCK
    rows, cols = scale_shape((n, k))
    padded = torch.zeros((rows * bn, cols * bk), dtype=weight.dtype, device=weight.device)
    padded[:n, :k] = weight
    blocks = padded.view(rows, bn, cols, bk)
    scale = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(AMAX_FLOOR) / FP8_MAX
    # bf16 * fp32 computes in fp32, as vLLM's does; the same order of operations, the same bits
    scaled = (blocks * (1.0 / scale)).to(FP8)
    return scaled.view_as(padded)[:n, :k].contiguous(), scale.view(rows, cols)


def companion_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The FP8 companion of whole tensors: quantized ones as weight + scale, others as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: an FP8 companion is made of whole tensors, got {type(tensor).__name__} "
                            "(a sharded trainer gathers first: blocks of 128x128 cross shard edges)")
        if quantized(name, tuple(tensor.shape), tensor.dtype):
            if name + SCALE_SUFFIX in tensors:
                raise ValueError(f"{name}{SCALE_SUFFIX}: already given beside {name}: is this version FP8 already?")
            out[name], out[name + SCALE_SUFFIX] = quantize_block_fp8(tensor.detach())
        else:
            out[name] = tensor
    return out


def companion_specs(specs: list) -> list:
    """``(name, dtype, shape)`` specs of a bf16 version as its companion's (dtype names as torch spells them)."""
    out = []
    for name, dtype, shape in specs:
        if quantized(name, tuple(shape), getattr(torch, dtype)):
            out += [(name, "float8_e4m3fn", tuple(shape)), (name + SCALE_SUFFIX, "float32", scale_shape(tuple(shape)))]
        else:
            out.append((name, dtype, tuple(shape)))
    return out


def check_fp8_destination(into: Mapping[str, object]) -> None:
    """A reader's FP8 destination: every float8 tensor is 2-D and has its fp32
    scale beside it, of the block shape (else a weight lands with no way to
    dequantize it). Raises ValueError naming the tensor; called before any byte moves."""
    for name, entry in into.items():
        tensor = getattr(entry, "tensor", entry)
        full = tuple(getattr(entry, "full_shape", None) or getattr(tensor, "shape", ()))
        if getattr(tensor, "dtype", None) != FP8:
            continue
        if len(full) != 2:
            raise ValueError(f"{name}: asked in FP8 with shape {list(full)}: block FP8 holds 2-D weights only")
        scale = into.get(name + SCALE_SUFFIX)
        if scale is None:
            raise ValueError(f"{name}: asked in FP8 without {name + SCALE_SUFFIX} beside it (its dequantization scale)")
        scale_t = getattr(scale, "tensor", scale)
        scale_full = tuple(getattr(scale, "full_shape", None) or scale_t.shape)
        if scale_t.dtype != torch.float32 or scale_full != scale_shape(full):
            raise ValueError(f"{name + SCALE_SUFFIX}: expected float32 {list(scale_shape(full))}, "
                             f"got {scale_t.dtype} {list(scale_full)}")
