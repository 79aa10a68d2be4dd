"""A trainer rank's publication buffer: its part of each tensor of a step's
``(name, tensor)`` stream (see split.py), copied so it can stay published
while training moves on.

Only the rank's part is copied and kept: no buffer the size of the model
exists on any rank. Slots are allocated at the first step and reused: a step
whose tensors have the same names, shapes and dtypes as the last one
allocates nothing. The buffer knows nothing of publishing; its owner must
unpublish the previous step (which drains readers) before calling ``fill``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable

import torch

from tensorhub import Manifest, Shard, TensorSpec
from tensorhub.delta.codec import DeltaEncoder, DeltaPart
from tensorhub_verl.split import bytes_per_rank, rank_region


class RankBuffer:
    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        # Pinned host memory makes the device-to-host copies asynchronous.
        self._pin = self.device.type == "cpu" and torch.cuda.is_available()
        self._slots: dict[str, torch.Tensor] = {}
        self.shards: dict[str, Shard] = {}  # this rank's parts of the last fill, in stream order
        self.manifest: Manifest | None = None  # the whole model of the last fill
        self.rank_bytes: list[int] = []  # bytes every rank keeps of the last fill
        self.allocations = 0  # slots allocated so far (stays put in steady state)

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds."""
        return sum(s.tensor.numel() * s.tensor.element_size() for s in self.shards.values())

    @property
    def largest_slot(self) -> int:
        return max((s.tensor.numel() * s.tensor.element_size() for s in self.shards.values()), default=0)

    async def fill(self, weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
                   rank: int = 0, world: int = 1, delta: DeltaEncoder | None = None) -> bool:
        """Copy rank ``rank``'s part of every tensor of the stream into its slot.
        The stream is consumed completely (its collectives need every rank).
        ``delta``: each part's changes against what its slot held (the last
        fill) go there, read just before the copy overwrites them. Returns
        whether the delta covers every part (a new or reshaped slot has no
        earlier bytes: then it does not)."""
        slots: dict[str, torch.Tensor] = {}
        shards: dict[str, Shard] = {}
        covered = bool(self._slots)
        specs: dict[str, TensorSpec] = {}
        sizes: list[tuple[tuple[int, ...], int]] = []
        async for name, tensor in aiter_pairs(weights):
            if name in specs:
                raise ValueError(f"the weight stream yielded {name!r} twice")
            specs[name] = TensorSpec.of(name, tensor)
            sizes.append((tuple(tensor.shape), tensor.element_size()))
            region = rank_region(tuple(tensor.shape), len(sizes) - 1, rank, world)
            if region is None:
                continue
            part = _part(tensor, region)
            slot = self._slots.get(name)
            if slot is None or slot.shape != part.shape or slot.dtype != part.dtype:
                slot = torch.empty(part.shape, dtype=part.dtype, device=self.device, pin_memory=self._pin)
                self.allocations += 1
                covered = False
            elif delta is not None and covered:
                # compared where the buffer lives: one tensor's part crosses to it first
                new = part.to(slot.device)
                where = Shard(slot, tuple(tensor.shape), **region).region
                delta.add(DeltaPart(len(sizes) - 1, tuple(tensor.shape), where, new),
                          DeltaPart(len(sizes) - 1, tuple(tensor.shape), where, slot))
                part = new
            slot.copy_(part, non_blocking=self._pin and part.is_cuda)
            slots[name] = slot
            shards[name] = Shard(slot, tuple(tensor.shape), **region)
        if self._pin or self.device.type == "cuda":
            torch.cuda.synchronize()
        self._slots, self.shards = slots, shards
        manifest = Manifest(tuple(specs.values()))
        covered &= self.manifest is not None and manifest == self.manifest
        self.manifest = manifest
        self.rank_bytes = bytes_per_rank(sizes, world)
        return covered


def _part(tensor: torch.Tensor, region: dict) -> torch.Tensor:
    """A view of ``tensor`` (a full tensor) on ``region``; contiguous for rows and flat ranges."""
    if "rows" in region:
        start, stop = region["rows"]
        return tensor[start:stop]
    if "flat" in region:
        start, stop = region["flat"]
        return tensor.reshape(-1)[start:stop]
    return tensor


async def aiter_pairs(weights):  # type: ignore[no-untyped-def]
    """Iterate a sync or async stream of (name, tensor) pairs asynchronously."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item
