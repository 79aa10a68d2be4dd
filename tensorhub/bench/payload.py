"""Benchmark and demo payloads: a flat buffer cut into tensors shaped like a
transformer's state dict (large matrices, small norms and biases)."""

from __future__ import annotations

import re

import torch

from tensorhub.regions import Region

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30,
          "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'1GiB', '256MiB', '4096' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r} is not a number with an optional unit (KiB, MiB, GiB, KB, MB, GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def layout(total_bytes: int, *, layer_bytes: int = 48 << 20) -> list[tuple[str, int]]:
    """Names and byte sizes of a state-dict-like split of ``total_bytes``.

    Per layer: 4 attention matrices, 3 MLP matrices, 2 norms, 3 biases. Matrix
    sizes are multiples of 8 KiB (rows of 4096 bf16 elements, see ``shaped``)
    but for the last of a layer, which takes the rounding's rest; the rest are
    multiples of 64 bytes, so every tensor can be a dtype view of the buffer.
    """
    parts = [("self_attn.q_proj.weight", 8), ("self_attn.k_proj.weight", 2), ("self_attn.v_proj.weight", 2),
             ("self_attn.o_proj.weight", 8), ("mlp.gate_proj.weight", 16), ("mlp.up_proj.weight", 16),
             ("mlp.down_proj.weight", 16)]
    small = [("input_layernorm.weight", 4096), ("post_attention_layernorm.weight", 4096),
             ("self_attn.q_proj.bias", 4096), ("self_attn.k_proj.bias", 1024), ("self_attn.v_proj.bias", 1024)]
    units = sum(w for _, w in parts)
    out: list[tuple[str, int]] = []
    left, layer = total_bytes, 0
    while left > 0:
        budget = min(layer_bytes, left)
        for name, nbytes in small:
            if left >= nbytes and budget > sum(n for _, n in small):
                out.append((f"layers.{layer}.{name}", nbytes))
                left -= nbytes
                budget -= nbytes
        spent = 0
        for i, (name, weight) in enumerate(parts):
            # The layer's last matrix takes what rounding left over, so no crumbs remain.
            share = budget - spent if i == len(parts) - 1 else budget * weight // units // 8192 * 8192
            nbytes = min(left, max(64, share))
            if nbytes <= 0:
                break
            out.append((f"layers.{layer}.{name}", nbytes))
            left -= nbytes
            spent += nbytes
        layer += 1
    return out


def views(flat: torch.Tensor, sizes: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
    """Tensors that alias ``flat`` (uint8), one per (name, nbytes): bf16 matrices,
    fp32 norms, raw bytes for a tail that is not a multiple of 4."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, nbytes in sizes:
        piece = flat[offset: offset + nbytes]
        if nbytes % 4 == 0 and "norm" in name:
            piece = piece.view(torch.float32)
        elif nbytes % 2 == 0:
            piece = piece.view(torch.bfloat16)
        out[name] = piece
        offset += nbytes
    return out


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    """Deterministic bytes that differ per seed (version), cheap to make and check."""
    words = torch.arange(seed * 1_000_003, seed * 1_000_003 + -(-nbytes // 8), dtype=torch.int64)
    return words.view(torch.uint8)[:nbytes]


_MATRIX = ("proj.weight",)


def shaped(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same views with weight matrices as 2-D [rows, cols] (cols the largest
    power of two up to 4096 that divides them), so they can be split by rows or
    columns like a model's; norms, biases and odd tails stay 1-D."""
    out = {}
    for name, t in tensors.items():
        cols = next((c for c in (4096, 2048, 1024, 512, 256, 128, 64, 32) if t.numel() % c == 0), 0)
        out[name] = t.view(-1, cols) if name.endswith(_MATRIX) and t.dtype == torch.bfloat16 and cols else t
    return out


def tp_region(shape: tuple[int, ...], index: int, rank: int, world: int) -> Region:
    """Tensor-parallel rank ``rank`` of ``world``: rows of even-numbered matrices,
    columns of odd-numbered ones (as column- and row-parallel layers split them);
    1-D tensors whole (replicated)."""
    if len(shape) < 2:
        return Region()
    dim = index % 2
    size = shape[dim]
    a, b = size * rank // world, size * (rank + 1) // world
    return Region.of(shape, **{("rows", "cols")[dim]: (a, b)})


def row_region(shape: tuple[int, ...], rank: int, world: int) -> Region | None:
    """Trainer rank ``rank`` of ``world``: its rows (flat range for 1-D tensors); None if empty."""
    size = shape[0] if len(shape) >= 2 else (shape[0] if shape else 1)
    a, b = size * rank // world, size * (rank + 1) // world
    if a == b:
        return None
    return Region.of(shape, rows=(a, b)) if len(shape) >= 2 else Region(flat=(a, b))
