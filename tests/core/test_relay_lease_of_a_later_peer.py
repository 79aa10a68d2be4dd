"""A reader that waits for its zone's seed and then relays from a peer it
learned of later leases that peer, instead of counting it withdrawn.

Found by ``tests/core/test_hosts.py::test_two_zones_joined_by_a_slow_link_carry_about_one_copy_across_it``
(1 run in 4 on a busy machine: 1.83-2.02 copies crossed the zone link, 1.3
allowed). A pull's first resolve carries a read lease on the holders it lists,
kept for the first round that reads. A reader of the far zone that is not its
zone's seed reads nothing until the seed's chunks land; its first READs were
then planned on the seed, which joined after that first resolve, under that
old lease. The seed was not in it, so the reader took the seed for withdrawn
and excluded it for the rest of the pull: two readers did, each became a
seed of its own, and two copies crossed the slow link. The old lease is now
let go when it does not cover the round's holders, and a new one taken.

The control plane is a fake (the server's answers in that order); the bytes
move for real, with memmove, and are checked."""

from __future__ import annotations

import time
import zlib

import numpy as np
import torch
from test_lost_holder import CHUNK, SlowMemcpy
from test_relay_serves_while_waiting import Plane

from tensorhub.client.puller import PullJob
from tensorhub.client.readlayout import ReadLayout, ReadPart
from tensorhub.client.rpc import RemoteReplica, Resolved
from tensorhub.manifest import Manifest, itemsize
from tensorhub.planner import Source
from tensorhub.regions import Region
from tensorhub.topology import Labels
from tensorhub.transport import MemoryKind
from tensorhub.transport.memory import regions_of

CHUNKS = 64


def _holder(rid: str, tensor: torch.Tensor, zone: str, *, complete: bool, chunks_held: int = 0) -> RemoteReplica:
    _, mem = regions_of([tensor])
    regions = np.array([(m.addr, m.size, 0) for m in mem], np.uint64).reshape(-1, 3)
    bits = np.zeros(CHUNKS, bool)
    bits[:chunks_held] = True
    return RemoteReplica(Source(rid, rid, Labels(rid, "", zone), complete=complete, origin=rid == "trainer"), rid,
                         MemoryKind.DRAM, ((0, Region()),), regions, b"",
                         CHUNK, bitmap=b"" if complete else np.packbits(bits, bitorder="little").tobytes())


def _seed_before(reader: str) -> str:
    """An agent id that comes before ``reader`` in the zone's seed order
    (``planner.relay_share``: by CRC-32), so ``reader`` is not the seed."""
    return next(f"seed{i}" for i in range(100) if zlib.crc32(f"seed{i}".encode()) < zlib.crc32(reader.encode()))


class PeerJoinsLater(Plane):
    """First resolve (with its lease): the trainer in zone a and the zone's seed
    in zone b, which holds nothing yet. Every later one: also ``late``, a
    reader of zone b that joined meanwhile and has landed every chunk."""

    def __init__(self, manifest: Manifest, trainer: RemoteReplica, seed: RemoteReplica, late: RemoteReplica):
        super().__init__(manifest, (trainer, seed, late))
        self.trainer, self.seed, self.late = trainer, seed, late
        self.resolves = 0
        self.refused: list[str] = []

    def _listed(self) -> tuple[RemoteReplica, ...]:
        return (self.trainer, self.seed) if self.resolves <= 1 else (self.trainer, self.seed, self.late)

    def resolve(self, agent_id, model, version, *, group="", group_round=0, lease=False, **_wait):
        self.resolves += 1
        return Resolved(model, 1, self.manifest, self._listed(), lease_id=f"upfront{self.resolves}",
                        lease_ttl_s=60.0, lease_sent_at=time.monotonic())

    def acquire_lease(self, agent_id, replica_ids):
        live = {r.source.replica_id for r in self._listed()}
        self.refused += [rid for rid in replica_ids if rid not in live]
        return "lease", [rid for rid in replica_ids if rid in live], 60.0


def test_a_waiting_reader_leases_the_peer_it_learned_of_later_and_relays_from_it():
    weights = torch.arange(CHUNKS * CHUNK // 4, dtype=torch.int32)
    late_copy, seed_memory = weights.clone(), torch.zeros_like(weights)
    manifest = Manifest.of({"w": weights})
    reader = "reader"
    seed = _seed_before(reader)
    plane = PeerJoinsLater(manifest, _holder("trainer", weights, "a", complete=True),
                           _holder(seed, seed_memory, "b", complete=False),
                           _holder("late", late_copy, "b", complete=False, chunks_held=CHUNKS))
    dest = torch.zeros_like(weights)
    _, mem = regions_of([dest])
    spec = manifest.tensors[0]
    parts = [ReadPart("w", 0, spec.shape, Region().runs(spec.shape), itemsize(spec.dtype), mem[0])]
    transport = SlowMemcpy()
    PullJob(rpc=plane, nixl=transport, agent_id=reader, labels=Labels(reader, "", "b"),
            resolved=plane.resolve(reader, "m", 1), layout=ReadLayout(manifest, parts, CHUNK),
            dest_kind=MemoryKind.DRAM, in_flight=4, chunk_timeout_s=5, deadline=time.monotonic() + 30).run()
    assert torch.equal(dest, weights)
    assert plane.refused == [], f"leased holders the server did not list: {plane.refused}"
    # Every byte from the peer of its own zone; before, the peer counted as
    # withdrawn and the reader, its patience spent, read across from the trainer.
    assert transport.read == {"late": weights.numel() * 4}, transport.read
