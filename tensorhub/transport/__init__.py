"""The data path: moving bytes between agents' memory with NIXL one-sided READs.
Knows nothing of models, versions or the reference server."""

from tensorhub.transport.memory import MemoryKind, MemoryRegion, regions_of
from tensorhub.transport.nixl import NixlAgent, Registration
from tensorhub.transport.pending import PendingRead, TransferFailed

__all__ = ["MemoryKind", "MemoryRegion", "NixlAgent", "PendingRead", "Registration", "TransferFailed", "regions_of"]
