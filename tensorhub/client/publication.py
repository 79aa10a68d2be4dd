"""A replica this process holds and serves: published tensors, or the
destination of a pull that serves what it received."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from tensorhub.chunks import bitmap_empty, bitmap_full, bitmap_set
from tensorhub.manifest import Manifest
from tensorhub.transport import Registration

if TYPE_CHECKING:
    from tensorhub.client.hub import Hub


class Publication:
    """Memory of one (model, version) that readers may READ in place.

    The holder promises not to modify the tensors until ``unpublish()`` returns.
    Use as a context manager to unpublish on exit.
    """

    def __init__(self, hub: Hub, *, model: str, version: int, replica_id: str, manifest: Manifest,
                 chunk_size: int, tensors: dict[str, torch.Tensor], registration: Registration,
                 origin: bool, complete: bool, retained: bool = False) -> None:
        self._hub = hub
        self.model = model
        self.version = version
        self.replica_id = replica_id
        self.manifest = manifest
        self.chunk_size = chunk_size
        self.tensors = tensors  # held so the memory stays alive while published
        self.registration = registration
        self.origin = origin
        self.retained = retained  # a host copy kept only so the version stays pullable
        num_chunks = -(-manifest.total_bytes // chunk_size)
        self.complete = complete
        self.bitmap = bitmap_full(num_chunks) if complete else bitmap_empty(num_chunks)
        self.withdrawing = False
        self.closed = False
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.manifest.total_bytes

    def mark_landed(self, chunks: list[int]) -> None:
        with self.lock:
            for c in chunks:
                bitmap_set(self.bitmap, c)

    def unpublish(self, timeout: float = 60.0) -> None:
        """Withdraw this replica and return once no reader is reading it
        (in-flight reads finished, or their read leases expired). Afterwards
        the tensors may be modified or freed. Raises UnpublishTimeout if
        readers still hold leases after ``timeout`` seconds."""
        self._hub._unpublish(self, timeout)

    def __enter__(self) -> Publication:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unpublish()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "complete" if self.complete else "filling"
        return f"Publication({self.model!r}, version={self.version}, {self.nbytes} bytes, {state})"
