"""Mixture-of-Experts weights under their two names, as boxes of one memory.

Checkpoints, and so vLLM's loaders and an engine's read set, name each
expert's weights apart:

    <layer>.mlp.experts.{e}.gate_proj.weight  [I, H]     Mixtral: <layer>.block_sparse_moe.experts.{e}.w1.weight
    <layer>.mlp.experts.{e}.up_proj.weight    [I, H]                                                 .w3.weight
    <layer>.mlp.experts.{e}.down_proj.weight  [H, I]                                                 .w2.weight

transformers 5 models hold them fused, and so does a trainer that publishes
its ``state_dict()`` or ``named_parameters()`` (FSDP2 shards them ``Shard(0)``,
whole experts per rank):

    <layer>.mlp.experts.gate_up_proj  [E, 2I, H]   (gate rows first, then up)
    <layer>.mlp.experts.down_proj     [E, H, I]

Expert e's gate is the box ``[e:e+1, 0:I, 0:H]`` of ``gate_up_proj``, its up
``[e:e+1, I:2I, 0:H]``, its down ``[e:e+1, 0:H, 0:I]`` of ``down_proj``. A box
(or flat range) of a per-expert tensor is therefore a box (flat range) of the
fused tensor with the same elements in the same order: a destination laid out
for the per-expert tensors is a destination for the fused version as it is.
``onto(into, manifest)`` renames it so; no byte is gathered or copied on
either side, and the reader's staging, served as a replica, holds those boxes
of the fused tensors for the next reader.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from tensorhub.manifest import Manifest
from tensorhub.shard import Entry, Shard

# <layer>.<block>.experts.<e>.<projection>.weight; <block> is "mlp" (Qwen2/3-MoE,
# DeepSeek, GLM, ...) or "block_sparse_moe" (Mixtral's checkpoints; its transformers-5
# model names the block "mlp").
PER_EXPERT = re.compile(r"^(?P<layer>.+)\.(?P<block>mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
                        r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_GATE, _UP, _DOWN = ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")
# Renamed by transformers 5 on load (Mixtral's router: block_sparse_moe.gate -> mlp.gate)
_RENAMES = ((".block_sparse_moe.", ".mlp."),)

CONVENTIONS = ("per-expert '<layer>.mlp.experts.{e}.gate_proj/up_proj/down_proj.weight' (Mixtral: "
               "'<layer>.block_sparse_moe.experts.{e}.w1/w3/w2.weight'), or fused transformers-5 "
               "'<layer>.mlp.experts.gate_up_proj' [E, 2I, H] and '<layer>.mlp.experts.down_proj' [E, H, I]")


def fused_home(name: str, shape: tuple[int, ...], shapes: Mapping[str, tuple[int, ...]]
               ) -> tuple[str, int, int] | None:
    """Where per-expert tensor ``name`` of ``shape`` lies in a fused tensor of
    ``shapes``: (fused name, expert, first row in the fused tensor's dim 1), or None."""
    m = PER_EXPERT.match(name)
    if m is None or len(shape) != 2:
        return None
    e, proj = int(m["e"]), m["proj"]
    fused = "down_proj" if proj in _DOWN else "gate_up_proj"
    for block in dict.fromkeys((m["block"], "mlp")):
        home = f"{m['layer']}.{block}.experts.{fused}"
        full = shapes.get(home)
        if full is None or len(full) != 3 or e >= full[0]:
            continue
        if proj in _DOWN and tuple(full[1:]) == tuple(shape):
            return home, e, 0
        if proj not in _DOWN and full[1] == 2 * shape[0] and full[2] == shape[1]:
            return home, e, 0 if proj in _GATE else shape[0]
    return None


def _moved(shard: Shard, home: str, full: tuple[int, ...], e: int, row: int) -> Shard:
    """``shard`` of a per-expert tensor as the same memory's shard of the fused one."""
    if shard.region.flat is not None:
        a, b = shard.region.flat
        first = (e * full[1] + row) * full[2]
        return Shard(shard.tensor, full, flat=(first + a, first + b))
    (r0, r1), (c0, c1) = shard.region.bounds(shard.full_shape)
    return Shard(shard.tensor, full, box=((e, e + 1), (row + r0, row + r1), (c0, c1)))


def _renamed(name: str, shape: tuple[int, ...], shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    for old, new in _RENAMES:
        other = name.replace(old, new)
        if other != name and shapes.get(other) == shape:
            return other
    return None


def onto(into: Mapping[str, Entry], manifest: Manifest) -> dict[str, Entry]:
    """``into`` (names of a checkpoint) for a version whose manifest may hold
    the experts fused: each per-expert entry the manifest lacks but holds fused
    becomes shards of the fused tensor over the same memory, and a name
    transformers 5 renames (Mixtral's ``block_sparse_moe.gate``) takes the
    manifest's name. Everything else is
    left as it is, so a name that matches neither convention still gets the
    manifest check's listing."""
    shapes = {t.name: tuple(t.shape) for t in manifest.tensors}
    out: dict[str, Entry] = {}
    fused: dict[str, list[Shard]] = {}
    for name, entry in into.items():
        shards = [entry] if isinstance(entry, (Shard, torch.Tensor)) else list(entry)
        full = tuple(shards[0].full_shape if isinstance(shards[0], Shard) else shards[0].shape)
        renamed = None if name in shapes else _renamed(name, full, shapes)
        if renamed is not None:
            out[renamed] = entry
            continue
        home = None if name in shapes else fused_home(name, full, shapes)
        if home is None:
            out[name] = entry
            continue
        fused_name, e, row = home
        for s in shards:
            whole = s if isinstance(s, Shard) else Shard(s, full)
            fused.setdefault(fused_name, []).append(_moved(whole, fused_name, shapes[fused_name], e, row))
    return {**out, **fused}


def mismatch_hint(names: list[str], manifest: Manifest) -> str | None:
    """A sentence for a ManifestMismatch where one side names experts and the
    other side does not match it: both conventions, so the user sees which is which."""
    ours = any(PER_EXPERT.match(n) or n.endswith(".experts.gate_up_proj") for n in names)
    theirs = any(PER_EXPERT.match(t.name) or t.name.endswith(".experts.gate_up_proj") for t in manifest.tensors)
    if not (ours or theirs):
        return None
    return f"Expert tensors are matched under either naming: {CONVENTIONS}."
