"""A replica this process holds and serves: published tensors or shards, or
the destination of a pull that serves what it received."""

from __future__ import annotations

import contextlib
import enum
import itertools
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from tensorhub.chunks import bitmap_empty, bitmap_full, bitmap_set_many
from tensorhub.manifest import Manifest
from tensorhub.regions import Region
from tensorhub.shard import Part
from tensorhub.transport import Registration

if TYPE_CHECKING:
    from typing_extensions import Self


class PubState(enum.Enum):
    FILLING = "filling"  # a serving pull: chunks land one by one
    COMPLETE = "complete"  # every held byte present
    WITHDRAWING = "withdrawing"  # unpublish began: never announced again
    CLOSED = "closed"  # unpublished and drained: the memory is the caller's again


class Withdrawer(Protocol):
    """Who unpublishes a publication (``Holdings``); kept abstract so that this
    module does not import the client that owns it."""

    def unpublish(self, pub: Publication, timeout: float, *, group: Any = None) -> None: ...


class Publication:
    """Memory of one (model, version) that readers may READ in place: the
    regions in ``parts`` (whole tensors, or a shard of them).

    The holder promises not to modify the tensors until ``unpublish()`` returns.
    Use as a context manager to unpublish on exit. The state changes only
    under ``lock``, by the ``Holdings`` that made it.
    """

    def __init__(self, owner: Withdrawer, *, model: str, version: int, replica_id: str, manifest: Manifest,
                 parts: list[Part], chunk_size: int, registration: Registration, origin: bool, complete: bool,
                 retained: bool = False, chunk_crc32: np.ndarray | None = None,
                 deltas: tuple[str, ...] = (), companions: tuple[Publication, ...] = (),
                 trainer_cut: bool = False) -> None:
        self._owner = owner
        self.model = model
        self.version = version
        self.replica_id = replica_id
        self.manifest = manifest
        self.parts = parts  # held so the memory stays alive while published
        self.chunk_size = chunk_size
        self.registration = registration
        self.origin = origin
        self.retained = retained  # a host copy kept only so the version stays pullable
        # CRC-32 per chunk (tensorhub.integrity), announced with every publish so
        # readers can check what they read; None: readers cannot check this replica.
        self.chunk_crc32 = chunk_crc32
        # True: a filling replica whose checksums no source had (a relay whose
        # layout is its own): it computes each chunk's as the chunk lands and
        # reports it with the chunk; ``chunk_crc32`` is zero for chunks not landed.
        self.derives_crc32 = False
        # Published with announce=False and not announced yet (a serving pull's
        # announce may wait for its group's Batch): heartbeats leave it out
        # until then, or the server, not knowing it yet, would have it
        # announced a second time.
        self.announce_pending = False
        # Delta models (tensorhub.delta) that hold this version's changes from an
        # earlier one for this replica's regions, announced with it; and their
        # publications here, unpublished after this one (its readers find them by it).
        self.deltas = deltas
        self.companions = companions
        # A trainer rank's copy of its readers' cut (tensorhub.client.trainercut),
        # and on the shards' publication: that copy, withdrawn before them (its
        # bytes are theirs: nothing of it needs retaining), and what it cost.
        self.trainer_cut = trainer_cut
        self.cut: Publication | None = None
        self.cut_report = None
        # Published with its cut by every rank of this torch.distributed group at
        # once (``Hub.publish(cut=...)``): withdrawn by all of them at once too,
        # the group's first rank sending every rank's withdrawals.
        self.group: Any = None
        self.fp8_quantize_s: float | None = None  # publish(fp8=True): the companion's quantization time
        index = manifest.index()
        self.held: list[tuple[int, Region]] = [(index[p.name], p.region) for p in parts]
        num_chunks = -(-self.nbytes // chunk_size)
        self.bitmap = bitmap_full(num_chunks) if complete else bitmap_empty(num_chunks)
        self.state = PubState.COMPLETE if complete else PubState.FILLING
        self.lock = threading.Lock()
        # The server lets no read lease on this replica outlive, by more than one
        # lease TTL, the last call in which this process said it holds it. A
        # holder cut off from the server mid-unpublish waits that long from
        # ``confirmed_by()``: when the last such call ended, or will end at the latest.
        self._confirmed_by = 0.0
        # True while an unpublish waits for the server to drain this replica's
        # readers: the holder is alive and its memory untouched, so heartbeats
        # go on confirming it (else its readers' leases ran out one TTL after
        # the unpublish began, mid-read). False again before a holder cut off
        # from the server counts its TTL from ``confirmed_by()``.
        self.draining = False
        self._confirming: dict[int, float] = {}  # call in flight -> its deadline
        self._calls = itertools.count()

    @property
    def nbytes(self) -> int:
        """Bytes this replica holds (the whole model, or its shard)."""
        return sum(p.nbytes for p in self.parts)

    @property
    def complete(self) -> bool:
        return self.state is not PubState.FILLING

    @property
    def announced(self) -> bool:
        """Whether the server should know it (heartbeats re-publish it if not)."""
        return self.state in (PubState.FILLING, PubState.COMPLETE)

    @property
    def whole_model(self) -> bool:
        return len(self.parts) == len(self.manifest.tensors) and all(p.region.whole for p in self.parts)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The local tensors by name (the first, where one name has several shards)."""
        out: dict[str, torch.Tensor] = {}
        for p in self.parts:
            out.setdefault(p.name, p.tensor)
        return out

    def mark_landed(self, chunks: list[int]) -> None:
        with self.lock:
            bitmap_set_many(self.bitmap, chunks)

    def landed(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The chunks marked landed so far and, where this replica derives
        them as it fills, their checksums (what a new subscriber is told: ``peernews``)."""
        with self.lock:
            bits = bytes(self.bitmap)
        chunks = np.flatnonzero(np.unpackbits(np.frombuffer(bits, np.uint8), bitorder="little"))
        chunks = chunks[chunks < -(-self.nbytes // self.chunk_size)]
        crcs = self.chunk_crc32[chunks].astype(np.uint32) if self.derives_crc32 and self.chunk_crc32 is not None \
            else None
        return chunks, crcs

    @contextlib.contextmanager
    def confirming(self, timeout: float) -> Iterator[None]:
        """Around a call that tells the server this replica is held (publish,
        chunk report, heartbeat): the server may act on it until its deadline."""
        call = next(self._calls)
        with self.lock:
            self._confirming[call] = time.monotonic() + timeout
        try:
            yield
        finally:
            with self.lock:
                del self._confirming[call]
                self._confirmed_by = max(self._confirmed_by, time.monotonic())

    def confirmed_by(self) -> float:
        """The latest time the server may have heard that this replica is held."""
        with self.lock:
            return max(self._confirmed_by, *self._confirming.values(), 0.0)

    def unpublish(self, timeout: float = 60.0) -> None:
        """Withdraw this replica and return once no reader is reading it
        (in-flight reads finished, or their read leases expired). Afterwards
        the tensors may be modified or freed. Raises UnpublishTimeout if
        readers still hold leases after ``timeout`` seconds. A publication
        made with ``cut=`` by the ranks of a group (``publication.group``) is
        withdrawn by every rank of it at once: call this on all of them, as
        the publish was (a step's withdrawals are then one message for the
        whole trainer, not one a rank)."""
        self._owner.unpublish(self, timeout, group=self.group)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unpublish()

    def __repr__(self) -> str:
        what = "" if self.whole_model else f", shard of {len(self.parts)} region(s)"
        return f"Publication({self.model!r}, version={self.version}, {self.nbytes} bytes{what}, {self.state.value})"
