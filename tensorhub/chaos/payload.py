"""What the campaign publishes, and the check every reader runs on what it got.

Every byte of version ``v`` is a function of ``(seed, v, tensor, element)``, so
any process can check a pull without a second copy travelling anywhere: the
trainer rank makes its rows of the full tensors, a reader recomputes the
expected tensors and compares bytes. Versions differ in every element, so a
pull that mixed two versions, read a stale holder or landed garbage shows up
as a mismatch."""

from __future__ import annotations

import torch

from tensorhub.manifest import Manifest
from tensorhub.shard import Shard

# name, dtype, (rows, cols): 2-D tensors are split by rows over the trainer ranks;
# "norm" is held whole by every rank (overlapping regions: a replicated tensor).
_LAYOUT = (("embed", torch.int32, (1024, 1024)), ("proj", torch.bfloat16, (1024, 1536)),
           ("head", torch.float32, (256, 1024)), ("norm", torch.float32, (1024,)))
REPLICATED = ("norm",)


def _bits(n: int, salt: int) -> torch.Tensor:
    """``n`` pseudo-random 32-bit words depending on ``salt`` (a multiplicative
    hash of the index: cheap, and every index and salt gives other bits)."""
    x = torch.arange(n, dtype=torch.int64) + salt * 0x9E3779B1
    x = (x * 0x85EBCA77) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE3D) & 0xFFFFFFFF
    return (x - (1 << 31)).to(torch.int32)  # centred so that it fits int32


def full_tensors(version: int, seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The whole model of ``version``: every byte derived from (seed, version, tensor, element).
    ``scale`` shrinks the row count (tests use small versions)."""
    out: dict[str, torch.Tensor] = {}
    for i, (name, dtype, shape) in enumerate(_LAYOUT):
        shape = (max(2, int(shape[0] * scale)), *shape[1:])
        numel = int(torch.Size(shape).numel())
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        words = _bits(-(-nbytes // 4), (seed * 1_000_003 + version) * 31 + i)
        out[name] = words.view(torch.uint8)[:nbytes].view(dtype).reshape(shape).clone()
    return out


def rank_shards(version: int, seed: int, rank: int, world: int, scale: float = 1.0
                ) -> tuple[dict[str, Shard], Manifest]:
    """Trainer rank ``rank``'s regions of ``version`` (its rows of each matrix, the
    replicated tensors whole), as its own contiguous tensors, and the manifest
    of the whole model."""
    full = full_tensors(version, seed, scale)
    shards: dict[str, Shard] = {}
    for name, tensor in full.items():
        if name in REPLICATED:
            shards[name] = Shard(tensor, tuple(tensor.shape))
            continue
        rows = tensor.shape[0]
        a, b = rows * rank // world, rows * (rank + 1) // world
        shards[name] = Shard(tensor[a:b].clone(), tuple(tensor.shape), rows=(a, b))
    return shards, Manifest.of(full)


def nbytes(scale: float = 1.0) -> int:
    return sum(t.numel() * t.element_size() for t in full_tensors(0, 0, scale).values())


def mismatched(tensors: dict[str, torch.Tensor], version: int, seed: int, scale: float = 1.0) -> list[str]:
    """Names of the tensors whose bytes are not ``version``'s (missing ones too)."""
    expected = full_tensors(version, seed, scale)
    bad = []
    for name, want in expected.items():
        got = tensors.get(name)
        if got is None or got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape) or \
                not torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8)):
            bad.append(name)
    return bad
