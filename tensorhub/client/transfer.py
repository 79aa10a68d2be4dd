"""One READ as the puller posts it: the exact segments it fills (``Transfer``),
and, when some of them are read wide and cut out locally, how they move
(``WidePlan``). ``readlayout`` makes Transfers, ``wideread`` widens them,
the puller, ``flights`` and ``verify`` post, account for and check them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tensorhub.client.scratch import Slot


@dataclass(frozen=True, slots=True)
class Transfer:
    """One READ: ``local`` and ``remote`` are N x 3 descriptor arrays (addr, bytes, device)
    of the exact segments it fills, in reader order: what checks and accounting see."""

    replica_id: str
    local: np.ndarray
    remote: np.ndarray
    nbytes: int
    h_off: np.ndarray | None = None  # per descriptor: its offset in the holder's own bytes (checksums)
    # How the segments move when some groups of them are read wide and cut
    # locally (``wideread``); None: as they are, one descriptor each.
    wide: WidePlan | None = None


@dataclass(frozen=True, slots=True)
class WidePlan:
    """How a Transfer's segments move when some go wide.

    ``local`` and ``remote``: the descriptors to post (N x 3: addr, bytes,
    device); rows ``in_scratch`` hold an offset into the scratch slot, bound at
    post time. ``cuts``: per wide group (scratch offset, runs, run bytes,
    stride in scratch, destination address, stride in the destination)."""

    local: np.ndarray
    remote: np.ndarray
    in_scratch: np.ndarray
    cuts: np.ndarray
    read_bytes: int

    def bound(self, slot: Slot) -> np.ndarray:
        local = self.local.copy()
        local[self.in_scratch, 0] += np.uint64(slot.addr)
        local[self.in_scratch, 2] = np.uint64(slot.device)
        return local
