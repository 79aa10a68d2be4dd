"""Tensors as raw memory regions: the one place that looks at device and address."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import torch


class MemoryKind(enum.Enum):
    DRAM = "DRAM"  # host memory: CPU tensors
    VRAM = "VRAM"  # device memory: CUDA tensors


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    addr: int
    size: int
    device_id: int


def kind_of(tensor: torch.Tensor) -> MemoryKind:
    if tensor.device.type == "cpu":
        return MemoryKind.DRAM
    if tensor.device.type == "cuda":
        return MemoryKind.VRAM
    raise ValueError(f"tensors on {tensor.device} cannot be transferred; use CPU or CUDA tensors")


def device_id(tensor: torch.Tensor) -> int:
    """NIXL's device id: the CUDA ordinal, 0 for host memory."""
    return (tensor.device.index or 0) if tensor.device.type == "cuda" else 0


def regions_of(tensors: Iterable[torch.Tensor]) -> tuple[MemoryKind, list[MemoryRegion]]:
    """One region per tensor (its bytes, in place), and their common memory kind.

    Raises ValueError for a non-contiguous tensor or a mix of CPU and CUDA.
    """
    kinds: set[MemoryKind] = set()
    regions: list[MemoryRegion] = []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("tensors must be contiguous to be transferred in place; call .contiguous() first")
        kinds.add(kind_of(t))
        regions.append(MemoryRegion(t.data_ptr(), t.numel() * t.element_size(), device_id(t)))
    if len(kinds) > 1:
        raise ValueError("all tensors of one version must live in one kind of memory (all CPU or all CUDA)")
    return (kinds.pop() if kinds else MemoryKind.DRAM), regions


def storages_of(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int, int]]:
    """The distinct storages behind ``tensors`` as (addr, nbytes, device).

    Registering storages rather than tensors keeps tied weights and views into
    one buffer from being registered twice.
    """
    seen: dict[tuple[int, int], tuple[int, int, int]] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        device = device_id(t)
        key = (storage.data_ptr(), device)
        prev = seen.get(key)
        if prev is None or prev[1] < storage.nbytes():
            seen[key] = (storage.data_ptr(), storage.nbytes(), device)
    return list(seen.values())
