"""While a wave of readers relays across zones, a reader keeps one READ at a
time on a complete holder's link; in one zone (a chain) it keeps
``CHAIN_READS_PER_HOLDER`` on the peer before it and none on the trainer.

Every reader of the wave shares that holder's link: with all of each
reader's READs on it, every chunk lands late (they share the link and finish
together), and the peers wait longer before they can relay it. Raw NIXL with
a lag-free relay (``tensorhub bench cluster --readers 3``, its
``nixl-raw-relay`` row, ``bench.rawrelay``) took 2.67-2.69 s with one READ
per reader on the trainer's link and 2.97-3.10 s with every slot;
``tensorhub bench rl scenario=elastic`` went from 3.25 s to 2.96-3.05 s joins.
A reader alone keeps every slot on it.

The control plane is a fake: a peer filling the same version lands 8 more
chunks at each resolve (and, for a wave across zones, a reader of another
zone fills it too, with nothing landed). Bytes move for real (memmove) and are checked."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

from tensorhub import schedule
from tensorhub.client.puller import PullJob
from tensorhub.client.readlayout import ReadLayout, ReadPart
from tensorhub.client.rpc import RemoteReplica, Resolved
from tensorhub.manifest import Manifest, itemsize
from tensorhub.planner import Source
from tensorhub.regions import Region
from tensorhub.schedule import CHAIN_READS_PER_HOLDER, chain_order
from tensorhub.testing import GrantingLeases
from tensorhub.topology import Labels, Reliability
from tensorhub.transport import MemoryKind
from tensorhub.transport.memory import regions_of

CHUNK = 4096
CHUNKS = 64
POLLS = 3  # a READ is done at its third poll: several are in flight at once


class CountingMemcpy:
    """READs are memmoves that report done a few polls later; counts the READs
    in flight per holder and the most seen at once."""

    def __init__(self) -> None:
        self.flying: dict[str, int] = {}
        self.most: dict[str, int] = {}

    def connect(self, key: str, metadata: bytes, regions: object = None) -> str:
        return key

    def post(self, remote, local, local_kind, remote_descs, remote_kind):
        for (dst, n, _), (src, _, _) in zip(local.tolist(), remote_descs.tolist()):
            ctypes.memmove(dst, src, n)
        self.flying[remote] = self.flying.get(remote, 0) + 1
        self.most[remote] = max(self.most.get(remote, 0), self.flying[remote])
        return [remote, POLLS]

    def poll(self, pending) -> bool:
        pending[1] -= 1
        if pending[1] == 0:
            self.flying[pending[0]] -= 1
        return pending[1] <= 0

    def release(self, pending) -> None:
        """Nothing to release: ``post`` copied the bytes at once, with no handle."""

    def forget(self, key: str) -> None:
        """Nothing to forget: ``connect`` loaded no metadata."""


class Wave(GrantingLeases):
    """The server's view: the trainer holds the version; a peer (when there is
    one) fills it, 8 chunks more at every resolve."""

    def __init__(self, manifest: Manifest, trainer: torch.Tensor, peer: torch.Tensor | None,
                 far: torch.Tensor | None = None) -> None:
        self.manifest, self.trainer, self.peer, self.far = manifest, trainer, peer, far
        self.landed = 0

    def _replica(self, rid: str, tensor: torch.Tensor, complete: bool, zone: str = "", landed: int = -1) -> RemoteReplica:
        _, mem = regions_of([tensor])
        regions = np.array([(m.addr, m.size, 0) for m in mem], np.uint64).reshape(-1, 3)
        bits = np.zeros(CHUNKS, np.uint8)
        bits[: self.landed if landed < 0 else landed] = 1
        source = Source(rid, rid, Labels(rid, zone=zone), origin=complete, complete=complete,
                        reliability=Reliability.RELIABLE if complete else Reliability.SPOT)
        return RemoteReplica(source, rid, MemoryKind.DRAM, ((0, Region()),), regions, b"", CHUNK,
                             bitmap=b"" if complete else np.packbits(bits, bitorder="little").tobytes())

    def resolve(self, agent_id, model, version, *, group="", group_round=0, lease=False, **_wait):
        replicas = [self._replica("trainer", self.trainer, True)]
        if self.peer is not None:
            replicas.append(self._replica("peer", self.peer, False))
            self.landed = min(CHUNKS, self.landed + 8)
        if self.far is not None:
            replicas.append(self._replica("far", self.far, False, zone="z1", landed=0))
        return Resolved(model, 1, self.manifest, tuple(replicas))


def _pull(with_peer: bool, zones: int = 1) -> CountingMemcpy:
    weights = torch.arange(CHUNKS * CHUNK // 4, dtype=torch.int32)
    manifest = Manifest.of({"w": weights})
    plane = Wave(manifest, weights, weights.clone() if with_peer else None,
                 torch.zeros_like(weights) if zones > 1 else None)
    dest = torch.zeros_like(weights)
    _, mem = regions_of([dest])
    spec = manifest.tensors[0]
    parts = [ReadPart("w", 0, spec.shape, Region().runs(spec.shape), itemsize(spec.dtype), mem[0])]
    transport = CountingMemcpy()
    PullJob(rpc=plane, nixl=transport, agent_id="reader", labels=Labels("reader"),
            resolved=plane.resolve("reader", "m", 1), layout=ReadLayout(manifest, parts, CHUNK),
            dest_kind=MemoryKind.DRAM, in_flight=4, chunk_timeout_s=5, deadline=time.monotonic() + 30,
            landed=lambda chunks: None).run()
    assert torch.equal(dest, weights)
    return transport


def test_a_relaying_reader_keeps_one_read_on_the_complete_holder():
    transport = _pull(with_peer=True, zones=2)
    assert transport.most.get("trainer", 0) == 1, transport.most
    assert transport.most.get("peer", 0) >= 2, f"the other slots stayed empty: {transport.most}"


def test_in_one_zone_a_reader_chains_behind_its_peer_with_few_reads_on_it(monkeypatch):
    monkeypatch.setattr(schedule, "CHAIN_MIN_READERS", 2)  # a chain of two (real ones are longer)
    assert chain_order(["reader", "peer"]) == ["peer", "reader"]  # the peer is before it in the chain
    transport = _pull(with_peer=True)
    assert transport.most == {"peer": CHAIN_READS_PER_HOLDER}, transport.most


def test_in_a_short_wave_of_one_zone_the_reader_shares_instead():
    transport = _pull(with_peer=True)  # two readers: fewer than CHAIN_MIN_READERS
    assert transport.most.get("trainer", 0) == 1, transport.most


def test_a_reader_alone_keeps_every_slot_on_it():
    assert _pull(with_peer=False).most["trainer"] == 4
