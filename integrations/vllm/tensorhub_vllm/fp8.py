"""Block-FP8 weights from bf16 ones, as a DeepSeek-V3 / Kimi-K2 style
checkpoint holds them: ``weight`` in float8_e4m3fn and, per 128x128 block, an
fp32 ``weight_scale_inv`` (the dequantization multiplier) of shape
``[ceil(N/128), ceil(K/128)]`` for an ``[N, K]`` weight.

The quantization is vLLM's own (``vllm_internals.per_block_cast_to_fp8``): a
block's scale is ``max(amax, 1e-4) / 448`` and its elements are multiplied by
the scale's reciprocal before the cast. Other kernels (verl's ``448 / amax``)
round some elements differently, so only this one reproduces, bit for bit, the
bytes a fresh block-FP8 engine quantizes from the same bf16 weights.
The trainer's ``tensorhub.fp8`` (the FP8 companion on the wire) is the same
math in torch alone; tests/vllm/test_vllm_fp8_block.py holds the two equal.
"""

from __future__ import annotations

import torch

from tensorhub.fp8 import BLOCK, SCALE_SUFFIX, scale_shape
from tensorhub_vllm.vllm_internals import per_block_cast_to_fp8


def quantize_block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] (bf16, any N and K) as (float8_e4m3fn [N, K],
    float32 ``weight_scale_inv`` [ceil(N/128), ceil(K/128)]), on its device.
    Edge blocks are padded with zeros for their amax only, as vLLM pads them."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"block FP8 quantizes 2-D floating point weights, got {weight.dtype} {list(weight.shape)}")
    quantized, scale_inv = per_block_cast_to_fp8(weight, list(BLOCK))
    n, k = weight.shape
    expected = scale_shape((n, k))
    # the layout the checkpoint loaders expect; vLLM's function is not promised to keep it
    assert quantized.dtype == torch.float8_e4m3fn and tuple(quantized.shape) == (n, k), quantized.shape
    assert scale_inv.dtype == torch.float32 and tuple(scale_inv.shape) == expected, scale_inv.shape
    return quantized, scale_inv


def block_fp8_tensors(name: str, weight: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors for one bf16 ``<prefix>.weight``:
    ``[(<prefix>.weight, e4m3), (<prefix>.weight_scale_inv, fp32)]``."""
    if not name.endswith(".weight"):
        raise ValueError(f"{name}: only a layer's .weight is block-quantized")
    quantized, scale_inv = quantize_block_fp8(weight)
    return [(name, quantized), (name + SCALE_SUFFIX, scale_inv)]
