"""Block-FP8 quantization of bf16 weights (CPU, no engine): what
``tensorhub_vllm.fp8`` makes on the receiver must be, bit for bit, what vLLM's
own ``per_block_cast_to_fp8`` makes (a fresh block-FP8 engine runs it on every
layer), and so must the trainer's ``tensorhub.fp8`` (the FP8 companion on the
wire: torch alone, written independently of vLLM), so a change of vLLM's
rounding shows up here and not as a silent mismatch with a fresh engine."""

from __future__ import annotations

import math

import pytest
import torch

# odd shapes (not multiples of 128): partial edge blocks in both dimensions
SHAPES = [(1, 1), (127, 129), (130, 257), (300, 200)]


def bf16_weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Random bf16 with the blocks a real layer has and the edge cases of the
    math: an all-zero block (amax clamped at 1e-4), a block below the clamp,
    and an outlier that sets its block's scale."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.05
    w[:128, :128] = 0.0  # the first block (all of a 1x1 weight, until the outlier lands there)
    w[128:, 128:] *= 1e-4  # amax below 1e-4: the clamp, not the block, sets the scale
    w[0, -1] = 3.0  # outside the scaled-down blocks
    return w.to(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("shape", SHAPES)
def test_block_fp8_is_vllms_quantization_bit_for_bit(shape):
    from tensorhub_vllm.fp8 import quantize_block_fp8
    from vllm.utils.deep_gemm import per_block_cast_to_fp8  # vLLM's, not through our module

    from tensorhub.fp8 import quantize_block_fp8 as trainer_quantize

    w = bf16_weight(shape, seed=shape[0] * 1000 + shape[1])
    quantized, scale_inv = quantize_block_fp8(w)
    n, k = shape
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == (n, k)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (math.ceil(n / 128), math.ceil(k / 128))

    vllm_q, vllm_scale = per_block_cast_to_fp8(w, [128, 128])
    assert torch.equal(bits(quantized), bits(vllm_q))
    assert torch.equal(bits(scale_inv), bits(vllm_scale))
    ref_q, ref_scale = trainer_quantize(w)
    assert torch.equal(bits(quantized), bits(ref_q))
    assert torch.equal(bits(scale_inv), bits(ref_scale))

    # and it is a quantization of w: each element within half an e4m3 step (3 mantissa bits)
    # of its block's scaled value, the clamped blocks' tiny values rounding to 0 or their neighbours
    scale_per_element = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    dequantized = quantized.float() * scale_per_element
    assert torch.all((dequantized - w.float()).abs() <= w.float().abs() / 16 + scale_per_element * 2**-9)


def test_checkpoint_names_and_refusals():
    from tensorhub_vllm.fp8 import block_fp8_tensors

    w = bf16_weight((130, 257), seed=7)
    (name, quantized), (scale_name, scale_inv) = block_fp8_tensors("model.layers.0.mlp.down_proj.weight", w)
    assert name == "model.layers.0.mlp.down_proj.weight" and quantized.dtype == torch.float8_e4m3fn
    assert scale_name == "model.layers.0.mlp.down_proj.weight_scale_inv" and scale_inv.shape == (2, 3)
    with pytest.raises(ValueError, match="only a layer's .weight"):
        block_fp8_tensors("model.layers.0.mlp.down_proj.bias", w)
    with pytest.raises(ValueError, match="2-D floating point"):
        block_fp8_tensors("model.norm.weight", w[0])


@pytest.mark.parametrize("shape", [(1, 300), (129, 1), (255, 383), (384, 130)])
@pytest.mark.parametrize("spread", [1e-3, 1.0, 300.0])
def test_the_trainers_companion_is_vllms_quantization_on_random_bf16(shape, spread):
    """``tensorhub.fp8`` (what ``Hub.publish(fp8=True)`` sends) against vLLM's
    function on random bf16 of odd shapes and magnitudes, with the names a checkpoint has."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from tensorhub.fp8 import companion_tensors

    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    w = (torch.randn(shape, generator=gen) * spread).to(torch.bfloat16)
    companion = companion_tensors({"layers.0.proj.weight": w, "layers.0.proj.bias": w[0]})
    vllm_q, vllm_scale = per_block_cast_to_fp8(w, [128, 128])
    assert torch.equal(bits(companion["layers.0.proj.weight"]), bits(vllm_q))
    assert torch.equal(bits(companion["layers.0.proj.weight_scale_inv"]), bits(vllm_scale))
    assert companion["layers.0.proj.bias"] is not None and companion["layers.0.proj.bias"].dtype == torch.bfloat16
