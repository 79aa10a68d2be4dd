"""``tensorhub bench pull --layout moe --reader-slice tp8 --trainer-cut``: the
layer of ``bench.moe`` (``bench.moe_layout``), its P row-sharded publishers now
trainer ranks of one gloo group that also publish the reader's cut
(``Hub.publish(cut="readers")``, ``client/trainercut.py``):

1. version 1, shards only (nobody reads yet, so nothing is cut); a relay in the
   reader process pulls its TP rank 0 of 8 slice with ``serve=True``: the read
   set the trainer learns from the server;
2. version 2 from the same buffers, with the cut: each rank gathers its share
   of the slice's tensors from the others' rows and publishes the slice's
   regions back to back. Its cost (``CutReport``: seconds, bytes published,
   peak gather bytes) is reported per rank;
3. rows of one run, methods alternating within each repetition:

   * ``tensorhub-cut``: a fresh reader Hub's ``pull`` of version 2 into the
     slice's tensors (it reads the cut: exactly its bytes);
   * ``nixl-raw-cut``: a raw NIXL READ of each rank's cut buffer whole, one
     descriptor per rank, into one buffer (no server, no chunks, no checks).

The goal: the reader within 0.9x of the raw READ of the same bytes (raw
seconds / tensorhub seconds >= 0.9). Every method's bytes are compared with
the expected slice (the raw row region by region, in the cut's order).

    rank 0..P-1 (gloo) ── rows + its share of the cut ──┐
    reference server ◀── publish / reader cuts / resolve ├── reader: relay of v1, pulls v2
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

from rich.progress import Progress

from tensorhub import processes
from tensorhub.bench import children
from tensorhub.bench.moe import MODEL, _full, _wanted, rank_shards
from tensorhub.bench.moe_layout import MoeBenchConfig, tensors
from tensorhub.bench.report import Row, print_table, write_json

METHODS = ("tensorhub-cut", "nixl-raw-cut")
_TIMEOUT_S = 120.0


def _rank(conn, address: str, cfg: MoeBenchConfig, rank: int, env: dict[str, str]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from tensorhub import Hub
    from tensorhub.transport.nixl import new_agent

    torch.set_num_threads(1)
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(cfg.publishers))
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    _buffer, held, manifest = rank_shards(cfg, rank)  # the buffer stays alive with the shards' views
    raw = None
    with Hub.connect(address, name=f"rank-{rank}", chunk_size=cfg.chunk_size, verify_chunks=cfg.verify) as hub:
        pub = hub.publish(MODEL, 1, held, manifest=manifest, cut="readers")  # no readers yet: the shards only
        conn.send(pub.cut is None)
        assert conn.recv() == "cut"
        pub.unpublish(timeout=60)
        pub = hub.publish(MODEL, 2, held, manifest=manifest, cut="readers")
        report = dataclasses.asdict(pub.cut_report)
        if pub.cut is None:
            conn.send((report, None, 0, 0, []))
        else:
            parts = pub.cut.parts
            base = min(p.tensor.data_ptr() for p in parts)
            end = max(p.tensor.data_ptr() + p.nbytes for p in parts)
            raw = new_agent(f"raw-cut-rank-{rank}-{os.getpid()}")  # configured as the hub's agents are
            raw.register_memory([(base, end - base, 0, "")], "DRAM")
            layout = [(p.name, p.tensor.data_ptr() - base, p.nbytes) for p in parts]
            conn.send((report, raw.get_agent_metadata(), base, end - base, layout))
        assert conn.recv() == "stop"
        pub.unpublish(timeout=60)
    dist.destroy_process_group()


class _RawCut:
    """One raw NIXL READ of each rank's cut buffer whole (one descriptor each), into ``dest``."""

    def __init__(self, infos: list, timeout_s: float) -> None:
        import numpy as np
        import torch

        from tensorhub.transport.nixl import new_agent

        self.timeout_s = timeout_s
        self.infos = [i for i in infos if i[1] is not None]
        self.dest = torch.zeros(sum(n for _, _, _, n, _ in self.infos), dtype=torch.uint8)
        self.agent = new_agent(f"raw-cut-reader-{os.getpid()}")
        self.agent.register_memory([(self.dest.data_ptr(), self.dest.numel(), 0, "")], "DRAM")
        self.peers, self.lists, at = [], [], 0
        for _, metadata, base, nbytes, _ in self.infos:
            peer = self.agent.add_remote_agent(metadata)
            self.peers.append(peer.decode() if isinstance(peer, bytes) else peer)
            self.lists.append((self.agent.get_xfer_descs(np.array([[self.dest.data_ptr() + at, nbytes, 0]], np.uint64),
                                                         "DRAM"),
                               self.agent.get_xfer_descs(np.array([[base, nbytes, 0]], np.uint64), "DRAM")))
            at += nbytes

    def read(self) -> None:
        from tensorhub.bench.moe_raw import wait_reads  # torch and numpy only where the bench runs

        wait_reads(self.agent, [self.agent.initialize_xfer("READ", local, remote, peer)
                                for (local, remote), peer in zip(self.lists, self.peers)], self.timeout_s)

    def matches(self, expected, at_of: dict[str, tuple[int, int]]) -> bool:
        """Each cut region's bytes, where the raw READ put them, against the slice's."""
        import torch

        start = 0
        for _, _, _, nbytes, layout in self.infos:
            for name, offset, n in layout:
                want_at, want_n = at_of[name]
                got = self.dest[start + offset: start + offset + n]
                if n != want_n or not torch.equal(got, expected[want_at: want_at + n]):
                    return False
            start += nbytes
        return True

    def close(self) -> None:
        for peer in self.peers:
            self.agent.remove_remote_agent(peer)


def _reader(conn, address: str, cfg: MoeBenchConfig) -> None:
    import torch

    from tensorhub import Hub, Shard

    torch.set_num_threads(1)
    specs = tensors(cfg)
    regions = [_wanted(cfg, shape, how) for _, shape, how in specs]
    sizes = [r.numel(shape) * 2 for r, (_, shape, _) in zip(regions, specs)]
    expected = torch.cat([Shard.of(_full(i, shape), box=r.box).tensor.reshape(-1).view(torch.uint8)
                          for i, ((_, shape, _), r) in enumerate(zip(specs, regions))])

    def slice_into(dest: torch.Tensor) -> dict:
        into, at = {}, 0
        for (name, shape, _), region, nbytes in zip(specs, regions, sizes):
            local = dest[at: at + nbytes].view(torch.bfloat16).view(region.local_shape(shape))
            into[name] = Shard(local, shape, box=region.box)
            at += nbytes
        return into

    at_of, at = {}, 0
    for (name, _, _), nbytes in zip(specs, sizes):
        at_of[name] = (at, nbytes)
        at += nbytes
    dest, relayed = torch.zeros(sum(sizes), dtype=torch.uint8), torch.zeros(sum(sizes), dtype=torch.uint8)
    into = slice_into(dest)
    with (Hub.connect(address, name="relay", read_workers=cfg.read_workers, verify_chunks=cfg.verify) as relay,
          Hub.connect(address, name="reader", read_workers=cfg.read_workers, verify_chunks=cfg.verify) as hub):
        # The relay: version 1's reader that serves it, whose read set the trainer cuts next.
        result = relay.pull(MODEL, 1, into=slice_into(relayed), serve=True)
        conn.send(("relayed", dest.numel(), torch.equal(relayed, expected), result.read_bytes))
        cmd, infos = conn.recv()
        raw = _RawCut(infos, _TIMEOUT_S)
        conn.send("ready")
        while True:
            cmd, check = conn.recv()
            if cmd == "stop":
                break
            if cmd == "tensorhub-cut":
                dest.zero_()
                start = time.perf_counter()
                result = hub.pull(MODEL, 2, into=into)
                seconds = time.perf_counter() - start
                ok = not check or torch.equal(dest, expected)
                read, descriptors, sources = result.read_bytes, result.descriptors, dict(result.bytes_by_source)
            else:
                raw.dest.zero_()
                start = time.perf_counter()
                raw.read()
                seconds = time.perf_counter() - start
                ok = not check or raw.matches(expected, at_of)
                read, descriptors, sources = raw.dest.numel(), len(raw.lists), {}
            conn.send((seconds, ok, read, descriptors, sources))
        raw.close()


def run(cfg: MoeBenchConfig, *, json_path: str | None = None, quiet: bool = False) -> list[Row]:
    """Run the benchmark; returns its rows (also printed, and written to ``json_path``)."""
    from tensorhub.local.ports import rendezvous
    from tensorhub.server import EmbeddedServer

    if cfg.publishers < 2:
        raise ValueError("--trainer-cut: the cut is gathered over the trainer ranks: --publishers must be >= 2")
    ctx = processes.context()
    rows: list[Row] = []
    with (EmbeddedServer() as server, rendezvous(cfg.publishers) as env,
          Progress(disable=quiet, transient=True) as progress):
        task = progress.add_task("starting processes", total=(cfg.warmup + cfg.reps) * len(METHODS))
        rank_conns, ranks = children.start(ctx, _rank, [(server.address, cfg, r, env) for r in range(cfg.publishers)])
        if not all(children.receive(rank_conns, 180, "a trainer rank did not publish version 1")):
            raise RuntimeError("version 1 was cut: nobody read the model yet")
        conns, procs = children.start(ctx, _reader, [(server.address, cfg)])
        _, requested, relayed_ok, _ = children.receive(conns, 300, "the relay did not pull version 1")[0]
        if not relayed_ok:
            raise RuntimeError("the relay received wrong bytes of version 1")
        progress.update(task, description="the trainer ranks cut version 2")
        for conn in rank_conns:
            conn.send("cut")
        infos = children.receive(rank_conns, 300, "a trainer rank did not publish version 2 with its cut")
        reports = [info[0] for info in infos]
        conns[0].send(("cut", infos))
        children.receive(conns, 120, "the reader did not connect to the cut holders")
        samples: dict[str, list[float]] = {m: [] for m in METHODS}
        reads: dict[str, tuple] = {}
        for rep in range(cfg.warmup + cfg.reps):
            for method in METHODS if rep % 2 == 0 else METHODS[::-1]:
                progress.update(task, description=f"{method} rep {rep + 1 - cfg.warmup}" if rep >= cfg.warmup
                                else f"{method} warm-up (bytes checked)")
                conns[0].send((method, rep < cfg.warmup or rep == cfg.warmup + cfg.reps - 1))
                seconds, ok, read, descriptors, sources = children.receive(conns, 300,
                                                                           f"the reader did not finish {method}")[0]
                if not ok:
                    raise RuntimeError(f"{method}: the reader received wrong bytes")
                reads[method] = (read, descriptors, sources)
                if rep >= cfg.warmup:
                    samples[method].append(seconds)
                progress.advance(task)
        children.stop(conns[:1], ("stop", False), rank_conns, [*procs, *ranks])
    shape = {"layout": "moe", "reader_slice": f"tp{cfg.tp}", "publishers": cfg.publishers,
             "requested_bytes": requested, "experts": cfg.experts}
    for method, values in samples.items():
        read, descriptors, sources = reads[method]
        rows.append(Row.of(method, 1, requested, values, **shape, read_bytes=read, descriptors=descriptors,
                           sources=sources))
    by = {r.method: r for r in rows}
    paired = [raw / th for th, raw in zip(samples["tensorhub-cut"], samples["nixl-raw-cut"])]
    cut = {"raw_vs_tensorhub": by["nixl-raw-cut"].seconds / by["tensorhub-cut"].seconds,
           "raw_vs_tensorhub_paired": statistics.median(paired),
           "cut_seconds": max(r["seconds"] for r in reports),
           "cut_bytes": [r["nbytes"] for r in reports],
           "cut_peak_gather_bytes": [r["peak_gather_bytes"] for r in reports],
           "cut_tensors_gathered": [r["tensors"] for r in reports],
           "cut_from_version": reports[0]["from_version"]}
    if not quiet:
        print_table(f"pull the TP rank 0 of {cfg.tp} slice of a Qwen3-30B-A3B MoE layer ({cfg.experts} experts): "
                    f"{requested:,} bytes from the cut of {cfg.publishers} row-sharded trainer ranks, "
                    f"median of {cfg.reps}", rows, {"tensorhub-cut": "nixl-raw-cut"})
        for row in rows:
            print(f"  {row.method}: {row.extra['read_bytes']:,} bytes read in {row.extra['descriptors']:,} descriptors")
        print(f"tensorhub-cut vs a raw contiguous READ of the same bytes: {cut['raw_vs_tensorhub']:.2f}x "
              f"({cut['raw_vs_tensorhub_paired']:.2f}x paired; goal >= 0.9)")
        for r, report in enumerate(reports):
            print(f"  trainer rank {r}: cut {report['nbytes']:,} bytes ({report['regions']} regions of "
                  f"{report['tensors']} gathered tensors) in {report['seconds']:.3f} s; extra memory: those bytes "
                  f"while published, at most {report['peak_gather_bytes']:,} gathered at once")
    if json_path:
        write_json(json_path, rows, benchmark="pull", layout="moe", reader_slice=f"tp{cfg.tp}", trainer_cut=True,
                   publishers=cfg.publishers, chunk_size=cfg.chunk_size, read_workers=cfg.read_workers,
                   verify_chunks=cfg.verify, **cut)
    return rows
