"""Per-chunk checksums (tensorhub.integrity): the publisher's chunks of its held
regions back to back, checked against plain CRC-32 of the same bytes; a byte
changed after publish is found in exactly its chunk."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from tensorhub.integrity import checksum, chunk_checksums, mismatched_chunks
from tensorhub.testing import make_tensors, mixed_specs


def _reference(tensors, chunk_size):
    data = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    return [zlib.crc32(data[i:i + chunk_size]) for i in range(0, len(data), chunk_size)]


@pytest.mark.parametrize("chunk_size", [4096, 4097, 1 << 16, 1 << 20])
def test_chunks_span_tensors_like_a_replicas_bitmap(chunk_size):
    tensors = list(make_tensors(mixed_specs(40, largest_bytes=300_000), seed=3).values())
    tensors.insert(5, torch.empty(0))  # an empty region changes nothing
    got = chunk_checksums(tensors, chunk_size)
    assert got.dtype == np.uint32 and got.tolist() == _reference(tensors, chunk_size)


def test_a_corrupted_byte_is_found_in_its_chunk():
    tensors = [torch.randn(1000, 64), torch.arange(5000, dtype=torch.int64)]
    chunk = 64 << 10
    published = chunk_checksums(tensors, chunk)
    assert mismatched_chunks(tensors, chunk, published) == []
    flat = tensors[1].view(torch.uint8)
    flat[7777] ^= 1  # one bit, in tensor 1 at byte 256,000 + 7,777 of the replica
    assert mismatched_chunks(tensors, chunk, published) == [(256_000 + 7777) // chunk]
    assert mismatched_chunks(tensors, chunk, published, chunks=[0]) == []
    # A reader's check over scattered destination ranges gives the same value as one buffer.
    whole = tensors[0].view(torch.uint8).reshape(-1).numpy()
    assert checksum([memoryview(whole[:100]), memoryview(whole[100:chunk])]) == published[0]


def test_what_cannot_be_checked_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        chunk_checksums([torch.randn(8, 8).t()], 4096)
    with pytest.raises(ValueError, match="positive"):
        chunk_checksums([torch.randn(8)], 0)
    with pytest.raises(ValueError, match="3 checksums for 1 chunks"):
        mismatched_chunks([torch.randn(8)], 4096, np.zeros(3, np.uint32))
