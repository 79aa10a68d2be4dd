"""``tensorhub bench pull``: P publisher processes (a trainer's ranks, each
holding its rows of every tensor), R reader processes, and the same bytes moved
two ways in the same run:

* ``nixl-raw``: each reader READs the bytes it needs straight out of the
  publishers' buffers, one descriptor per publisher, all in flight at once (no
  server, no chunks, no regions): the best NIXL alone can do here;
* ``tensorhub``: each reader pulls the version through the hub into
  preallocated tensors: whole tensors, or with ``--reader-slice tp2`` the TP
  rank 0 of 2 slice (rows of half the matrices, columns of the other half);
* ``tensorhub-unchecked``: the same pull with chunk checksums off
  (``HubConfig.verify_chunks=False``, a second Hub in the reader): what the
  checks cost. ``--no-verify`` turns them off in the ``tensorhub`` row instead;
* ``nixl-raw-pieces`` and ``nixl-raw-pieces-crc`` (with the checks on): raw
  NIXL READs cut like a checked pull's (``verify.READ_PIECE_BYTES``), one at
  a time, the second with each landed piece's CRC taken on a helper thread:
  what reading the bytes once more costs on this machine whoever does it, the
  floor under the checks' cost.

Methods alternate within each repetition so machine noise hits both alike.
A last row measures the latency of pulling a 4 KiB single-tensor version.

    publisher 0..P-1 ── own rows, registered in place ──┐
                                                        ├── nixl-raw: READ the same byte count
    reference server ◀── publish shards / resolve ──────┤
                                                        └── tensorhub: pull whole / tp2 into views
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import NamedTuple

from rich.progress import Progress

from tensorhub import processes
from tensorhub.bench import children
from tensorhub.bench.moe_raw import wait_reads
from tensorhub.bench.report import Row, print_table, write_json

MODEL, SMALL = "bench/model", "bench/small"
SMALL_BYTES = 4096
SLICES = ("whole", "tp2")


@dataclass(kw_only=True, slots=True)
class PullBenchConfig:
    size: int = 1 << 30
    readers: int = 1
    publishers: int = 1
    reader_slice: str = "whole"  # or "tp2": TP rank 0 of 2
    reps: int = 5
    warmup: int = 1
    latency_pulls: int = 50
    chunk_size: int = 32 << 20
    read_workers: int = 2
    verify: bool = True  # chunk checksums on in the tensorhub row (and a tensorhub-unchecked row beside it)

    def __post_init__(self) -> None:
        if self.reader_slice not in SLICES:
            raise ValueError(f"reader slice {self.reader_slice!r} is not one of {', '.join(SLICES)}")
        if self.publishers < 1 or self.readers < 1:
            raise ValueError("--publishers and --readers must be >= 1")


def _model(size: int):
    from tensorhub.bench.payload import layout, pattern, shaped, views

    return shaped(views(pattern(size, seed=1).clone(), layout(size)))


def _publisher(conn, address: str, cfg: PullBenchConfig, rank: int) -> None:
    import torch

    from tensorhub import Hub, Manifest, Shard
    from tensorhub.bench.payload import row_region
    from tensorhub.transport.nixl import new_agent

    torch.set_num_threads(1)
    full = _model(cfg.size)
    manifest = Manifest.of(full)
    if cfg.publishers == 1:  # the whole model in one buffer, as a single trainer holds it
        tensors: dict = full
        own = next(iter(full.values())).untyped_storage()
        own_addr, own_bytes = own.data_ptr(), cfg.size
    else:  # this rank's rows of every tensor, back to back in its own buffer
        regions = {n: row_region(tuple(t.shape), rank, cfg.publishers) for n, t in full.items()}
        regions = {n: r for n, r in regions.items() if r is not None}
        sizes = {n: r.numel(tuple(full[n].shape)) * full[n].element_size() for n, r in regions.items()}
        buffer = torch.empty(sum(sizes.values()), dtype=torch.uint8)
        tensors, offset = {}, 0
        for name, region in regions.items():
            t = full[name]
            src = Shard.of(t, box=region.box, flat=region.flat)
            local = buffer[offset: offset + sizes[name]].view(t.dtype).view(src.tensor.shape)
            local.copy_(src.tensor)
            tensors[name] = Shard(local, tuple(t.shape), box=region.box, flat=region.flat)
            offset += sizes[name]
        del full, src, t  # nothing may keep the whole model alive in this process
        own_addr, own_bytes = buffer.data_ptr(), buffer.numel()
    raw = new_agent(f"raw-pub-{rank}-{os.getpid()}")  # configured as the hub's agents are
    raw.register_memory([(own_addr, own_bytes, 0, "")], "DRAM")
    with Hub.connect(address, name=f"publisher-{rank}", chunk_size=cfg.chunk_size, verify_chunks=cfg.verify) as hub:
        hub.publish(MODEL, 1, tensors, manifest=manifest)
        if rank == 0:
            hub.publish(SMALL, 1, {"x": torch.ones(SMALL_BYTES // 4)})
        conn.send((raw.get_agent_metadata(), own_addr, own_bytes))
        conn.recv()  # stop


def _destination(cfg: PullBenchConfig):
    """(flat buffer, into, expected bytes) for this reader's slice."""
    import torch

    from tensorhub import Shard
    from tensorhub.bench.payload import layout, tp_region, views

    full = _model(cfg.size)
    if cfg.reader_slice == "whole":
        flat = torch.zeros(cfg.size, dtype=torch.uint8)
        return flat, {n: v.view(full[n].shape) for n, v in views(flat, layout(cfg.size)).items()}, None
    wanted = {n: tp_region(tuple(t.shape), i, 0, 2) for i, (n, t) in enumerate(full.items())}
    pieces = {n: Shard.of(full[n], box=r.box, flat=r.flat).tensor for n, r in wanted.items()}
    expected = torch.cat([p.reshape(-1).view(torch.uint8) for p in pieces.values()])
    flat = torch.zeros_like(expected)
    into, offset = {}, 0
    for name, piece in pieces.items():
        nbytes = piece.numel() * piece.element_size()
        local = flat[offset: offset + nbytes].view(piece.dtype).view(piece.shape)
        into[name] = Shard(local, tuple(full[name].shape), box=wanted[name].box, flat=wanted[name].flat)
        offset += nbytes
    return flat, into, expected


class Timed(NamedTuple):
    """A reader's answer to one timed pull."""

    start: float  # time.monotonic() when it began
    end: float
    ok: bool  # the bytes matched (checked on the verify rounds only)
    read_bytes: int  # every byte its READs landed (PullResult.read_bytes)


def _reader(conn, address: str, cfg: PullBenchConfig, raw_infos: list, index: int) -> None:
    import torch

    from tensorhub import Hub
    from tensorhub.bench.payload import pattern
    from tensorhub.client.inorder import InOrderWorker
    from tensorhub.client.verify import READ_PIECE_BYTES, crcs_in_place
    from tensorhub.transport.nixl import new_agent

    torch.set_num_threads(1)
    dest, into, expected = _destination(cfg)  # touched once, reused: no page faults in the timing
    if expected is None:
        expected = pattern(cfg.size, seed=1)
    small = {"x": torch.zeros(SMALL_BYTES // 4)}
    raw = new_agent(f"raw-reader-{index}-{os.getpid()}")
    raw.register_memory(dest)
    # Raw NIXL moves the same byte count: the same share of every publisher's buffer.
    requested, offset, reads, shares = dest.numel(), 0, [], []
    for i, (metadata, addr, nbytes) in enumerate(raw_infos):
        share = requested - offset if i == len(raw_infos) - 1 else nbytes * requested // cfg.size
        remote = raw.add_remote_agent(metadata)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        reads.append((raw.get_xfer_descs([(dest.data_ptr() + offset, share, 0)], "DRAM"),
                      raw.get_xfer_descs([(addr, share, 0)], "DRAM"), remote))
        shares.append((dest.data_ptr() + offset, addr, share, remote))
        offset += share
    exact_raw = len(raw_infos) == 1 and cfg.reader_slice == "whole"  # raw bytes land where tensorhub's do

    def finish(handles: list) -> None:
        wait_reads(raw, handles, 60)

    def raw_read() -> None:
        finish([raw.initialize_xfer("READ", local, remote, peer) for local, remote, peer in reads])

    crc_worker = InOrderWorker("bench-crc")  # the checks' own helper thread: the same hand-off per piece

    def raw_pieces(check: bool) -> None:
        # A checked pull's shape over shared memory without TensorHub: one READ
        # per piece, the next posted once the last landed, and (``check``) each
        # landed piece's CRC taken on a helper thread while the next is copied.
        # The gap between the two is what reading the bytes once more costs
        # here, whoever does it: the floor for the chunk checks' cost.
        jobs = []
        for local_addr, remote_addr, share, peer in shares:
            for at in range(0, share, READ_PIECE_BYTES):
                n = min(READ_PIECE_BYTES, share - at)
                finish([raw.initialize_xfer("READ", raw.get_xfer_descs([(local_addr + at, n, 0)], "DRAM"),
                                            raw.get_xfer_descs([(remote_addr + at, n, 0)], "DRAM"), peer)])
                if check:
                    jobs.append(crc_worker.submit(crcs_in_place, [local_addr + at], [n]))  # as a check does
        crc_worker.wait(jobs, 60)
        for job in jobs:
            job.result()  # raises if one did not run within the minute

    with (Hub.connect(address, name=f"reader-{index}", read_workers=cfg.read_workers, verify_chunks=cfg.verify) as hub,
          Hub.connect(address, name=f"reader-{index}-unchecked", read_workers=cfg.read_workers,
                      verify_chunks=False) as unchecked):
        conn.send(("ready", requested))
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            if cmd == "latency":
                samples = []
                for _ in range(arg):
                    t0 = time.perf_counter()
                    hub.pull(SMALL, into=small)
                    samples.append(time.perf_counter() - t0)
                conn.send(samples)
                continue
            dest.zero_() if cmd.startswith("verify") else None
            while time.monotonic() < arg:  # common start instant for all readers
                time.sleep(0.0005)
            start = time.monotonic()
            if cmd in ("nixl-raw", "verify-raw"):
                raw_read()
                read = requested
            elif cmd in ("nixl-raw-pieces", "nixl-raw-pieces-crc"):
                raw_pieces(check=cmd.endswith("-crc"))
                read = requested
            else:
                read = (unchecked if cmd == "tensorhub-unchecked" else hub).pull(MODEL, 1, into=into).read_bytes
            end = time.monotonic()
            ok = torch.equal(dest, expected) if cmd == "verify" or (cmd == "verify-raw" and exact_raw) else True
            conn.send(Timed(start, end, ok, read))
    crc_worker.close()


def run(cfg: PullBenchConfig, *, json_path: str | None = None, quiet: bool = False) -> list[Row]:
    """Run the benchmark; returns its rows (also printed, and written to ``json_path``)."""
    from tensorhub.server import EmbeddedServer

    ctx = processes.context()
    rows: list[Row] = []
    with EmbeddedServer() as server, Progress(disable=quiet, transient=True) as progress:
        task = progress.add_task("starting processes", total=(cfg.warmup + cfg.reps) * (5 if cfg.verify else 2) + 2)
        pub_conns, publishers = children.start(ctx, _publisher,
                                               [(server.address, cfg, rank) for rank in range(cfg.publishers)])
        raw_infos = children.receive(pub_conns, 180, "a benchmark publisher did not start")
        conns, procs = children.start(ctx, _reader,
                                      [(server.address, cfg, raw_infos, i) for i in range(cfg.readers)])
        requested = children.receive(conns, 180, "a benchmark reader did not start")[-1][1]

        most_read: dict[str, int] = {}  # method -> the most bytes one reader's pull read

        def round_(cmd: str) -> float:
            start_at = time.monotonic() + 0.05
            for conn in conns:
                conn.send((cmd, start_at))
            results = children.receive(conns, 300, f"a reader did not finish {cmd}")
            if not all(r.ok for r in results):
                raise RuntimeError(f"{cmd}: a reader received wrong bytes")
            most_read[cmd] = max(most_read.get(cmd, 0), *(r.read_bytes for r in results))
            return max(r.end for r in results) - min(r.start for r in results)

        progress.update(task, description="checking bytes")
        round_("verify-raw")
        round_("verify")
        progress.advance(task, 2)
        methods = (("nixl-raw", "tensorhub", "tensorhub-unchecked", "nixl-raw-pieces", "nixl-raw-pieces-crc")
                   if cfg.verify else ("nixl-raw", "tensorhub"))
        samples: dict[str, list[float]] = {m: [] for m in methods}
        for rep in range(cfg.warmup + cfg.reps):
            order = methods if rep % 2 == 0 else methods[::-1]
            for method in order:
                progress.update(task, description=f"{method} rep {rep + 1 - cfg.warmup}" if rep >= cfg.warmup
                                else f"{method} warm-up")
                seconds = round_(method)
                if rep >= cfg.warmup:
                    samples[method].append(seconds)
                progress.advance(task)
        shape = {"publishers": cfg.publishers, "requested_bytes": requested, "model_bytes": cfg.size,
                 "reader_slice": cfg.reader_slice}
        for method, values in samples.items():
            rows.append(Row.of(method, cfg.readers, requested, values, **shape, most_read_bytes=most_read[method]))
        progress.update(task, description="4 KiB latency")
        conns[0].send(("latency", cfg.latency_pulls))
        latency = conns[0].recv()
        rows.append(Row.of("tensorhub", 1, SMALL_BYTES, latency, latency_p90=sorted(latency)[int(0.9 * len(latency))],
                           publishers=1, requested_bytes=SMALL_BYTES))
        children.stop(conns, ("stop", None), pub_conns, [*procs, *publishers])
    if not quiet:
        print_table(f"pull {requested:,} of {cfg.size:,} bytes ({cfg.reader_slice}) from {cfg.publishers} "
                    f"publisher(s), {cfg.readers} reader(s), median of {cfg.reps}", rows,
                    {"tensorhub": "nixl-raw", "tensorhub-unchecked": "nixl-raw"})
        th = next(r for r in rows if r.method == "tensorhub" and r.bytes == requested)
        raw = next(r for r in rows if r.method == "nixl-raw")
        # A slice's short column runs may be read as whole rows (HubConfig.read_cost):
        # the bytes asked and the bytes read then differ, and both are shown.
        print(f"tensorhub / nixl-raw throughput: {raw.seconds / th.seconds:.2f}x (goal >= 0.8); "
              f"bytes read / model bytes: {most_read['tensorhub'] / cfg.size:.3f} (the most one pull read)"
              + (f", bytes asked / model bytes: {requested / cfg.size:.3f} (goal <= 0.55)"
                 if cfg.reader_slice == "tp2" else "")
              + f"; 4 KiB pull latency: {statistics.median(latency) * 1e3:.2f} ms (goal <= 5 ms)")
        if cfg.verify:
            from tensorhub.client.verify import READ_PIECE_BYTES

            # Each repetition's checked pull against the unchecked one beside it:
            # paired, so that noise which hits both alike cancels.
            cost = sorted(1 - off / on for on, off in zip(samples["tensorhub"], samples["tensorhub-unchecked"]))
            quartiles = statistics.quantiles(cost, n=4) if len(cost) > 1 else [cost[0]] * 3
            print(f"chunk checksums cost {statistics.median(cost):.1%} of pull throughput, quartiles "
                  f"{quartiles[0]:.1%}-{quartiles[2]:.1%} (median of {len(cost)} repetitions, each tensorhub "
                  "vs the tensorhub-unchecked pull beside it; goal <= 10%)")
            floor = sorted(1 - off / on for on, off in zip(samples["nixl-raw-pieces-crc"], samples["nixl-raw-pieces"]))
            print(f"the same CRC beside raw NIXL READs of {READ_PIECE_BYTES >> 20} MiB pieces costs "
                  f"{statistics.median(floor):.1%} (nixl-raw-pieces-crc vs nixl-raw-pieces, paired the same way): "
                  "what reading the bytes once more costs on this machine, whoever does it")
    if json_path:
        write_json(json_path, rows, benchmark="pull", chunk_size=cfg.chunk_size, read_workers=cfg.read_workers,
                   publishers=cfg.publishers, reader_slice=cfg.reader_slice, verify_chunks=cfg.verify)
    return rows
