"""Merged mode, for engines served without LoRA support: the rollout pulls
only an adapter version and loads ``W + scale * B @ A`` into its weights.

``W`` is the base version in the worker's staging (its read set of the
checkpoint, kept there while it serves that version), never the engine's
weights: those hold the previous merge. The merged tensors are new memory
beside the staging, so the staging stays the base version (peers keep reading
it as that version, and the next adapter version merges onto it again).
A worker pulls only the rows of B and the columns of A its boxes of each
targeted weight need.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tensorhub import Shard
from tensorhub.lora import PulledAdapter, base_weight_name, merge_lora
from tensorhub.regions import Bounds
from tensorhub_vllm.readset import ReadSet


def adapter_parts_for(read_set: ReadSet):
    """``pull_adapter``'s ``parts`` for a worker whose staging holds
    ``read_set``: B's rows and A's columns of its one box of each targeted
    weight; the whole matrix where it reads the weight whole or in several boxes."""

    def part(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Bounds | None:
        boxes = read_set.boxes.get(base_weight_name(name))
        if boxes is None or len(boxes) != 1 or len(shape) != 2:
            return None
        (rows, cols), = boxes
        return ((0, shape[0]), cols) if ".lora_A." in name else (rows, (0, shape[1]))

    return part


def merged_staging(staged: Mapping[str, torch.Tensor | list[Shard]],
                   adapter: PulledAdapter) -> dict[str, torch.Tensor | list[Shard]]:
    """``staged`` with every weight the adapter targets replaced by a merged
    copy (each box of it: that box's rows of B, columns of A). Raises
    ValueError naming a targeted weight the staging does not hold."""
    scale = adapter.config.scale()
    out = dict(staged)
    for a_name, lora_a in adapter.tensors.items():
        if ".lora_A." not in a_name:
            continue
        lora_b = adapter.tensors[a_name.replace(".lora_A.", ".lora_B.")]
        name = base_weight_name(a_name)
        entry = staged.get(name)
        if entry is None:
            raise ValueError(f"tensorhub: the adapter adapts {name!r}, which this engine's checkpoint does not have "
                             f"(its LoRA matrix {a_name!r})")
        if isinstance(entry, torch.Tensor):
            out[name] = merge_lora(entry, lora_a, lora_b, scale)
            continue
        merged = []
        for shard in entry:
            (r0, r1), (c0, c1) = shard.region.box
            merged.append(Shard(merge_lora(shard.tensor, lora_a[:, c0:c1], lora_b[r0:r1], scale), shard.full_shape,
                                box=shard.region.box))
        out[name] = merged
    return out
