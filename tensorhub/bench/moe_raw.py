"""The raw NIXL rows of ``bench pull --layout moe`` (``bench.moe``; its layer
is ``bench.moe_layout``): the same slice READ with no server, no chunks, no
checks and no plans, in the reader process. Descriptor lists are built once,
before any timing; a READ's own setup (``initialize_xfer``), its transfer and
the wait are timed.

* ``exact``: a descriptor per run (rows of gate and up are one run per
  publisher; columns of down one per row), one READ per publisher;
* ``rows``: the columns of down READ as each publisher's rows of it whole,
  one descriptor per tensor into a scratch buffer, then cut out with a numpy
  strided copy; gate and up as in ``exact``. One READ per publisher.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from tensorhub.bench.moe_layout import MoeBenchConfig, held_rows, holder_offsets, tensors


def wait_reads(agent, handles: list, timeout_s: float) -> None:
    """Post every READ of a raw NIXL agent, then wait until each is done (a
    deadline on the wait), and release them."""
    states = [agent.transfer(h) for h in handles]
    deadline = time.monotonic() + timeout_s
    while any(s != "DONE" for s in states):
        if "ERR" in states or time.monotonic() > deadline:
            raise RuntimeError(f"raw NIXL READ failed: {states}")
        states = [s if s == "DONE" else agent.check_xfer_state(h) for s, h in zip(states, handles)]
    for h in handles:
        agent.release_xfer_handle(h)


class RawReads:
    def __init__(self, cfg: MoeBenchConfig, dest: torch.Tensor, raw_infos: list, timeout_s: float) -> None:
        from tensorhub.transport.nixl import new_agent

        self.timeout_s = timeout_s
        self.dest = dest
        self.agent = new_agent(f"raw-moe-reader-{os.getpid()}")
        specs = tensors(cfg)
        spans = [(b - a) * shape[1] * 2 for _, shape, how in specs if how == "cols"
                 for a, b in (held_rows(shape, r, cfg.publishers) for r in range(cfg.publishers))]
        # The rows' spans of every publisher at once, plus room for ``probe``: touched once, before any timing.
        self.scratch = torch.ones(max(sum(spans), 64 << 20), dtype=torch.uint8)
        self.agent.register_memory([(dest.data_ptr(), dest.numel(), 0, ""),
                                    (self.scratch.data_ptr(), self.scratch.numel(), 0, "")], "DRAM")
        self._room = holder_offsets(cfg, 0)[-1]  # publisher 0's buffer: what ``probe`` may read
        self.peers, self._bases = [], []
        for metadata, base in raw_infos:
            peer = self.agent.add_remote_agent(metadata)
            self.peers.append(peer.decode() if isinstance(peer, bytes) else peer)
            self._bases.append(base)
        self._cuts = []  # (scratch offset, rows, row bytes, run bytes, destination offset) per down_proj share
        scratch_at, dest_at = 0, 0
        d0, s0 = dest.data_ptr(), self.scratch.data_ptr()
        per_rank = [([], [], [], []) for _ in raw_infos]  # exact (local, remote), rows (local, remote)
        for i, (_, shape, how) in enumerate(specs):
            row = shape[1] * 2
            for r, base in enumerate(self._bases):
                a, b = held_rows(shape, r, cfg.publishers)
                at = base + holder_offsets(cfg, r)[i]
                el, er, rl, rr = per_rank[r]
                if how == "rows":  # wanted rows 0:R/tp; this publisher's share of them is one run
                    lo, hi = max(a, 0), min(b, shape[0] // cfg.tp)
                    if lo < hi:
                        for out in (el, rl):
                            out.append([d0 + dest_at + lo * row, (hi - lo) * row, 0])
                        for out in (er, rr):
                            out.append([at + (lo - a) * row, (hi - lo) * row, 0])
                else:  # wanted columns 0:C/tp of every row: one run per row here
                    run = shape[1] // cfg.tp * 2
                    j = np.arange(a, b, dtype=np.int64)
                    size, zero = np.full(len(j), run, np.int64), np.zeros(len(j), np.int64)
                    el.extend(np.stack([d0 + dest_at + j * run, size, zero], 1).tolist())
                    er.extend(np.stack([at + (j - a) * row, size, zero], 1).tolist())
                    rl.append([s0 + scratch_at, (b - a) * row, 0])
                    rr.append([at, (b - a) * row, 0])
                    self._cuts.append((scratch_at, b - a, row, run, dest_at + a * run))
                    scratch_at += (b - a) * row
            dest_at += (shape[0] // cfg.tp * shape[1] if how == "rows" else shape[0] * shape[1] // cfg.tp) * 2
        self.runs = sum(len(el) for el, _, _, _ in per_rank)
        self.rows_read = sum(int(sum(n for _, n, _ in rr)) for _, _, _, rr in per_rank)
        self.rows_descriptors = sum(len(rr) for _, _, _, rr in per_rank)
        self._exact = [self._descs(el, er) for el, er, _, _ in per_rank]
        self._rows = [self._descs(rl, rr) for _, _, rl, rr in per_rank]

    def _descs(self, local: list, remote: list) -> tuple:
        return (self.agent.get_xfer_descs(np.array(local, np.uint64).reshape(-1, 3), "DRAM"),
                self.agent.get_xfer_descs(np.array(remote, np.uint64).reshape(-1, 3), "DRAM"))

    def _wait(self, handles: list) -> None:
        wait_reads(self.agent, handles, self.timeout_s)

    def _read(self, lists: list[tuple]) -> None:
        self._wait([self.agent.initialize_xfer("READ", local, remote, peer)
                    for (local, remote), peer in zip(lists, self.peers) if local.descCount()])

    def exact(self) -> None:
        self._read(self._exact)

    def rows(self) -> tuple[int, int]:
        """READ the rows, cut the columns; returns (bytes read, descriptors)."""
        self._read(self._rows)
        src, dst = self.scratch.numpy(), self.dest.numpy()
        for at, n, row, run, dest_at in self._cuts:
            np.copyto(dst[dest_at: dest_at + n * run].reshape(n, run), src[at: at + n * row].reshape(n, row)[:, :run])
        return self.rows_read, self.rows_descriptors

    def probes(self) -> list[tuple[int, int, int]]:
        """``transport.cost.PROBES`` cut to fit publisher 0's buffer and the scratch."""
        from tensorhub.transport.cost import PROBES

        room = min(self._room, self.scratch.numel())
        return [(max(1, min(d, room // max(stride, n))), min(n, room), stride) for d, n, stride in PROBES]

    def probe(self, descriptors: int, nbytes: int, stride: int) -> float:
        """One READ of ``descriptors`` runs of ``nbytes``, ``stride`` apart in
        publisher 0's buffer, into scratch: ``transport.cost.measure``'s probe."""
        i = np.arange(descriptors, dtype=np.uint64)
        size = np.full(descriptors, nbytes, np.uint64)
        zero = np.zeros(descriptors, np.uint64)
        local = self.agent.get_xfer_descs(np.stack([self.scratch.data_ptr() + i * nbytes, size, zero], 1), "DRAM")
        remote = self.agent.get_xfer_descs(np.stack([self._bases[0] + i * stride, size, zero], 1), "DRAM")
        start = time.perf_counter()
        self._wait([self.agent.initialize_xfer("READ", local, remote, self.peers[0])])
        return time.perf_counter() - start

    def close(self) -> None:
        for peer in self.peers:
            self.agent.remove_remote_agent(peer)
