"""Host memory that wide READs land in before their wanted bytes are cut out
(``wideread``): a few slots, each allocated and registered with the NIXL agent
on first use and kept for the hub's life, so a pull pays for neither page
faults (first-touched memory copies at ~0.4 GB/s here) nor registration.

A slot is taken when its READ is posted and given back once the READ has
landed and been cut, or failed. A READ let go of unfinished (stalled, or
still out when its pull failed) may still land later, so its slot is retired:
kept, never reused, and a new one takes its place (up to ``_MAX_RETIRED``).
With no slot free the READ goes as its exact runs, the same bytes: a slot is
never waited for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# A wide READ lands at most this many bytes (READs are packed to half of it,
# a group of runs to at most half: ``wideread``). Small enough that the cut
# finds them in cache (the reference machine: 32 MiB L3), large enough that a
# READ's fixed cost in the pull (~50-100 us of Python) stays small.
SLOT_BYTES = 8 << 20
_MAX_RETIRED = 16  # then no new slots: 128 MiB kept for READs that may still land


@dataclass(frozen=True, slots=True)
class Slot:
    addr: int
    nbytes: int
    device: int
    array: np.ndarray  # the slot's bytes, for the cut
    memory: torch.Tensor
    registration: Any


class ScratchPool:
    """Up to ``slots`` slots of ``slot_bytes`` host memory in use at once.
    Thread-safe: a hub's pulls share it."""

    def __init__(self, slots: int, slot_bytes: int = SLOT_BYTES, *,
                 register: Callable[[list[torch.Tensor]], Any] | None = None,
                 deregister: Callable[[Any], None] | None = None) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._register, self._deregister = register, deregister
        self._lock = threading.Lock()
        self._free: list[Slot] = []
        self._live = 0  # slots made and not retired
        self._retired: list[Slot] = []

    @property
    def retired(self) -> int:
        return len(self._retired)

    def take(self) -> Slot | None:
        """A free slot (made now if fewer than ``slots`` exist), or None."""
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._live >= self.slots or len(self._retired) >= _MAX_RETIRED:
                return None
            self._live += 1
        try:
            return self._make()
        except BaseException:
            with self._lock:
                self._live -= 1
            raise

    def give(self, slot: Slot) -> None:
        with self._lock:
            self._free.append(slot)

    def retire(self, slot: Slot) -> None:
        """A READ may still land in ``slot``: it stays allocated and registered, unused."""
        with self._lock:
            self._retired.append(slot)
            self._live -= 1

    def close(self) -> None:
        with self._lock:
            slots, self._free, self._retired = [*self._free, *self._retired], [], []
        if self._deregister is not None:
            for slot in slots:
                if slot.registration is not None:
                    self._deregister(slot.registration)

    def _make(self) -> Slot:
        memory = torch.zeros(self.slot_bytes, dtype=torch.uint8)  # written: its pages are touched
        registration = self._register([memory]) if self._register is not None else None
        return Slot(memory.data_ptr(), self.slot_bytes, 0, memory.numpy(), memory, registration)
