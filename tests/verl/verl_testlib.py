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


def save_tiny_model(path: str) -> str:
    """A tiny Qwen2 causal LM with a byte-level BPE tokenizer, saved as a
    Hugging Face checkpoint (no model hub is reachable from the tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the trainer publishes weights, the rollouts pull them"] * 8, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(path)
    config = Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path
