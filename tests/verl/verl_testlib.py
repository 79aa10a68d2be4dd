"""Helpers shared by the verl tests: weights that differ per step, and byte-exact checks."""

from __future__ import annotations

import asyncio

import torch


def make_weights(step: int) -> dict[str, torch.Tensor]:
    """A small model's worth of tensors of mixed dtypes, different per step."""
    g = torch.Generator().manual_seed(step)
    return {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layers.0.attn.qkv.weight": torch.randn(96, 32, generator=g),
        "layers.0.attn.qkv.bias": torch.randn(96, generator=g).to(torch.float16),
        "layers.0.mlp.weight": torch.randn(128, 32, generator=g).to(torch.bfloat16),
        "norm.step": torch.tensor([step], dtype=torch.int64),
    }


def receive(engine, step):
    """Everything ``receive_weights`` yields, cloned (as verl's adapters copy)."""
    async def collect():
        return [(name, t.clone()) async for name, t in engine.receive_weights(step)]
    return asyncio.run(collect())


def assert_identical(received: list[tuple[str, torch.Tensor]], expected: dict[str, torch.Tensor]) -> None:
    assert [name for name, _ in received] == list(expected)
    for name, tensor in received:
        want = expected[name]
        assert (tensor.dtype, tensor.shape) == (want.dtype, want.shape), name
        assert torch.equal(tensor.view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)), name
