"""Chunks: fixed-size slices of a manifest's logical byte space.

The logical byte space is the manifest's tensors laid end to end in manifest
order. Chunk ``i`` covers bytes ``[i * chunk_size, (i + 1) * chunk_size)``; a
chunk may span several small tensors, and a large tensor spans several chunks.
Chunks are the unit of transfer, of replication (a replica's bitmap) and of
failover (a lost source's chunks are re-planned).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate

DEFAULT_CHUNK_SIZE = 32 << 20
MIN_CHUNK_SIZE = 4 << 10
MAX_CHUNK_SIZE = 4 << 30


@dataclass(frozen=True, slots=True)
class Segment:
    """``length`` bytes at ``offset`` inside manifest tensor ``tensor``."""

    tensor: int
    offset: int
    length: int


class ChunkLayout:
    """Maps chunks to the tensor segments they cover."""

    def __init__(self, tensor_sizes: list[int], chunk_size: int) -> None:
        if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(
                f"chunk_size {chunk_size} outside [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]"
            )
        self.chunk_size = chunk_size
        self.tensor_sizes = list(tensor_sizes)
        self.starts = [0, *accumulate(self.tensor_sizes)][:-1] if self.tensor_sizes else []
        self.total_bytes = sum(self.tensor_sizes)
        self.num_chunks = -(-self.total_bytes // chunk_size)

    def chunk_bytes(self, chunk: int) -> int:
        start = chunk * self.chunk_size
        return min(self.chunk_size, self.total_bytes - start)

    def segments(self, chunk: int) -> list[Segment]:
        if not 0 <= chunk < self.num_chunks:
            raise IndexError(f"chunk {chunk} outside [0, {self.num_chunks})")
        lo = chunk * self.chunk_size
        hi = lo + self.chunk_bytes(chunk)
        out: list[Segment] = []
        t = bisect.bisect_right(self.starts, lo) - 1
        while lo < hi:
            start, size = self.starts[t], self.tensor_sizes[t]
            end = min(hi, start + size)
            if end > lo:
                out.append(Segment(t, lo - start, end - lo))
                lo = end
            t += 1
        return out


# ------------------------------------------------------------------ bitmaps
# Bit i (least significant bit first within each byte) marks chunk i present.


def bitmap_empty(num_chunks: int) -> bytearray:
    return bytearray(-(-num_chunks // 8))


def bitmap_full(num_chunks: int) -> bytearray:
    bits = bitmap_empty(num_chunks)
    for i in range(num_chunks):
        bits[i >> 3] |= 1 << (i & 7)
    return bits


def bitmap_set(bits: bytearray, chunk: int) -> None:
    bits[chunk >> 3] |= 1 << (chunk & 7)


def bitmap_has(bits: bytes, chunk: int) -> bool:
    byte = chunk >> 3
    return byte < len(bits) and bool(bits[byte] >> (chunk & 7) & 1)


def bitmap_count(bits: bytes) -> int:
    return sum(bin(b).count("1") for b in bits)
