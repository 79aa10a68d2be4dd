"""``make demo`` / ``tensorhub demo``: the main job on one machine, sharded.

An embedded reference server, a trainer of R rank processes (default 2) and N
rollout processes (default 2). The model is ``bench.payload``'s state-dict-like
layout: bf16 matrices (2-D, ``payload.shaped``) and 1-D norms and biases.

    trainer-0  rows [0:n/2) of every matrix, 1st half of every 1-D tensor ─┐ each publishes its shard
    trainer-1  rows [n/2:n) of every matrix, 2nd half of every 1-D tensor ─┤ under the full manifest
                                                                           ▼
           reference server: version v is visible once the shards cover every element
                                                                           │ wait_for_version(v)
    trainer-0, trainer-1 ═══ NIXL READ ═══▶ rollout-1: TP rank 0 of 2 ◀────┤ 1st
    rollout-1, trainer-0, trainer-1 ══════▶ rollout-0: whole tensors  ◀────┘ 2nd

Each step every trainer rank unpublishes its previous shard (which waits for
readers), overwrites its own buffer in place with the new version's bytes and
publishes its shard: no rank holds, gathers or copies the whole model. Each
rollout checks every byte it got and serves exactly what it pulled.

Even-numbered rollouts pull whole tensors; odd-numbered ones what rank 0 of a
tensor-parallel vLLM engine of size 2 loads: rows of the column-parallel
matrices (q/k/v/gate/up), columns of the row-parallel ones (o/down), 1-D
tensors whole. A TP reader rather than two whole ones, and slice readers first
in each step, because then the table shows the whole unit: the slice's rows come
from one trainer rank and its columns from both, and the whole-tensor rollout
after it reads that slice from the rollout and only the rest from the ranks.
Live progress per rollout; a table of every pull and its sources at the end.

Then the RL loop (``tensorhub bench rl``'s standalone scenario, small and on
this host, so no root is needed): a trainer stepping and 4 rollouts with
straggling batches, first in a gloo broadcast group, then through TensorHub,
live; it ends with the stall comparison and the path of the plot.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from tensorhub import Hub, processes
from tensorhub.bench.payload import layout, shaped, views
from tensorhub.manifest import Manifest
from tensorhub.regions import Region
from tensorhub.server import EmbeddedServer
from tensorhub.shard import Shard

MODEL = "demo/policy"
ROW_PARALLEL = ("o_proj", "down_proj")  # vLLM splits their input dimension (columns); the other matrices by rows
START_TIMEOUT_S = 180.0  # NIXL agents and hub clients, on a busy machine
STEP_TIMEOUT_S = 300.0


# ------------------------------------------------------------------ the model


class Piece(NamedTuple):
    """Region ``where`` (``{"rows": (a, b)}``, ``{"cols": ...}``, ``{"flat": ...}`` or
    ``{}`` = whole) of tensor ``name``; ``full`` is its meta tensor, ``offset`` its
    byte offset in the model's byte space (where ``payload.pattern`` defines its bytes)."""

    name: str
    offset: int
    full: torch.Tensor
    where: dict

    @property
    def shape(self) -> tuple[int, ...]:
        return Region.of(tuple(self.full.shape), **self.where).local_shape(tuple(self.full.shape))


def model(size: int) -> list[Piece]:
    """Every tensor of the ``size``-byte model, whole, as meta tensors (nothing allocated)."""
    sizes = layout(size)
    meta = shaped(views(torch.empty(size, dtype=torch.uint8, device="meta"), sizes))
    pieces, offset = [], 0
    for name, nbytes in sizes:
        pieces.append(Piece(name, offset, meta[name], {}))
        offset += nbytes
    return pieces


def _split(n: int, rank: int, world: int) -> tuple[int, int]:
    return n * rank // world, n * (rank + 1) // world


def trainer_pieces(whole: list[Piece], rank: int, ranks: int) -> list[Piece]:
    """Rank ``rank``'s rows of every matrix and flat range of every 1-D tensor."""
    out = []
    for p in whole:
        kind = "rows" if p.full.dim() == 2 else "flat"
        a, b = _split(p.full.shape[0] if kind == "rows" else p.full.numel(), rank, ranks)
        if a < b:
            out.append(p._replace(where={kind: (a, b)}))
    return out


def rollout_pieces(whole: list[Piece], tp: bool) -> list[Piece]:
    """Every tensor whole, or what TP rank 0 of 2 loads (see the module docstring)."""
    if not tp:
        return whole
    out = []
    for p in whole:
        if p.full.dim() == 2:
            kind = "cols" if any(k in p.name for k in ROW_PARALLEL) else "rows"
            p = p._replace(where={kind: _split(p.full.shape[0 if kind == "rows" else 1], 0, 2)})
        out.append(p)
    return out


def allocate(pieces: list[Piece]) -> dict:
    """One buffer for all of ``pieces`` (64-byte aligned), as ``{name: Shard}`` views of it."""
    spans, end = [], 0
    for p in pieces:
        nbytes = torch.Size(p.shape).numel() * p.full.element_size()
        spans.append((end, nbytes))
        end = -(-(end + nbytes) // 64) * 64
    buffer = torch.zeros(end, dtype=torch.uint8)  # allocated and touched once, reused every version
    return {p.name: Shard(buffer[o: o + n].view(p.full.dtype).view(p.shape), tuple(p.full.shape), **p.where)
            for p, (o, n) in zip(pieces, spans)}


def _pattern(lo: int, hi: int, version: int) -> torch.Tensor:
    """Bytes [lo, hi) of ``payload.pattern(size, seed=version)``, without making the rest."""
    base, first = version * 1_000_003, lo // 8
    words = torch.arange(base + first, base + -(-hi // 8), dtype=torch.int64)
    return words.view(torch.uint8)[lo - first * 8: hi - first * 8]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # compared as bytes: the pattern has NaN bit patterns


def expected(p: Piece, version: int) -> torch.Tensor:
    """The bytes of ``p``'s region in ``version``: only its own bytes where the
    region is one run of the tensor (rows, flat ranges, whole), else via the tensor."""
    shape = tuple(p.full.shape)
    runs = Region.of(shape, **p.where).runs(shape)
    size = p.full.element_size()
    if len(runs) != 1:  # columns
        whole = expected(p._replace(where={}), version).view(p.full.dtype).view(shape)
        return _bytes(Shard.of(whole, **p.where).tensor)
    lo = p.offset + int(runs.start[0]) * size
    return _pattern(lo, lo + int(runs.length[0]) * size, version)


# ------------------------------------------------------------------ the processes


def _trainer(conn: Any, address: str, size: int, rank: int, ranks: int) -> None:
    torch.set_num_threads(1)
    whole = model(size)
    manifest = Manifest.of({p.name: p.full for p in whole})
    pieces = trainer_pieces(whole, rank, ranks)
    shards = allocate(pieces)  # this rank's regions, nothing else
    with Hub.connect(address, name=f"trainer-{rank}") as hub:
        conn.send("ready")
        pub = None
        while (version := conn.recv()) != "stop":
            t0 = time.perf_counter()
            if pub is not None:
                pub.unpublish()  # returns once no reader reads the old bytes
            blocked = time.perf_counter() - t0
            for p in pieces:  # the "optimizer step", in place
                _bytes(shards[p.name].tensor).copy_(expected(p, version))
            pub = hub.publish(MODEL, version, shards, manifest=manifest)
            conn.send((pub.nbytes, blocked))


def _rollout(conn: Any, address: str, size: int, index: int, events: Any) -> None:
    torch.set_num_threads(1)
    pieces = rollout_pieces(model(size), tp=index % 2 == 1)
    into = allocate(pieces)
    with Hub.connect(address, name=f"rollout-{index}") as hub:
        conn.send("ready")
        served = None
        while (version := conn.recv()) != "stop":
            hub.wait_for_version(MODEL, version, timeout=STEP_TIMEOUT_S)  # visible once every rank published
            if served is not None:
                served.unpublish()  # stop serving the old version before overwriting it
            result = hub.pull(MODEL, version, into=into, serve=True,
                              progress=lambda done, total: events.put((index, done, total)))
            served = result.publication
            ok = all(torch.equal(_bytes(into[p.name].tensor), expected(p, result.version)) for p in pieces)
            conn.send((result.version, result.nbytes, result.seconds, result.bytes_by_source, ok))


# ------------------------------------------------------------------ the driver


class _Child:
    def __init__(self, ctx: Any, name: str, target: Any, *args: Any) -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True, name=name)
        self.proc.start()

    def recv(self, timeout: float, *, busy: Any = None) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.05):
            if busy is not None:
                busy()
            if not self.proc.is_alive():
                raise RuntimeError(f"{self.name} exited with code {self.proc.exitcode} (its traceback is above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer within {timeout:.0f} s")
        return self.conn.recv()


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _sources(by_source: dict[str, int]) -> str:
    return ", ".join(f"{k} {_mib(v)}" for k, v in sorted(by_source.items()))


def _step_trainers(console: Console, trainers: list[_Child], version: int) -> None:
    for t in trainers:  # every rank steps at once; none waits for another
        t.conn.send(version)
    for t in trainers:
        nbytes, blocked = t.recv(STEP_TIMEOUT_S)
        console.print(f"{t.name} published its {_mib(nbytes)} of version {version}"
                      + (f" (unpublishing version {version - 1} waited {blocked * 1e3:.1f} ms)" if version > 1 else ""))


def _pull_all(console: Console, rollouts: list[_Child], events: Any, version: int) -> list[tuple]:
    """Rollouts one after another, slice readers (odd) first, so that each later
    one reads what the earlier ones hold from them, the rest from the trainer ranks."""
    order = sorted(range(len(rollouts)), key=lambda i: i % 2 == 0)
    rows, finished = [], set()
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
                  console=console, transient=True) as progress:
        tasks = {i: progress.add_task(f"{rollouts[i].name} v{version}", total=None) for i in order}

        def drain() -> None:
            while not events.empty():
                i, done, total = events.get()
                if i not in finished:
                    progress.update(tasks[i], completed=done, total=total)

        for i in order:
            rollouts[i].conn.send(version)
            got, nbytes, seconds, sources, ok = rollouts[i].recv(STEP_TIMEOUT_S, busy=drain)
            finished.add(i)
            progress.update(tasks[i], completed=nbytes, total=nbytes)
            name = f"{rollouts[i].name} ({'TP 0/2' if i % 2 else 'whole'})"
            rows.append((got, name, nbytes, seconds, sources, ok))
    for got, name, nbytes, seconds, sources, ok in rows:
        check = "every byte checked" if ok else "[red]WRONG BYTES[/]"
        console.print(f"  {name} pulled version {got}: {_mib(nbytes)} in {seconds * 1e3:.0f} ms "
                      f"({nbytes / seconds / 1e9:.2f} GB/s) from {_sources(sources)}; {check}")
    return rows


def _table(rows: list[tuple]) -> Table:
    table = Table(title="TensorHub demo: every pull")
    for col in ("version", "reader", "MiB requested", "seconds", "GB/s", "MiB per source"):
        table.add_column(col, justify="left" if col in ("reader", "MiB per source") else "right")
    for got, name, nbytes, seconds, sources, _ in rows:
        table.add_row(str(got), name, f"{nbytes / 2**20:.1f}", f"{seconds:.3f}", f"{nbytes / seconds / 1e9:.2f}",
                      ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(sources.items())))
    return table


def rl_loop(console: Console, size: int, out: str = "bench-results/rl-demo") -> None:
    """The standalone RL scenario on this host (no root): well under a minute here."""
    from tensorhub.bench.rl.config import RLBenchConfig
    from tensorhub.bench.rl.runner import run as run_rl

    cfg = RLBenchConfig(scenario="standalone", hosts="local", rollouts=4, size=max(size, 1 << 20), steps=3,
                        step_s=1.0, gen_median_s=1.0, out=out)
    console.rule("[bold]The RL loop[/]: 1 trainer, 4 rollouts with stragglers, broadcast vs TensorHub")
    run_rl(cfg, live=True, console=console)


def run(*, size: int = 256 << 20, versions: int = 4, readers: int = 2, trainer_ranks: int = 2,
        rl: bool = True) -> int:
    if min(versions, readers, trainer_ranks) < 1:
        raise ValueError("versions, readers and trainer ranks must each be at least 1")
    console = Console()
    ctx = processes.context()
    rows: list[tuple] = []
    with EmbeddedServer() as server:
        console.print(f"[bold]TensorHub demo[/]: reference server on {server.address}; {trainer_ranks} trainer "
                      f"ranks, each holding its rows of a {_mib(size)} model; {readers} rollouts "
                      f"(even: whole tensors, odd: TP rank 0 of 2); {versions} versions")
        events = ctx.Queue()
        trainers = [_Child(ctx, f"trainer-{r}", _trainer, server.address, size, r, trainer_ranks)
                    for r in range(trainer_ranks)]
        rollouts = [_Child(ctx, f"rollout-{i}", _rollout, server.address, size, i, events) for i in range(readers)]
        children = trainers + rollouts
        with console.status("starting processes (NIXL agents, hub clients)"):
            for c in children:
                c.recv(START_TIMEOUT_S)
        for version in range(1, versions + 1):
            _step_trainers(console, trainers, version)
            rows += _pull_all(console, rollouts, events, version)
        for c in children:
            c.conn.send("stop")
        for c in children:
            c.proc.join(timeout=30)
    console.print(_table(rows))
    bad = [(got, name) for got, name, *_, ok in rows if not ok]
    if bad:
        console.print(f"[red]wrong bytes in {', '.join(f'{n} v{v}' for v, n in bad)}[/]")
        return 1
    console.print(f"all {versions} versions verified: every byte of {len(rows)} pulls matched")
    if rl:
        rl_loop(console, size)
    return 0
