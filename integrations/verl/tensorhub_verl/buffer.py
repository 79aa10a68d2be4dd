"""The trainer's publication buffer: where a step's ``(name, tensor)`` stream is
copied so it can stay published while training moves on.

Slots are allocated at the first step and reused: a step whose tensors have
the same names, shapes and dtypes as the last one allocates nothing. The
buffer knows nothing of publishing; its owner must unpublish the previous
step (which drains readers) before calling ``fill`` again.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable

import torch


class PublicationBuffer:
    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        # Pinned host memory makes the device-to-host copies asynchronous.
        self._pin = self.device.type == "cpu" and torch.cuda.is_available()
        self._slots: dict[str, torch.Tensor] = {}
        self.allocations = 0  # slots allocated so far (stays put in steady state)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The slots of the last ``fill``, in stream order."""
        return self._slots

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._slots.values())

    async def fill(self, weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every tensor of the stream into its slot. The stream is consumed
        completely (a sharded trainer's stream may run collectives per tensor)."""
        slots: dict[str, torch.Tensor] = {}
        async for name, tensor in aiter_pairs(weights):
            if name in slots:
                raise ValueError(f"the weight stream yielded {name!r} twice")
            slot = self._slots.get(name)
            if slot is None or slot.shape != tensor.shape or slot.dtype != tensor.dtype:
                slot = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device, pin_memory=self._pin)
                self.allocations += 1
            slot.copy_(tensor, non_blocking=self._pin and tensor.is_cuda)
            slots[name] = slot
        if self._pin or self.device.type == "cuda":
            torch.cuda.synchronize()
        self._slots = slots


async def aiter_pairs(weights):  # type: ignore[no-untyped-def]
    """Iterate a sync or async stream of (name, tensor) pairs asynchronously."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item
