"""The block-FP8 companion (tensorhub.fp8, Hub.publish(fp8=True)): quantized
on the trainer, published beside the bf16 version as ``<model>@fp8``, pulled
by FP8 readers at about half the bytes, between real Hub processes over real
NIXL through a real server. That the torch quantization is vLLM's bit for bit
is tests/vllm/test_vllm_fp8_block.py (vLLM lives in its venv only)."""

from __future__ import annotations

import pytest
import torch

from tensorhub.fp8 import (
    FP8,
    SCALE_SUFFIX,
    check_fp8_destination,
    companion_specs,
    companion_tensors,
    quantize_block_fp8,
)
from tensorhub.testing import RemoteError

# odd shapes (edge blocks), a norm and a bias (kept as they are), a 1-D ".weight" (not quantized), and the
# 2-D weights a block-FP8 checkpoint keeps as they are (embeddings, lm_head, a MoE router)
SPECS = [("model.embed_tokens.weight", "bfloat16", (64, 200)), ("layers.0.qkv.weight", "bfloat16", (384, 200)),
         ("layers.0.o.weight", "bfloat16", (200, 130)), ("layers.0.o.bias", "bfloat16", (200,)),
         ("layers.0.norm.weight", "bfloat16", (200,)), ("layers.0.mlp.gate.weight", "bfloat16", (8, 200)),
         ("layers.0.mlp.up_proj.weight", "float32", (257, 200)), ("lm_head.weight", "bfloat16", (64, 200))]


def _nbytes(specs) -> int:
    return sum(torch.tensor([], dtype=getattr(torch, d)).element_size() * torch.Size(s).numel() for _, d, s in specs)


BF16_BYTES = _nbytes(SPECS)
FP8_BYTES = _nbytes(companion_specs(SPECS))


def test_the_weights_a_block_fp8_checkpoint_keeps_are_kept():
    kept = {name: dtype for name, dtype, _ in companion_specs(SPECS)}
    given = {name: dtype for name, dtype, _ in SPECS}
    for name in ("model.embed_tokens.weight", "lm_head.weight", "layers.0.mlp.gate.weight", "layers.0.norm.weight"):
        assert kept[name] == given[name] and name + SCALE_SUFFIX not in kept
    for name in ("layers.0.qkv.weight", "layers.0.o.weight", "layers.0.mlp.up_proj.weight"):
        assert kept[name] == "float8_e4m3fn" and kept[name + SCALE_SUFFIX] == "float32"


def test_quantization_rounds_per_block_and_keeps_the_rest():
    w = torch.randn(200, 300, dtype=torch.bfloat16) * 3
    w[:128, :128] = 0  # an all-zero block: the amax floor keeps its scale finite
    q, s = quantize_block_fp8(w)
    assert q.dtype == FP8 and q.shape == w.shape and s.dtype == torch.float32 and s.shape == (2, 3)
    assert torch.isfinite(s).all() and s[0, 0] == pytest.approx(1e-4 / 448)
    back = (q.float().view(200, 300) * s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300])
    assert torch.allclose(back, w.float(), rtol=0.07, atol=1e-3)  # e4m3: 3 mantissa bits; subnormals near 0
    out = companion_tensors({"a.weight": w, "a.bias": w[0], "n.weight": w[0]})
    assert list(out) == ["a.weight", "a.weight" + SCALE_SUFFIX, "a.bias", "n.weight"]
    assert out["a.bias"] is not None and out["n.weight"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="2-D"):
        quantize_block_fp8(w[0])


def test_a_bad_fp8_destination_is_refused_naming_the_tensor():
    q = torch.zeros(200, 300, dtype=FP8)
    check_fp8_destination({"a.weight": q, "a.weight_scale_inv": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="a.weight: asked in FP8 without a.weight_scale_inv"):
        check_fp8_destination({"a.weight": q})
    with pytest.raises(ValueError, match="2-D"):
        check_fp8_destination({"a.weight": torch.zeros(4, 5, 6, dtype=FP8)})
    with pytest.raises(ValueError, match=r"a.weight_scale_inv: expected float32 \[2, 3\]"):
        check_fp8_destination({"a.weight": q, "a.weight_scale_inv": torch.zeros(2, 2)})


def test_fp8_readers_read_half_the_bytes_and_bf16_readers_never_see_them(hubs):
    trainer, fp8_reader, bf16_reader = hubs("trainer"), hubs("fp8"), hubs("bf16")
    info = trainer.call("publish", model="m", version=1, specs=SPECS, seed=7, fp8=True)
    # the companion: e4m3 weights (1 byte), fp32 scales, the rest as is; counted by its publication
    assert info["fp8_bytes"] == FP8_BYTES < 0.55 * BF16_BYTES and info["quantize_s"] > 0
    got = fp8_reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=7, fp8=True)
    assert got["mismatched"] == [] and got["read_bytes"] == info["fp8_bytes"]  # bit-equal to companion_tensors
    plain = bf16_reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=7)
    assert plain["mismatched"] == [] and plain["read_bytes"] == BF16_BYTES
    assert bf16_reader.call("versions", model="m") == [1]
    # the companion goes with its version; a version published without one has none
    trainer.call("unpublish", model="m", version=1)
    trainer.call("publish", model="m", version=2, specs=SPECS, seed=8)
    for version in (1, 2):
        with pytest.raises(RemoteError, match="VersionNotFound"):
            fp8_reader.call("pull", model="m", version=version, specs=SPECS, fp8=True, timeout=3)
    assert fp8_reader.call("versions", model="m@fp8") == []


def test_bad_fp8_input_moves_nothing(hubs):
    trainer, reader = hubs("trainer"), hubs("reader")
    info = trainer.call("publish", model="m", version=1, specs=SPECS, seed=7, fp8=True)
    # a reader's destination asks a 3-D tensor in FP8, or a weight without its scale: refused before any read
    for specs, match in [([("x.weight", "float8_e4m3fn", (2, 3, 4))], "asked in FP8 with shape"),
                         ([("layers.0.o.weight", "float8_e4m3fn", (200, 130))], "without layers.0.o.weight_scale_inv")]:
        with pytest.raises(RemoteError, match=match):
            reader.call("pull", model="m", version=1, specs=specs, fp8=True)
    # a publisher's: a Shard (blocks cross shard edges), or a version that holds scales already
    with pytest.raises(TypeError, match="whole tensors"):
        from tensorhub.shard import Shard
        companion_tensors({"a.weight": Shard(torch.zeros(2, 4), (4, 4), rows=(0, 2))})
    with pytest.raises(ValueError, match="already given"):
        companion_tensors({"a.weight": torch.zeros(4, 4), "a.weight_scale_inv": torch.zeros(1, 1)})
    got = reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=7, fp8=True)
    assert got["mismatched"] == [] and got["read_bytes"] == info["fp8_bytes"]
