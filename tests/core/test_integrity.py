"""Per-chunk checksums (tensorhub.integrity): the publisher's chunks of its held
regions back to back, checked against plain CRC-32 of the same bytes; a byte
changed after publish is found in exactly its chunk. Then end to end: readers
check what they read, fail over from a corrupted holder, and never serve or
return its bytes."""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib

import numpy as np
import pytest
import torch
from test_regions import MemcpyTransport, _pull, _remote

from tensorhub import Hub, Manifest, VersionNotFound
from tensorhub.client import verify
from tensorhub.integrity import checksum, chunk_checksums, mismatched_chunks
from tensorhub.regions import Region
from tensorhub.testing import RemoteError, make_tensors, mixed_specs
from tensorhub.topology import Labels


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


def test_reads_cut_into_pieces_are_checked_as_each_lands_and_a_bad_one_is_read_elsewhere(monkeypatch):
    """The pull logic in this process (the seam is NIXL: a memmove transport,
    done when posted as over shared memory), with READs cut far below a chunk
    and across descriptors: each piece's CRC, taken as it landed, joined per
    holder chunk, must equal the publisher's; a flipped byte in the nearer
    holder is found and its chunk read from the other one."""
    monkeypatch.setattr(verify, "READ_PIECE_BYTES", 5000)
    tensors = make_tensors(SPECS, 1)
    manifest = Manifest.of(tensors)
    crcs = chunk_checksums(list(tensors.values()), CHUNK)
    held = {name: {n: t.clone() for n, t in tensors.items()} for name in ("bad", "good")}
    held["bad"][BAD_TENSOR].view(-1).view(torch.uint8)[100] ^= 1
    replicas = [dataclasses.replace(_remote(name, manifest, [(n, Region(), t) for n, t in held[name].items()]),
                                    chunk_size=CHUNK, chunk_crc32=crcs) for name in held]
    far = replicas[1].source
    replicas[1] = dataclasses.replace(replicas[1], source=dataclasses.replace(far, labels=Labels("h1")))
    transport = MemcpyTransport()
    stats, dests, plane = _pull(manifest, replicas, [(n, Region()) for n in tensors], chunk_size=CHUNK,
                                transport=transport)
    assert all(torch.equal(d, t.reshape(-1)) for d, t in zip(dests, tensors.values()))
    assert max(n for _, n in transport.reads) <= 5000  # cut: a chunk is 64 KiB
    assert stats.corrupt_sources == ["bad"] and plane.lost == ["bad"]
    assert (stats.checks_failed, stats.checks_failed_unplaced) == (1, 0)  # one chunk, its culprit known
    assert stats.verified_bytes == stats.nbytes and stats.unverified_bytes == 0
    assert 0 < stats.bytes_by_source["good"] < stats.nbytes


# ---------------------------------------------------------------- end to end
# Real processes, real NIXL, a real server: a holder's memory is corrupted after
# publish (one byte flipped in place, in its own process) and readers pull.

SPECS = mixed_specs(24, largest_bytes=256 << 10)
CHUNK = 64 << 10
BAD_TENSOR = max(make_tensors(SPECS, 0).items(), key=lambda kv: kv[1].nbytes)[0]  # spans several chunks


def _holder(hubs, name: str, host: str, **config):
    return hubs(name, labels={"host": host}, chunk_size=CHUNK, **config)


def test_a_corrupted_holder_is_reported_and_its_chunk_read_from_a_good_one(hubs, caplog):
    caplog.set_level(logging.WARNING, logger="tensorhub.server.service")  # the server runs in this process
    good, bad = _holder(hubs, "good", "far"), _holder(hubs, "bad", "near")
    for h in (good, bad):
        h.call("publish", model="m", version=1, specs=SPECS, seed=1)
    bad.call("corrupt", model="m", version=1, tensor=BAD_TENSOR, byte=100)
    reader = _holder(hubs, "reader", "near")  # the bad holder is nearer: read first
    got = reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=1)
    assert got["mismatched"] == []  # byte-exact: the bad chunk came from the good holder
    assert got["lost"] == ["bad"]  # reported to the server and excluded
    assert 0 < got["sources"]["good"] < got["nbytes"]  # only what the bad holder got wrong
    assert got["verified"] == got["nbytes"] and got["unverified"] == 0
    assert got["checks_failed"] == 1  # the one bad chunk, caught and read again
    reports = [r.getMessage() for r in caplog.records if "reported lost" in r.getMessage()]
    assert len(reports) == 1 and "integrity: chunk" in reports[0] and bad.agent_id in reports[0]


def test_without_verification_the_corruption_reaches_the_reader(hubs):
    """The control for the test above: the same fault, checks off, wrong bytes."""
    good, bad = _holder(hubs, "good", "far"), _holder(hubs, "bad", "near")
    for h in (good, bad):
        h.call("publish", model="m", version=1, specs=SPECS, seed=1)
    bad.call("corrupt", model="m", version=1, tensor=BAD_TENSOR, byte=100)
    reader = _holder(hubs, "reader", "near", verify_chunks=False)
    got = reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=1)
    assert got["mismatched"] == [BAD_TENSOR] and got["lost"] == [] and got["verified"] == 0


def test_only_a_corrupted_holder_fails_typed_and_serves_nothing(server, hubs):
    bad = _holder(hubs, "bad", "near")
    bad.call("publish", model="m", version=1, specs=SPECS, seed=1)
    bad.call("corrupt", model="m", version=1, tensor=BAD_TENSOR, byte=7)
    reader = _holder(hubs, "reader", "near")
    start = time.monotonic()
    with pytest.raises(RemoteError) as err:
        reader.call("pull", model="m", version=1, specs=SPECS, serve=True, timeout=30)
    assert err.value.type_name == "IntegrityError"
    assert "bad" in err.value.message and "did not match their checksums" in err.value.message
    assert BAD_TENSOR in err.value.message  # names the tensor its bad bytes belong to
    assert time.monotonic() - start < 30
    # The reader's partial replica was withdrawn: no one can read its chunks. (The
    # bad holder was dropped when reported; its next heartbeat announces it again.)
    with Hub.connect(server.address, name="probe") as probe:
        try:
            holders = [r.source.agent_name for r in probe._rpc.resolve(probe.agent_id, "m", 1).replicas]
        except VersionNotFound:
            holders = []
    assert "reader" not in holders


def test_a_relay_serves_checked_chunks_with_the_versions_checksums(hubs):
    """A reader that serves what it pulled announces the origin's checksums (its
    chunks are cut the same way): its own readers check what they read from it."""
    trainer, relay = _holder(hubs, "trainer", "far"), _holder(hubs, "relay", "near")
    trainer.call("publish", model="m", version=1, specs=SPECS, seed=1)
    got = relay.call("pull", model="m", version=1, specs=SPECS, expect_seed=1, serve=True)
    assert got["mismatched"] == [] and got["verified"] == got["nbytes"]
    relay.call("corrupt", model="m", version=1, tensor=BAD_TENSOR, byte=3)
    reader = _holder(hubs, "reader", "near")
    got = reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=1)
    assert got["mismatched"] == [] and got["lost"] == ["relay"]
    assert 0 < got["sources"]["trainer"] < got["nbytes"]


def test_shards_are_checked_and_slices_of_their_chunks_are_counted_unchecked(hubs):
    ranks = [_holder(hubs, f"rank{r}", "far") for r in range(2)]
    for r, h in enumerate(ranks):
        h.call("publish_shard", model="m", version=1, specs=SPECS, seed=1, how="rows", rank=r, world=2)
    reader = _holder(hubs, "reader", "near")
    whole = reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=1)
    assert whole["mismatched"] == [] and whole["verified"] == whole["nbytes"]
    tp = reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=1, read=("tp", 0, 2))
    assert tp["mismatched"] == [] and tp["unverified"] > 0
    assert tp["verified"] + tp["unverified"] == tp["nbytes"]


def test_a_relay_of_sharded_trainers_computes_its_own_checksums(hubs):
    """No source is cut like a whole-model relay of row-sharded ranks, so it has
    no checksums to copy: it computes its own as its chunks land and reports
    them with them. A byte that changes in its memory afterwards is caught by
    its readers and read from the ranks (before, it reached them: the fault
    campaign's wrong bytes all came whole from such relays)."""
    ranks = [_holder(hubs, f"rank{r}", "far") for r in range(2)]
    for r, h in enumerate(ranks):
        h.call("publish_shard", model="m", version=1, specs=SPECS, seed=1, how="rows", rank=r, world=2)
    relay = _holder(hubs, "relay", "near")
    got = relay.call("pull", model="m", version=1, specs=SPECS, expect_seed=1, serve=True)
    assert got["mismatched"] == [] and got["verified"] == got["nbytes"]
    reader = _holder(hubs, "reader", "near")  # the relay is nearer: read first
    clean = reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=1)
    assert clean["mismatched"] == [] and clean["sources"] == {"relay": clean["nbytes"]}
    assert clean["verified"] == clean["nbytes"]  # its own checksums, not the ranks'
    relay.call("corrupt", model="m", version=1, tensor=BAD_TENSOR, byte=5)
    got = reader.call("pull", model="m", version=1, specs=SPECS, expect_seed=1)
    assert got["mismatched"] == [] and got["lost"] == ["relay"]
    assert 0 < got["sources"].get("rank0", 0) + got["sources"].get("rank1", 0) < got["nbytes"]


def test_some_chunk_checksums_are_those_chunks_of_chunk_checksums():
    """A relay computes its own checksums chunk by chunk as they land: the same
    values the publisher's whole table has, for chunks spanning tensors too."""
    from tensorhub.integrity import chunk_checksums, some_chunk_checksums

    tensors = [torch.arange(1000, dtype=torch.int8), torch.arange(3001, dtype=torch.int16)]
    table = chunk_checksums(tensors, 512)
    assert some_chunk_checksums(tensors, 512, [13, 0, 1, 13]) == [table[13], table[0], table[1], table[13]]
    with pytest.raises(ValueError, match="chunk 14 is outside the 7002 bytes"):
        some_chunk_checksums(tensors, 512, [14])
