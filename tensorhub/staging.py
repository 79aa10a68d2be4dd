"""Staging memory for a pull as views of one buffer, so that NIXL registers
one region (one storage) per buffer, not one per tensor or box.

    views = one_buffer([(name, dtype, box or None, shape of the box or tensor), ...], device)
    # {name: tensor} where box is None, {name: [Shard, ...]} (one per box) otherwise
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tensorhub.regions import Bounds
from tensorhub.shard import Shard

ALIGN = 64  # bytes: where each piece starts (any dtype's view is aligned; a cache line)

# (tensor name, dtype, box of the full tensor or None for all of it, the piece's shape)
Piece = tuple[str, torch.dtype, Bounds | None, Sequence[int]]


def one_buffer(pieces: Sequence[Piece], full_shapes: dict[str, tuple[int, ...]],
               device: torch.device | str = "cpu") -> dict[str, torch.Tensor | list[Shard]]:
    """Views of one new buffer, a piece each, in order: a tensor where the
    piece is whole, else a ``Shard`` of ``full_shapes[name]`` (several boxes
    of one name make a list)."""
    sizes = [-(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN for _, dtype, _, shape in pieces]
    buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    out: dict[str, torch.Tensor | list[Shard]] = {}
    offset = 0
    for (name, dtype, box, shape), size in zip(pieces, sizes):
        tensor = buffer[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(list(shape))
        offset += size
        if box is None:
            out[name] = tensor
        else:
            out.setdefault(name, []).append(Shard(tensor, full_shapes[name], box=box))
    return out
