"""A wave of joiners keeps every link it reads from busy.

Found by ``tensorhub bench rl scenario=elastic`` (trace=): three joiners
relaying one version from one complete holder took about 4.2 s, twice one copy
over their link, for three reasons, each checked here:

* a filling peer that had landed nothing yet was dropped from the reader's
  holders, so its share of the wave was not left to it: every reader's second
  round read the others' shares from the complete holder;
* once its peers held more than a round's worth of chunks, a reader's rounds
  were all relayed chunks: its own share waited, the complete holder's link
  idled, and the wave's new bytes stopped coming in;
* a round's READs were posted in chunk order, so the few in flight queued on
  one source's link at a time.

These are the shares of a wave across zones; in one zone the wave is a chain
(``schedule.chain_owners``, tests/core/test_schedule.py).

Plans only: the control plane is a fake, no byte moves."""

from __future__ import annotations

import time

import numpy as np

from tensorhub.client.puller import PullJob
from tensorhub.client.readlayout import ReadLayout, ReadPart
from tensorhub.client.rpc import RemoteReplica, Resolved
from tensorhub.client.transfer import Transfer
from tensorhub.manifest import Manifest, TensorSpec
from tensorhub.planner import Source
from tensorhub.regions import Region
from tensorhub.schedule import WAVE_READS_FACTOR, by_turns
from tensorhub.topology import Labels, Reliability
from tensorhub.transport import MemoryKind
from tensorhub.transport.memory import MemoryRegion

CHUNK = 4096
CHUNKS = 48
IN_FLIGHT = 4


def _replica(rid: str, *, complete: bool, landed: range = range(0), zone: str = "") -> RemoteReplica:
    bits = np.zeros(CHUNKS, np.uint8)
    bits[list(landed)] = 1
    source = Source(rid, rid, Labels(rid, zone=zone), origin=complete, complete=complete,
                    reliability=Reliability.RELIABLE if complete else Reliability.SPOT)
    return RemoteReplica(source, rid, MemoryKind.DRAM, ((0, Region()),),
                         np.array([[1 << 30, CHUNKS * CHUNK, 0]], np.uint64), b"", CHUNK,
                         bitmap=b"" if complete else np.packbits(bits, bitorder="little").tobytes())


def _job(*replicas: RemoteReplica, in_flight: int = IN_FLIGHT) -> PullJob:
    manifest = Manifest((TensorSpec("w", "uint8", (CHUNKS * CHUNK,), CHUNKS * CHUNK),))
    spec = manifest.tensors[0]
    parts = [ReadPart("w", 0, spec.shape, Region().runs(spec.shape), 1, MemoryRegion(2 << 30, CHUNKS * CHUNK, 0))]
    return PullJob(rpc=None, nixl=None, agent_id="reader", labels=Labels("reader"),
                   resolved=Resolved("m", 1, manifest, replicas), layout=ReadLayout(manifest, parts, CHUNK),
                   dest_kind=MemoryKind.DRAM, in_flight=in_flight, chunk_timeout_s=5,
                   deadline=time.monotonic() + 30, landed=lambda chunks: None, verify=False)


def test_a_peer_with_nothing_landed_keeps_its_share_and_the_reader_reads_its_own_beside_relayed_ones():
    trainer = _replica("trainer", complete=True)
    ahead = _replica("ahead", complete=False, landed=range(24))  # half the version landed
    late = _replica("late", complete=False)  # registered, nothing landed yet
    far = _replica("far", complete=False, zone="z1")  # a wave across zones: shares (in one zone: a chain)
    job = _job(trainer, ahead, late, far, in_flight=1)  # in a wave: WAVE_READS_FACTOR READs, batches of twice that
    maps = job._holders.maps(job.resolved.replicas, set())
    assert "late" in maps, "a filling peer with nothing landed was dropped: its share is read by the others"
    batch = job._batch(set(range(CHUNKS)), list(maps.values()))
    slots = WAVE_READS_FACTOR
    assert job._slots == slots
    relayed = [c for c in batch if c < 24]
    own = [c for c in batch if c >= 24]
    assert len(batch) == 2 * slots and len(relayed) < len(batch)
    assert len(own) >= 2 * slots // 3, f"{own}: the reader's own share waits while peers' chunks are read"
    # The rest is split three ways: the reader's share of what only the trainer
    # has is about a third (the late peer owns one of the arcs), not a half.
    mine = job._batch(set(range(24, CHUNKS)), list(maps.values()))
    assert mine and len(mine) <= 24 // 3 + 1


def test_a_rounds_reads_take_turns_over_their_sources():
    def t(rid: str) -> Transfer:
        return Transfer(rid, np.zeros((1, 3), np.uint64), np.zeros((1, 3), np.uint64), CHUNK)

    transfers = {0: [t("a")], 1: [t("a")], 2: [t("a")], 3: [t("b")], 4: [t("b")], 5: [t("c")]}
    order = [(chunk, tr.replica_id) for chunk, tr in by_turns(transfers, lambda tr: tr.replica_id)]
    assert order == [(0, "a"), (3, "b"), (5, "c"), (1, "a"), (4, "b"), (2, "a")]
