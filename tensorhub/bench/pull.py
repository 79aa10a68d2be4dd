"""``tensorhub bench pull``: one publisher process, R reader processes, and the
same bytes moved two ways in the same run:

* ``nixl-raw``: each reader READs the publisher's whole buffer with one NIXL
  descriptor (no server, no chunks): the best NIXL alone can do here;
* ``tensorhub``: each reader pulls the version (the buffer published as a
  state dict of views) into preallocated tensors through the hub.

Methods alternate within each repetition so machine noise hits both alike.
A last row measures the latency of pulling a 4 KiB single-tensor version.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass

from rich.progress import Progress

from tensorhub.bench.report import Row, print_table, write_json

MODEL, SMALL = "bench/model", "bench/small"
SMALL_BYTES = 4096


@dataclass(kw_only=True, slots=True)
class PullBenchConfig:
    size: int = 1 << 30
    readers: int = 1
    reps: int = 5
    warmup: int = 1
    latency_pulls: int = 50
    chunk_size: int = 32 << 20
    read_workers: int = 2


def _publisher(conn, address: str, cfg: PullBenchConfig) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    from tensorhub import Hub
    from tensorhub.bench.payload import layout, pattern, views

    torch.set_num_threads(1)
    flat = pattern(cfg.size, seed=1).clone()
    raw = nixl_agent(f"raw-pub-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
    raw.register_memory(flat)
    with Hub.connect(address, name="publisher", chunk_size=cfg.chunk_size) as hub:
        hub.publish(MODEL, 1, views(flat, layout(cfg.size)))
        hub.publish(SMALL, 1, {"x": torch.ones(SMALL_BYTES // 4)})
        conn.send((raw.get_agent_metadata(), flat.data_ptr(), cfg.size))
        conn.recv()  # stop


def _reader(conn, address: str, cfg: PullBenchConfig, raw_info: tuple[bytes, int, int], index: int) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    from tensorhub import Hub
    from tensorhub.bench.payload import layout, pattern, views

    torch.set_num_threads(1)
    metadata, remote_addr, size = raw_info
    dest = torch.zeros(size, dtype=torch.uint8)  # touched once, reused: no page faults in the timing
    into = views(dest, layout(size))
    small = {"x": torch.zeros(SMALL_BYTES // 4)}
    raw = nixl_agent(f"raw-reader-{index}-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
    raw.register_memory(dest)
    remote = raw.add_remote_agent(metadata)
    remote = remote.decode() if isinstance(remote, bytes) else remote
    local_descs = raw.get_xfer_descs(dest)
    remote_descs = raw.get_xfer_descs([(remote_addr, size, 0)], "DRAM")
    expected = pattern(size, seed=1)

    def raw_read() -> None:
        handle = raw.initialize_xfer("READ", local_descs, remote_descs, remote)
        state = raw.transfer(handle)
        deadline = time.monotonic() + 60
        while state != "DONE":
            if state == "ERR" or time.monotonic() > deadline:
                raise RuntimeError(f"raw NIXL READ failed: {state}")
            state = raw.check_xfer_state(handle)
        raw.release_xfer_handle(handle)

    with Hub.connect(address, name=f"reader-{index}", read_workers=cfg.read_workers) as hub:
        conn.send("ready")
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
            dest.zero_() if cmd == "verify" else None
            while time.monotonic() < arg:  # common start instant for all readers
                time.sleep(0.0005)
            start = time.monotonic()
            if cmd in ("nixl-raw", "verify-raw"):
                raw_read()
            else:
                hub.pull(MODEL, 1, into=into)
            end = time.monotonic()
            ok = torch.equal(dest, expected) if cmd.startswith("verify") else True
            conn.send((start, end, ok))


def run(cfg: PullBenchConfig, *, json_path: str | None = None, quiet: bool = False) -> list[Row]:
    """Run the benchmark; returns its rows (also printed, and written to ``json_path``)."""
    from tensorhub.server import EmbeddedServer

    ctx = mp.get_context("spawn")
    rows: list[Row] = []
    with EmbeddedServer() as server, Progress(disable=quiet, transient=True) as progress:
        task = progress.add_task("starting processes", total=(cfg.warmup + cfg.reps) * 2 + 2)
        pub_conn, child = ctx.Pipe()
        publisher = ctx.Process(target=_publisher, args=(child, server.address, cfg), daemon=True)
        publisher.start()
        if not pub_conn.poll(120):
            raise RuntimeError("the benchmark publisher did not start within 120 s")
        raw_info = pub_conn.recv()
        conns, procs = [], []
        for i in range(cfg.readers):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_reader, args=(child, server.address, cfg, raw_info, i), daemon=True)
            proc.start()
            conns.append(conn)
            procs.append(proc)
        for conn in conns:
            if not conn.poll(120) or conn.recv() != "ready":
                raise RuntimeError("a benchmark reader did not start within 120 s")

        def round_(cmd: str) -> float:
            start_at = time.monotonic() + 0.05
            for conn in conns:
                conn.send((cmd, start_at))
            results = []
            for conn in conns:
                if not conn.poll(300):
                    raise RuntimeError(f"a reader did not finish {cmd} within 300 s")
                results.append(conn.recv())
            if not all(ok for _, _, ok in results):
                raise RuntimeError(f"{cmd}: a reader received wrong bytes")
            return max(e for _, e, _ in results) - min(s for s, _, _ in results)

        progress.update(task, description="checking bytes")
        round_("verify-raw")
        round_("verify")
        progress.advance(task, 2)
        samples: dict[str, list[float]] = {"nixl-raw": [], "tensorhub": []}
        for rep in range(cfg.warmup + cfg.reps):
            order = ("nixl-raw", "tensorhub") if rep % 2 == 0 else ("tensorhub", "nixl-raw")
            for method in order:
                progress.update(task, description=f"{method} rep {rep + 1 - cfg.warmup}" if rep >= cfg.warmup
                                else f"{method} warm-up")
                seconds = round_(method)
                if rep >= cfg.warmup:
                    samples[method].append(seconds)
                progress.advance(task)
        for method, values in samples.items():
            rows.append(Row.of(method, cfg.readers, cfg.size, values))
        progress.update(task, description="4 KiB latency")
        conns[0].send(("latency", cfg.latency_pulls))
        latency = conns[0].recv()
        rows.append(Row.of("tensorhub", 1, SMALL_BYTES, latency, latency_p90=sorted(latency)[int(0.9 * len(latency))]))
        for conn in conns:
            conn.send(("stop", None))
        pub_conn.send("stop")
        for proc in [*procs, publisher]:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    if not quiet:
        print_table(f"pull {cfg.size:,} bytes, {cfg.readers} reader(s), median of {cfg.reps}", rows,
                    {"tensorhub": "nixl-raw"})
        th = next(r for r in rows if r.method == "tensorhub" and r.bytes == cfg.size)
        raw = next(r for r in rows if r.method == "nixl-raw")
        print(f"tensorhub / nixl-raw throughput: {raw.seconds / th.seconds:.2f}x (goal >= 0.8); "
              f"4 KiB pull latency: {statistics.median(latency) * 1e3:.2f} ms (goal <= 5 ms)")
    if json_path:
        write_json(json_path, rows, benchmark="pull", chunk_size=cfg.chunk_size, read_workers=cfg.read_workers)
    return rows
