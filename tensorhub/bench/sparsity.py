"""Honest consecutive weight versions, from real optimizer steps, for the
delta-versions benchmark.

What: a small decoder-only transformer (``TinyLM``) sized to a byte budget,
trained for a few AdamW steps on a synthetic next-token task whose gradients
are real; each step's fp32 master weights are cast to bf16 and kept, so the
benchmark sends the versions a trainer would publish, not synthetic masks.

Why: Fireworks report that between consecutive RL steps more than 98% of the
bf16 weights are bit-identical, which is what makes sending only the changed
elements pay. The reason is the step size against the bf16 grid. AdamW's
first step moves every weight by about ``lr`` in magnitude, whatever its
gradient (the update is ``lr * m / sqrt(v)``, and after bias correction
``m / sqrt(v)`` is the gradient's sign); later steps move it by less, as
``|m| / sqrt(v)`` falls below 1 where gradients disagree from step to step.
bf16 keeps 8 significant bits, so a weight ``w`` lies on a grid whose spacing
(its ulp) is between ``|w| * 2**-8`` and ``|w| * 2**-7``; the fp32 master
moves, and its bf16 cast changes only when the master crosses a rounding
boundary, half an ulp from a grid point. So whether a bf16 weight changes
depends on its magnitude against its ulp: a step of ``lr`` changes it for
certain where ``lr`` exceeds half its ulp (``|w|`` below about ``256 * lr``),
and otherwise with a chance of about ``lr / ulp`` (the master sits anywhere
in its cell). With weights drawn at std 0.02, 64 MiB of them measured: the
first step changes 4.2% at ``lr = 1e-6`` and 25% at ``1e-5``, the third step
2.3% and 15%. Norm weights (1.0, ulp 2**-7) do not move at such rates, and
embedding rows of tokens absent from a step's batch get no gradient, as in
a real trainer.

How the fraction is measured: ``changed_fraction`` compares the tensors'
bits, through an integer view of their element size (``int16`` for bf16), so
-0.0 against 0.0 counts as a change and NaNs compare as their bits; it is the
number of differing elements over all tensors divided by the number of
elements. ``changed_by_tensor`` gives the same per tensor.

Versions go to disk with ``save_versions``/``load_versions`` (``torch.save``,
``torch.load(weights_only=True)``), so a benchmark's child processes read the
very same versions. Pure torch, on the CPU.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 512
"""The synthetic task's vocabulary: large enough to be a language-model head,
small enough that the blocks hold nearly all the bytes."""

INIT_STD = 0.02
"""Normal init of every matrix and embedding (GPT-2's), which sets where the
weights sit against the bf16 grid and so how many of them a step changes."""

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, h))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyLM(nn.Module):
    """Decoder-only transformer: token embedding plus fixed sinusoidal
    positions, ``layers`` pre-norm blocks of causal self-attention and a GELU
    MLP, a final RMSNorm and an untied lm head; no biases, no buffers, so the
    state dict is exactly the parameters. Matrices and the embedding are drawn
    from N(0, INIT_STD) by a generator seeded with ``seed``, norms start at 1."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, ffn: int, *, seed: int = 0):
        super().__init__()
        if hidden % heads or hidden % 2:
            raise ValueError(f"hidden {hidden} must be even and a multiple of heads {heads}")
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    nn.init.normal_(p, 0.0, INIT_STD, generator=gen)

    @staticmethod
    def count(vocab: int, hidden: int, layers: int, ffn: int) -> int:
        """Parameters of ``TinyLM(vocab, hidden, layers, _, ffn)``, without building it."""
        per_layer = 4 * hidden * hidden + 2 * hidden * ffn + 2 * hidden
        return 2 * vocab * hidden + layers * per_layer + hidden

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> next-token logits (batch, seq, vocab)."""
        t, h = tokens.shape[1], self.embed.embedding_dim
        pos = torch.arange(t, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, h, 2, dtype=torch.float32) * (-math.log(10000.0) / h))
        # Positions at the embedding's scale, so neither swamps the other at init.
        pe = torch.stack((torch.sin(pos * freq), torch.cos(pos * freq)), dim=-1).view(t, h) * INIT_STD
        x = self.embed(tokens) + pe
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def shape_for_bytes(target_bytes: int, *, vocab: int = VOCAB) -> dict[str, int]:
    """TinyLM's arguments whose bf16 parameters come closest to ``target_bytes``.

    Heads are 64 wide, so ``hidden`` is a multiple of 64; ``ffn`` (a multiple of
    64, between 2x and 6x ``hidden``) takes up the rounding. Among near fits the
    one whose width is closest to 64 per layer wins (64 MiB -> 8 layers of 512
    with ffn 3008, about 33.6M parameters)."""
    want = max(target_bytes, 1) / 2
    best: tuple[float, dict[str, int]] | None = None
    for layers in range(1, 33):
        for hidden in range(64, 4097, 64):
            rest = want - TinyLM.count(vocab, hidden, layers, 0)
            ffn = min(6 * hidden, max(2 * hidden, round(rest / (2 * hidden * layers) / 64) * 64))
            n = TinyLM.count(vocab, hidden, layers, ffn)
            score = abs(math.log(n / want)) + 0.05 * abs(math.log(hidden / (64 * layers)))
            if best is None or score < best[0]:
                best = (score, {"vocab": vocab, "hidden": hidden, "layers": layers, "heads": hidden // 64, "ffn": ffn})
    assert best is not None
    return best[1]


def _copy_task(gen: torch.Generator, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """(batch, seq + 1) tokens: a random first half, then the same tokens again,
    so the second half is predictable (an induction task) and the loss real."""
    half = torch.randint(vocab, (batch, (seq + 2) // 2), generator=gen)
    return torch.cat((half, half), dim=1)[:, : seq + 1]


def _bf16(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().to(torch.bfloat16).contiguous().clone() for name, t in model.state_dict().items()}


def trained_versions(*, target_bytes: int, lr: float, steps: int, seed: int = 0, batch: int = 4,
                     seq: int = 64) -> list[dict[str, torch.Tensor]]:
    """``steps + 1`` bf16 state dicts of a TinyLM of about ``target_bytes``:
    version 0 is the initial weights, version k the fp32 master weights after
    AdamW step k (betas 0.9/0.999, weight decay 0.01), each cast to bf16.
    Every step trains on a fresh batch of the copy task; the same arguments
    give the same versions (on the same thread count)."""
    torch.manual_seed(seed)
    shape = shape_for_bytes(target_bytes)
    model = TinyLM(**shape, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed + 1)
    versions = [_bf16(model)]
    for _ in range(steps):
        tokens = _copy_task(gen, batch, seq, shape["vocab"])
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, shape["vocab"]), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        versions.append(_bf16(model))
    return versions


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _changes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> Iterator[tuple[str, int, int]]:
    """(name, elements whose bits differ, elements) per tensor."""
    if old.keys() != new.keys():
        raise ValueError(f"the versions name different tensors: {sorted(old.keys() ^ new.keys())[:5]}")
    for name, a in old.items():
        b = new[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"{name}: {a.dtype}{list(a.shape)} against {b.dtype}{list(b.shape)}")
        if a.element_size() not in _INT_OF_SIZE:
            raise ValueError(f"{name}: no integer view for {a.dtype} ({a.element_size()} bytes an element)")
        as_int = _INT_OF_SIZE[a.element_size()]
        yield name, int((a.view(as_int) != b.view(as_int)).sum()), a.numel()


def changed_by_tensor(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor, the fraction of its elements whose bits differ (0.0 for an empty one)."""
    return {name: changed / n if n else 0.0 for name, changed, n in _changes(old, new)}


def changed_fraction(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    """The fraction of all elements, over all tensors, whose bits differ."""
    counts = [(changed, n) for _, changed, n in _changes(old, new)]
    total = sum(n for _, n in counts)
    return sum(c for c, _ in counts) / total if total else 0.0


def save_versions(path: str | os.PathLike, versions: list[dict[str, torch.Tensor]]) -> None:
    torch.save(versions, path)


def load_versions(path: str | os.PathLike) -> list[dict[str, torch.Tensor]]:
    return torch.load(path, weights_only=True, map_location="cpu")
