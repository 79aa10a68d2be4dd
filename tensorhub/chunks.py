"""Chunks: fixed-size slices of a replica's (or a reader's) own bytes.

A replica's bytes are its held regions laid back to back in order (for a
whole-model replica: the manifest's tensors in manifest order). Chunk ``i``
covers bytes ``[i * chunk_size, (i + 1) * chunk_size)``; a chunk may span
several small regions, and a large region spans several chunks. Chunks are the
unit of planning, of replication (a replica's bitmap) and of failover.
"""

from __future__ import annotations

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


def bitmap_has(bits: bytes, chunk: int) -> bool:
    byte = chunk >> 3
    return byte < len(bits) and bool(bits[byte] >> (chunk & 7) & 1)


def bitmap_count(bits: bytes) -> int:
    return int.from_bytes(bits, "little").bit_count()
