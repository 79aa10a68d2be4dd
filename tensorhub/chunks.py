"""Chunks: fixed-size slices of a replica's (or a reader's) own bytes.

A replica's bytes are its held regions laid back to back in order (for a
whole-model replica: the manifest's tensors in manifest order). Chunk ``i``
covers bytes ``[i * chunk_size, (i + 1) * chunk_size)``; a chunk may span
several small regions, and a large region spans several chunks. Chunks are the
unit of planning, of replication (a replica's bitmap) and of failover.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_CHUNK_SIZE = 32 << 20
MIN_CHUNK_SIZE = 4 << 10
MAX_CHUNK_SIZE = 4 << 30


# ------------------------------------------------------------------ bitmaps
# Bit i (least significant bit first within each byte) marks chunk i present.


def bitmap_empty(num_chunks: int) -> bytearray:
    return bytearray(-(-num_chunks // 8))


def bitmap_full(num_chunks: int) -> bytearray:
    bits = bytearray(b"\xff" * (num_chunks >> 3))
    if num_chunks & 7:
        bits.append((1 << (num_chunks & 7)) - 1)
    return bits


def bitmap_set(bits: bytearray, chunk: int) -> None:
    bits[chunk >> 3] |= 1 << (chunk & 7)


def bitmap_set_many(bits: bytearray, chunks: np.ndarray | Sequence[int]) -> None:
    """``bitmap_set`` for each of ``chunks`` (each within the bitmap) in a few
    array operations: a relay's complete report lists thousands of chunks, and
    one Python step per chunk was most of the server's time on it."""
    chunks = np.asarray(chunks, dtype=np.int64)
    if chunks.size == 0:
        return
    marks = np.zeros(len(bits) * 8, dtype=bool)
    marks[chunks] = True
    bits[:] = (np.frombuffer(bits, dtype=np.uint8) | np.packbits(marks, bitorder="little")).tobytes()


def bitmap_has(bits: bytes, chunk: int) -> bool:
    byte = chunk >> 3
    return byte < len(bits) and bool(bits[byte] >> (chunk & 7) & 1)


def bitmap_count(bits: bytes) -> int:
    return int.from_bytes(bits, "little").bit_count()
