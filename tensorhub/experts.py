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
of the fused tensors for the next reader. The same holds the other way round:
a destination for the fused tensors (an engine whose checkpoint was saved
fused) is one for a per-expert version, expert by expert.
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
_PROJ_NAMES = tuple(zip(_GATE, _UP, _DOWN))  # (gate, up, down): Qwen-style, Mixtral-style
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


FUSED = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")


def _experts_of(layer: str, e: int, kind: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, ...] | None:
    """The manifest's per-expert names of expert ``e``'s part ``kind`` of a fused
    tensor: (gate, up) for ``gate_up_proj``, (down,) for ``down_proj``, under
    either block name; None where the manifest has them under neither."""
    for block, (gate, up, down) in (("mlp", _PROJ_NAMES[0]), ("block_sparse_moe", _PROJ_NAMES[1])):
        base = f"{layer}.{block}.experts.{e}."
        names = (f"{base}{down}.weight",) if kind == "down_proj" else (f"{base}{gate}.weight", f"{base}{up}.weight")
        if all(n in shapes for n in names):
            return names
    return None


def per_expert_parts(name: str, entry: Entry, shapes: Mapping[str, tuple[int, ...]]
                     ) -> dict[str, list[Shard]] | None:
    """The other way round: a destination for fused tensor ``name`` (whole or
    boxes of it) as shards of the manifest's per-expert tensors over the same
    memory, one per expert and (for gate_up) half it meets. None where
    ``name`` is not fused, the manifest lacks an expert or a shape disagrees,
    or a part is a flat range (a reader's staging holds boxes). An expert no
    part covers (an expert-parallel worker's staging of a fused checkpoint)
    gets no shard, so the manifest check lists its per-expert names as missing."""
    m = FUSED.match(name)
    if m is None:
        return None
    kind = m["kind"]
    shards = [entry] if isinstance(entry, (Shard, torch.Tensor)) else list(entry)
    out: dict[str, list[Shard]] = {}
    for s in shards:
        whole = s if isinstance(s, Shard) else Shard(s, tuple(s.shape))
        full = tuple(whole.full_shape)
        if len(full) != 3 or whole.region.flat is not None:
            return None
        (e0, e1), (a, b), cols = whole.region.bounds(full)
        half = full[1] // 2 if kind == "gate_up_proj" else full[1]
        for e in range(e0, e1):
            names = _experts_of(m["layer"], e, kind, shapes)
            if names is None or any(shapes[n] != (half, full[2]) for n in names):
                return None
            for i, part in enumerate(names):  # gate rows [0, I), up rows [I, 2I) of the fused dim 1
                lo, hi = max(a, i * half), min(b, (i + 1) * half)
                if lo < hi:
                    view = whole.tensor[e - e0, lo - a:hi - a]
                    out.setdefault(part, []).append(Shard(view, (half, full[2]), box=((lo - i * half, hi - i * half), cols)))
    return out


def _renamed(name: str, shape: tuple[int, ...], shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    for old, new in _RENAMES:
        other = name.replace(old, new)
        if other != name and shapes.get(other) == shape:
            return other
    return None


def onto(into: Mapping[str, Entry], manifest: Manifest) -> dict[str, Entry]:
    """``into`` (names of a checkpoint) for a version whose manifest may name
    the experts the other way: each per-expert entry the manifest lacks but
    holds fused becomes shards of the fused tensor over the same memory; each
    fused entry (a checkpoint saved fused) the manifest holds per expert
    becomes shards of those (``per_expert_parts``); a name transformers 5
    renames (Mixtral's ``block_sparse_moe.gate``) takes the manifest's name.
    Everything else is left as it is, so a name that matches neither
    convention still gets the manifest check's listing."""
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
            parts = None if name in shapes else per_expert_parts(name, entry, shapes)
            if parts is None:
                out[name] = entry
            else:  # a fused checkpoint's tensor, the version's experts apart
                out.update(parts)
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
