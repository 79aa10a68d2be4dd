"""A tiny Qwen2-style model, a tiny Qwen3-MoE and a byte-level BPE tokenizer, built at test time
(no model hub is reachable from tests). Deterministic: the same seed gives the
same weights, so a reference output can be compared token for token."""

from __future__ import annotations

from pathlib import Path

VOCAB = 512


def _tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "weights move from trainers to rollout engines",
        "tensorhub pulls versions straight out of memory",
    ] * 50
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(path)
    return fast


def _save(model, path: Path) -> Path:
    import torch

    # A wider init than the default, so greedy decoding is far from ties and a
    # perturbation visibly changes the output.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def build(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fast = _tokenizer(path)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, torch_dtype="bfloat16",
        eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id,
    )
    return _save(Qwen2ForCausalLM(config), path)


# vLLM's CPU MoE kernel needs the hidden size and the per-TP-rank expert
# intermediate size divisible by 32: 64 / TP=2 = 32.
MOE_EXPERTS, MOE_INTERMEDIATE = 8, 64


def build_moe(path: Path, seed: int = 0) -> Path:
    """A Qwen3-MoE of 2 layers, 8 experts (top-2); saved as transformers 5 saves
    it, with per-expert checkpoint names (``mlp.experts.{e}.gate_proj.weight``)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fast = _tokenizer(path)
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=MOE_INTERMEDIATE,
        num_experts=MOE_EXPERTS, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="bfloat16",
        eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id,
    )
    return _save(Qwen3MoeForCausalLM(config), path)


def build_mixtral(path: Path, seed: int = 0) -> Path:
    """A Mixtral of 2 layers, 8 experts (top-2): its checkpoint names experts
    ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``, its transformers-5 model
    holds them fused as ``mlp.experts.gate_up_proj`` / ``down_proj``."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    fast = _tokenizer(path)
    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=MOE_INTERMEDIATE, num_local_experts=MOE_EXPERTS,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="bfloat16",
        eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id,
    )
    return _save(MixtralForCausalLM(config), path)


def fused_copy(model_dir: Path, path: Path) -> Path:
    """``model_dir`` with its checkpoint saved fused, as the transformers-5 model
    holds it (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]):
    what a trainer's own ``save_file(model.state_dict())`` writes. vLLM's
    Qwen3-MoE loads either form."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_dir, path, dirs_exist_ok=True)
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).state_dict()
    save_file({n: t.contiguous() for n, t in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
