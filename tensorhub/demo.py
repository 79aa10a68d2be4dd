"""``make demo`` / ``tensorhub demo``: the main job on one machine.

An embedded reference server, one publisher process (a stand-in trainer that
writes a new version of its weights each step) and N reader processes (stand-in
rollouts). Each step the publisher unpublishes the previous version (waiting
for readers), overwrites its buffer in place and publishes the next version;
every reader pulls the latest into its preallocated buffer, checks every byte,
and serves what it received to the readers after it (pipeline replication).
Live progress per reader; a table of versions, bytes, GB/s and sources at the end.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

MODEL = "demo/policy"


def _publisher(conn: Any, address: str, size: int, versions: int) -> None:
    import torch

    from tensorhub import Hub
    from tensorhub.bench.payload import layout, pattern, views

    torch.set_num_threads(1)
    flat = torch.empty(size, dtype=torch.uint8)
    tensors = views(flat, layout(size))
    with Hub.connect(address, name="trainer") as hub:
        pub = None
        for version in range(1, versions + 1):
            conn.recv()  # the next step
            t0 = time.perf_counter()
            if pub is not None:
                pub.unpublish()  # returns once no reader reads the old bytes
            blocked = time.perf_counter() - t0
            flat.copy_(pattern(size, seed=version))  # the "optimizer step", in place
            pub = hub.publish(MODEL, version, tensors)
            conn.send(("published", version, blocked))
        conn.recv()


def _reader(conn: Any, address: str, size: int, index: int, events: Any) -> None:
    import torch

    from tensorhub import Hub
    from tensorhub.bench.payload import layout, pattern, views

    torch.set_num_threads(1)
    flat = torch.zeros(size, dtype=torch.uint8)  # allocated and touched once, reused every version
    into = views(flat, layout(size))
    with Hub.connect(address, name=f"rollout-{index}") as hub:
        conn.send("ready")
        served = None
        while True:
            msg = conn.recv()
            if msg == "stop":
                break
            if served is not None:
                served.unpublish()  # stop serving the old version before overwriting it
            result = hub.pull(MODEL, "latest", into=into, serve=True,
                              progress=lambda done, total: events.put((index, done, total)))
            served = result.publication
            ok = torch.equal(flat, pattern(size, seed=result.version))
            conn.send((result.version, result.nbytes, result.seconds, result.bytes_by_source, ok))


def run(*, size: int = 256 << 20, versions: int = 4, readers: int = 2) -> int:
    from tensorhub.server import EmbeddedServer

    console = Console()
    ctx = mp.get_context("spawn")
    rows: list[tuple] = []
    with EmbeddedServer() as server:
        console.print(f"[bold]TensorHub demo[/]: reference server on {server.address}, "
                      f"1 trainer and {readers} rollout processes, {versions} versions of {size / 2**20:.0f} MiB")
        events = ctx.Queue()
        pub_conn, child = ctx.Pipe()
        procs = [ctx.Process(target=_publisher, args=(child, server.address, size, versions), daemon=True)]
        conns = []
        for i in range(readers):
            conn, child = ctx.Pipe()
            procs.append(ctx.Process(target=_reader, args=(child, server.address, size, i, events), daemon=True))
            conns.append(conn)
        for p in procs:
            p.start()
        with console.status("starting processes (NIXL agents, hub clients)"):
            for conn in conns:
                if not conn.poll(120):
                    raise RuntimeError("a rollout process did not start within 120 s")
                conn.recv()
        for version in range(1, versions + 1):
            pub_conn.send("step")
            if not pub_conn.poll(120):
                raise RuntimeError("the trainer did not publish within 120 s")
            _, published, blocked = pub_conn.recv()
            console.print(f"trainer published version {published} "
                          f"(unpublish of the previous version blocked {blocked * 1e3:.1f} ms)")
            with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                          console=console, transient=True) as progress:
                tasks = [progress.add_task(f"rollout-{i} v{published}", total=size) for i in range(readers)]
                # Readers one after another, so that each later one can read from the earlier ones.
                for i, conn in enumerate(conns):
                    conn.send("pull")
                    while not conn.poll(0.05):
                        while not events.empty():
                            idx, done, total = events.get()
                            progress.update(tasks[idx], completed=done, total=total)
                    got, nbytes, seconds, sources, ok = conn.recv()
                    progress.update(tasks[i], completed=size)
                    if not ok:
                        console.print(f"[red]rollout-{i} received wrong bytes for version {got}[/]")
                        return 1
                    rows.append((f"rollout-{i}", got, nbytes, seconds, sources))
            for name, got, nbytes, seconds, sources in rows[-readers:]:
                src = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sources.items())
                console.print(f"  {name} pulled version {got}: {nbytes / 2**20:.0f} MiB in {seconds * 1e3:.0f} ms "
                              f"({nbytes / seconds / 1e9:.2f} GB/s) from {src}; every byte checked")
        for conn in conns:
            conn.send("stop")
        pub_conn.send("stop")
        for p in procs:
            p.join(timeout=30)
    table = Table(title="TensorHub demo: every pull")
    for col in ("reader", "version", "MiB", "ms", "GB/s", "read from"):
        table.add_column(col)
    for name, got, nbytes, seconds, sources in rows:
        table.add_row(name, str(got), f"{nbytes / 2**20:.0f}", f"{seconds * 1e3:.0f}", f"{nbytes / seconds / 1e9:.2f}",
                      ", ".join(sources))
    console.print(table)
    return 0
