"""Seeded tensors and the ways they are split: what a ``HubProcess`` publishes
and checks a pull against, from nothing but a list of specs and a seed, so that
no second copy of the bytes travels between processes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tensorhub.manifest import DTYPES
from tensorhub.regions import Region
from tensorhub.shard import Shard

Spec = tuple[str, str, tuple[int, ...]]  # name, dtype name, shape


def mixed_specs(count: int = 210, *, largest_bytes: int = 64 << 20) -> list[Spec]:
    """``count`` tensors of mixed dtypes, from one element up to ``largest_bytes``."""
    dtypes = ["float32", "bfloat16", "float16", "int64"]
    specs: list[Spec] = [("scalar", "float32", ()), ("one", "int64", (1,)), ("largest", "float32", (largest_bytes // 4,))]
    i = 0
    while len(specs) < count:
        dtype = dtypes[i % len(dtypes)]
        rows = 1 + (i * 37) % 97
        cols = 1 + (i * 13) % 129
        specs.append((f"layers.{i}.{dtype}", dtype, (rows, cols) if i % 3 else (rows * cols,)))
        i += 1
    return specs


def make_tensors(specs: Sequence[Spec], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic contents that differ per seed."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in specs:
        dt = DTYPES[dtype]
        if dt.is_floating_point:
            out[name] = torch.randn(shape, generator=gen, dtype=torch.float32).to(dt)
        else:
            out[name] = torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=torch.int64).to(dt)
    return out


def stepped_tensors(specs: Sequence[Spec], seed: int, step: int, changed: float) -> dict[str, torch.Tensor]:
    """Version ``step`` of a model that starts as ``make_tensors(specs, seed)``:
    each step changes about ``changed`` of every tensor's elements (a delta's
    test payload; ``tensorhub.bench.sparsity`` makes versions from real optimizer steps)."""
    out = make_tensors(specs, seed)
    for s in range(1, step + 1):
        gen = torch.Generator().manual_seed(seed * 7919 + s)
        for t in out.values():
            mask = torch.rand(t.shape, generator=gen) < changed
            if t.dtype.is_floating_point:
                t[mask] = (t[mask].float() + s).to(t.dtype)
            else:
                t[mask] += s
    return out


def empty_like_specs(specs: Sequence[Spec]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape, dtype=DTYPES[dtype]) for name, dtype, shape in specs}


# --------------------------------------------------------------------- shard layouts


def cuts(n: int, world: int, *, uneven: bool = True) -> list[int]:
    """Boundaries splitting ``n`` over ``world`` ranks; uneven by default (rank i
    gets a growing share, e.g. 1000 over 4: 142, 215, 285, 358); may be empty."""
    if not uneven:
        return [n * i // world for i in range(world + 1)]
    return [n * i * (i + 3) // (world * (world + 3)) for i in range(world + 1)]


def shard_region(shape: tuple[int, ...], how: str, rank: int, world: int) -> Region | None:
    """Rank ``rank``'s part of a tensor split ``how`` ("rows", "cols", "flat" or
    "whole" = replicated); None where the split leaves it nothing."""
    if how == "whole" or not shape:
        return Region() if how == "whole" or rank == 0 else None
    if how == "cols" and len(shape) < 2:
        how = "rows"
    size = {"rows": shape[0], "cols": shape[1] if how == "cols" else 0, "flat": int(torch.Size(shape).numel())}[how]
    a, b = cuts(size, world)[rank: rank + 2]
    if a == b:
        return None
    return Region.of(shape, **{how: (a, b)})


def read_region(shape: tuple[int, ...], index: int, read: str, rank: int, world: int) -> Region:
    """What a reader asks of tensor number ``index``: "whole", "flat" (an even
    flat slice), or "tp" (tensor parallel: rows of even-numbered tensors, columns
    of odd-numbered ones, even splits; whole where a split leaves nothing)."""
    if read == "whole" or not shape:
        return Region()
    how = "flat" if read == "flat" else ("cols" if index % 2 and len(shape) >= 2 else "rows")
    size = {"rows": shape[0], "cols": shape[1] if how == "cols" else 0, "flat": int(torch.Size(shape).numel())}[how]
    a, b = cuts(size, world, uneven=False)[rank: rank + 2]
    return Region.of(shape, **{how: (a, b)}) if a < b else Region()


def take(full: torch.Tensor, region: Region) -> torch.Tensor:
    """The elements of ``region`` of ``full``, as a new contiguous tensor."""
    return Shard.of(full, box=region.box, flat=region.flat).tensor.clone()
