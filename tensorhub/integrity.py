"""Per-chunk checksums of a replica's bytes: computed once by the publisher,
checked by a reader against the bytes it landed, so that a corrupted or stale
source is detected instead of yielding wrong bytes.

The unit is the replica's own chunk (its held regions back to back, cut every
``chunk_size`` bytes: the same unit as its chunk bitmap), so a holder computes
them from its memory alone and a reader that read a holder's whole chunk can
check it without asking anyone. A relay (a reader serving what it pulled)
cut like one of its sources announces that source's checksums; one cut like
none of them (a whole-model reader of sharded trainers) computes its own, per
chunk as the chunk lands, from bytes checked against their sources where the
read allowed (``some_chunk_checksums``), and reports each with its chunk.

Algorithm: CRC-32 (IEEE: the values of ``zlib.crc32``), computed with ISA-L
(the ``isal`` package) at 21-25 GB/s on one core of the reference machine
(x86-64, 1 GiB buffer; in the same run ``zlib.crc32`` 4.2, BLAKE2b 0.92,
SHA-256 1.3 GB/s). It releases the GIL while it runs (about 1.5 ms per 32 MiB
chunk: a Python thread beside it keeps its pace, measured). Readers check on a
helper thread; what that costs a pull is in docs/benchmarks.md (`tensorhub bench pull --size 1GiB
--reps 12`, the checksum rows). CRC-32 detects accidental corruption and stale
bytes, not an adversary who can choose the bytes (that needs a keyed hash, at
about a fifth of zlib's speed here).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from isal.isal_zlib import crc32  # zlib's CRC-32, computed with ISA-L's folding code

ALGORITHM = "crc32"


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in memory order, without a copy (CPU, contiguous)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"checksums need contiguous CPU tensors, not a {tensor.device.type} tensor"
                         f"{'' if tensor.is_contiguous() else ' that is not contiguous'}")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")


def _pieces(buffers: Sequence[memoryview], chunk_size: int) -> Iterator[tuple[int, memoryview]]:
    """(chunk index, a piece of it): the buffers back to back, cut at chunk boundaries."""
    offset = 0
    for buf in buffers:
        pos = 0
        while pos < len(buf):
            chunk, within = divmod(offset, chunk_size)
            take = min(len(buf) - pos, chunk_size - within)
            yield chunk, buf[pos:pos + take]
            pos += take
            offset += take


def chunk_checksums(tensors: Sequence[torch.Tensor], chunk_size: int) -> np.ndarray:
    """CRC-32 of every chunk of ``tensors``' bytes laid back to back (a replica's
    held regions in memory order), as uint32; the last chunk may be short."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, not {chunk_size}")
    buffers = [_bytes(t) for t in tensors]
    total = sum(len(b) for b in buffers)
    out = np.zeros(-(-total // chunk_size), dtype=np.uint32)
    for chunk, piece in _pieces(buffers, chunk_size):
        out[chunk] = crc32(piece, int(out[chunk]))  # a chunk spanning tensors continues the CRC
    return out


def some_chunk_checksums(tensors: Sequence[torch.Tensor], chunk_size: int, chunks: Sequence[int]) -> list[int]:
    """CRC-32 of the given chunks only (same unit as ``chunk_checksums``): what a
    relay computes for the chunks it reports as they land. Only their bytes are
    read; the walk over the others just cuts memoryviews."""
    buffers = [_bytes(t) for t in tensors]
    total = sum(len(b) for b in buffers)
    for c in chunks:
        if not 0 <= c * chunk_size < total:
            raise ValueError(f"chunk {c} is outside the {total} bytes")
    values = dict.fromkeys(chunks, 0)
    for chunk, piece in _pieces(buffers, chunk_size):
        if chunk in values:
            values[chunk] = crc32(piece, values[chunk])  # a chunk spanning tensors continues the CRC
    return [values[c] for c in chunks]


def mismatched_chunks(tensors: Sequence[torch.Tensor], chunk_size: int, expected: np.ndarray,
                      chunks: Sequence[int] | None = None) -> list[int]:
    """The chunks (of ``chunks``, default all) whose bytes do not match ``expected``."""
    got = chunk_checksums(tensors, chunk_size)
    if len(got) != len(expected):
        raise ValueError(f"{len(expected)} checksums for {len(got)} chunks")
    wanted = range(len(got)) if chunks is None else chunks
    return [c for c in wanted if got[c] != expected[c]]


def checksum(pieces: Sequence[memoryview | bytes]) -> int:
    """CRC-32 of ``pieces`` back to back: what a reader computes over the
    destination ranges that one holder chunk landed in, to compare with that
    chunk's entry of the holder's ``chunk_checksums``."""
    value = 0
    for piece in pieces:
        value = crc32(piece, value)
    return value
