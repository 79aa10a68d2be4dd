"""A relaying reader serves its checked chunks while it waits for its peers'.

Found by ``tensorhub bench rl scenario=elastic``: three joiners relaying one
version each read their share of the chunks, then waited for the others'
shares. A chunk is served (reported to the server) only once its checksum
check is done, on a helper thread; the checks that finished while the reader
waited were collected only by the next round of READs, which came when its
patience (1 s) ran out. Every reader held back the last chunks of its share
while its peers waited for them: a wave of joiners stalled about 1 s per round.

The control plane and the peer are fakes (a peer that holds one chunk and
never gets further); the bytes move for real, with memmove, and the checks
are real CRC-32s, slowed so that some are still running when the reader's
own share has landed."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

from tensorhub.client import verify
from tensorhub.client.puller import PullJob
from tensorhub.client.readlayout import ReadLayout, ReadPart
from tensorhub.client.rpc import RemoteReplica, Resolved
from tensorhub.integrity import chunk_checksums
from tensorhub.manifest import Manifest, itemsize
from tensorhub.pacing import PATIENCE_S
from tensorhub.planner import Source
from tensorhub.regions import Region
from tensorhub.testing import GrantingLeases
from tensorhub.topology import Labels, Reliability
from tensorhub.transport import MemoryKind
from tensorhub.transport.memory import regions_of

CHUNK = 4096
CHUNKS = 32
CHECK_S = 0.005  # one chunk's check: the last few are still running when the share has landed


class Memcpy:
    """READs are memmoves; records when each destination chunk landed."""

    def __init__(self, base: int) -> None:
        self.base, self.landed_at = base, {}

    connect = staticmethod(lambda key, metadata, regions=None: key)
    poll = staticmethod(lambda pending: True)  # done when posted
    release = forget = staticmethod(lambda _: None)

    def post(self, remote, local, local_kind, remote_descs, remote_kind):
        for (dst, n, _), (src, _, _) in zip(local.tolist(), remote_descs.tolist()):
            ctypes.memmove(dst, src, n)
            self.landed_at.setdefault((dst - self.base) // CHUNK, time.monotonic())


class Plane(GrantingLeases):
    """The trainer (complete) and one filling peer that holds chunk 0 only."""

    def __init__(self, manifest: Manifest, replicas: tuple[RemoteReplica, ...]) -> None:
        self.manifest, self.replicas = manifest, replicas

    def resolve(self, agent_id, model, version, *, group="", group_round=0, lease=False, **_wait):
        return Resolved(model, 1, self.manifest, self.replicas)


def _replica(rid: str, tensor: torch.Tensor, *, complete: bool) -> RemoteReplica:
    _, mem = regions_of([tensor])
    regions = np.array([(m.addr, m.size, 0) for m in mem], np.uint64).reshape(-1, 3)
    source = Source(rid, rid, Labels(rid), origin=complete, complete=complete,
                    reliability=Reliability.RELIABLE if complete else Reliability.SPOT)
    return RemoteReplica(source, rid, MemoryKind.DRAM, ((0, Region()),), regions, b"", CHUNK,
                         bitmap=b"" if complete else b"\x01", chunk_crc32=chunk_checksums([tensor], CHUNK))


def test_checked_chunks_are_served_while_waiting_for_peers(monkeypatch):
    join = verify._join  # each holder chunk's check, slowed down
    monkeypatch.setattr(verify, "_join", lambda parts: (time.sleep(CHECK_S), join(parts))[1])
    weights = torch.arange(CHUNKS * CHUNK // 4, dtype=torch.int32)
    manifest = Manifest.of({"w": weights})
    peer_copy = weights.clone()  # the peer's memory: referenced for the whole pull
    plane = Plane(manifest, (_replica("trainer", weights, complete=True),
                             _replica("peer", peer_copy, complete=False)))
    dest = torch.zeros_like(weights)
    _, mem = regions_of([dest])
    spec = manifest.tensors[0]
    parts = [ReadPart("w", 0, spec.shape, Region().runs(spec.shape), itemsize(spec.dtype), mem[0])]
    transport = Memcpy(mem[0].addr)
    reported: dict[int, float] = {}

    def landed(chunks: list[int]) -> None:
        for c in chunks:
            reported.setdefault(c, time.monotonic())

    job = PullJob(rpc=plane, nixl=transport, agent_id="reader", labels=Labels("reader"),
                  resolved=plane.resolve("reader", "m", 1), layout=ReadLayout(manifest, parts, CHUNK),
                  dest_kind=MemoryKind.DRAM, in_flight=4, chunk_timeout_s=5, deadline=time.monotonic() + 30,
                  landed=landed)
    job.run()
    assert torch.equal(dest, weights)
    assert set(reported) == set(range(CHUNKS))
    # The peer never brought its share: the reader waited its patience for it,
    # then read it itself (the chunks that landed after the wait).
    first = min(transport.landed_at.values())
    share = [c for c, at in transport.landed_at.items() if at < first + PATIENCE_S / 2]
    assert 0 < len(share) < CHUNKS - 1, "the peer's share was not left to it"
    late = {c: round(reported[c] - transport.landed_at[c], 3) for c in share
            if reported[c] - transport.landed_at[c] > PATIENCE_S / 2}
    assert not late, f"chunks of the reader's own share served only after its patience ran out: {late}"
