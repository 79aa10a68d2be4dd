"""``tensorhub bench cluster``: one trainer and R readers on emulated hosts
(network namespaces on one bridge, every link capped with ``tc``), the same
version moved every way below in the same run:

* ``single``: one reader pulls alone (the time to beat);
* ``single-unchecked``: the same reader's host, chunk checksums off
  (``HubConfig.verify_chunks=False``): what the checks cost a pull over a link;
* ``tensorhub-no-relay``: R readers pull together, none serves: all read the trainer;
* ``tensorhub``: R readers pull together and serve what lands (relay);
* ``gloo-broadcast``: ``torch.distributed`` gloo, the trainer and R readers in one
  fixed group, one ``broadcast`` (what NCCL-style weight sync does today);
* ``nixl-raw-single``, ``nixl-raw-all``, ``nixl-raw-relay``: raw NIXL on the
  same hosts, no server: a lone copy, every reader from the trainer
  (point-to-point), and a relay with no lag on a fixed schedule
  (``bench.rawrelay``): what the links allow, beside TensorHub's rows.

    server   trainer ──1 Gbit── switch ──1 Gbit── r0, r1, ... (each its own host)

``--zones 2 --zone-link 200mbit``: the server, the trainer and every other reader
(r0, r2, ...) in zone z0; r1, r3, ... in zone z1, behind one slow link. Each row
then also has ``cross_zone_bytes`` (and the same as ``zone_link_bytes``): what
crossed that link (goal: about one copy).

``--delta``: the rows of ``bench.cluster_delta`` too: readers holding version u
of a small transformer trained with AdamW pull v whole, then only its delta.

``--readers 1,2,4,8,16`` (a list): the sweep of ``bench.cluster_sweep``, every
reader count on one set of hosts, and a plot.

Per method: ``seconds`` from the first reader's start until every reader holds
the version, ``trainer_egress_bytes`` (the trainer host's interface counter),
``trainer_stall_seconds`` (TensorHub: the trainer publishes and unpublishes at
once, as a trainer wanting to step would, until unpublish returns; with
retention on, as by default, it first keeps a host copy that readers who come
later read; gloo: the broadcast on the trainer). Needs root and iproute2.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.progress import Progress

from tensorhub import netns, processes
from tensorhub.bench import children
from tensorhub.bench.report import Row, print_table, write_json

if TYPE_CHECKING:
    from tensorhub.bench.rawrelay import RawCluster

MODEL = "bench/cluster"
CHUNK = 4 << 20
ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}  # no shared memory between "hosts"
_START_DELAY_S = 0.5  # from sending the group its pulls to their common start (pull_together)


@dataclass(kw_only=True, slots=True)
class ClusterBenchConfig:
    readers: int = 4
    size: int = 256 << 20
    link: str = "1gbit"
    zones: int = 1
    zone_link: str = "200mbit"
    chunk: int = CHUNK  # TensorHub's chunk and the raw rows' READ size
    delta: bool = False  # also the rows of bench.cluster_delta (versions from real AdamW steps)
    delta_lr: float = 1e-6


def _gloo_main(conn: Any, ns: str, rank: int, world: int, addr: str, port: int, size: int) -> None:
    netns.enter(ns)  # before any thread starts
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world)
    data = torch.full((size,), 7 if rank == 0 else 0, dtype=torch.uint8)
    dist.barrier()
    start = time.monotonic()
    dist.broadcast(data, src=0)
    end = time.monotonic()
    conn.send((start, end, bool((data == 7).all())))
    dist.destroy_process_group()


def _gloo(hosts: netns.Hosts, names: list[str], size: int, *, port_offset: int = 0,
          timeout_s: float = 300) -> tuple[float, float, bool]:
    """One gloo broadcast from ``names[0]`` to the others; ``port_offset``: a run
    of its own after another (no wait for the last one's port)."""
    ctx = processes.context()
    port = 29500 + (os.getpid() + port_offset) % 1000
    conns, procs = children.start(ctx, _gloo_main, [(hosts.netns(name), rank, len(names), hosts.addr(names[0]),
                                                     port, size) for rank, name in enumerate(names)])
    results = children.receive(conns, timeout_s, "a gloo broadcast process did not finish")
    for proc in procs:
        proc.join(timeout=30)
    starts, ends, oks = zip(*results)
    return max(ends) - min(starts), ends[0] - starts[0], all(oks)


def raw_cluster(hosts: netns.Hosts, readers: list[str], size: int, chunk: int) -> RawCluster:
    """Raw NIXL agents (``bench.rawrelay``) on the trainer's and the readers' hosts."""
    from tensorhub.bench.rawrelay import Place, RawCluster

    env = tuple(ENV.items())
    return RawCluster(Place(hosts.netns("trainer"), env), [Place(hosts.netns(r), env) for r in readers], size,
                      chunk)


def raw_row(hosts: netns.Hosts, raw: RawCluster, method: str, readers: int | None, size: int,
            crossed: Callable[[int], dict[str, int]], **run: Any) -> Row:
    """One raw NIXL run by the first ``readers`` readers (None: all), as a row."""
    sent, zone_sent = hosts.tx_bytes("trainer"), hosts.zone_link_bytes()
    got = raw.run(method, readers, **run)
    egress = hosts.tx_bytes("trainer") - sent
    if not got.ok:
        raise RuntimeError(f"{method}: a reader received wrong bytes")
    return Row.of(method, got.readers, size, [got.seconds], trainer_egress_bytes=egress,
                  trainer_stall_seconds=0.0, trainer_copies=round(egress / size, 2),
                  trainer_read_copies=round(got.trainer_bytes / size, 2),
                  reader_seconds=[round(s, 3) for s in got.per_reader_s], **crossed(zone_sent))


def _raw_rows(hosts: netns.Hosts, readers: list[str], size: int, chunk: int, crossed: Callable[[int], dict[str, int]],
              progress: Progress, task: Any) -> list[Row]:
    """The raw NIXL rows (``bench.rawrelay``) on the same emulated hosts."""
    from tensorhub.bench.rawrelay import METHODS

    rows = []
    progress.update(task, description="raw NIXL: starting agents")
    with raw_cluster(hosts, readers, size, chunk) as raw:
        for method in METHODS:
            progress.update(task, description=f"{method}: raw NIXL, no server")
            rows.append(raw_row(hosts, raw, method, 1 if method == "nixl-raw-single" else None, size, crossed))
            progress.advance(task)
    return rows


def gloo_row(hosts: netns.Hosts, readers: list[str], size: int, crossed: Callable[[int], dict[str, int]],
             **run: Any) -> Row:
    """A gloo broadcast from the trainer to ``readers``, as a row."""
    sent, zone_sent = hosts.tx_bytes("trainer"), hosts.zone_link_bytes()
    seconds, stall, ok = _gloo(hosts, ["trainer", *readers], size, **run)
    egress = hosts.tx_bytes("trainer") - sent
    if not ok:
        raise RuntimeError("gloo broadcast delivered wrong bytes")
    return Row.of("gloo-broadcast", len(readers), size, [seconds], trainer_egress_bytes=egress,
                  trainer_stall_seconds=stall, trainer_copies=round(egress / size, 2), **crossed(zone_sent))


@dataclass(kw_only=True, slots=True)
class Pulled:
    """One version pulled by a group of readers together (``pull_together``)."""

    got: list[dict]  # each reader's pull result (tensorhub.local.hubcalls._pull)
    egress: int  # bytes the trainer host sent
    stall: float  # the trainer's unpublish, seconds
    zone_sent: int  # hosts.zone_link_bytes() before the pulls

    @property
    def seconds(self) -> float:
        """The first reader's start until every reader is done."""
        return max(g["end"] for g in self.got) - min(g["start"] for g in self.got)


def pull_together(hosts: netns.Hosts, trainer: Any, group: list[Any], *, version: int, specs: list, chunk: int,
                  serve: bool, method: str, timeout_s: float = 300, of: int | None = None,
                  keep: str | None = None) -> Pulled:
    """The trainer publishes ``version`` (seeded with its number) and unpublishes
    it at once; every reader of ``group`` (HubProcess) pulls it, serving what
    lands when ``serve``, and unpublishes its copy after. The steady state, as
    an RL step makes it: ``of``, the trainer overwrites the buffers of that
    (unpublished) version in place and publishes them again; ``keep``, every
    reader pulls into the destination it kept under that name."""
    if of is None:
        trainer.call("publish", model=MODEL, version=version, specs=specs, seed=version, chunk_size=chunk)
    else:
        trainer.call("overwrite", model=MODEL, version=of, seed=version)
        trainer.call("republish", model=MODEL, version=version, of=of, chunk_size=chunk)
    # What each reader must receive, made before the clock starts (``_prepare_expected``).
    for reader in group:
        reader.send("prepare_expected", model=MODEL, version=version, specs=specs)
    for reader in group:
        reader.result(timeout=timeout_s)
    sent, zone_sent = hosts.tx_bytes("trainer"), hosts.zone_link_bytes()
    # One start instant for the group, as the raw NIXL rows have (rawrelay): the
    # pulls reach the readers one after another, and on 2 busy cores the 16th
    # began up to 0.8 s after the first, which counted in ``seconds``.
    start_at = time.monotonic() + _START_DELAY_S
    for reader in group:
        reader.send("pull", model=MODEL, version=version, specs=specs, serve=serve, expect_seed=version,
                    start_at=start_at, keep=keep)
    stall = trainer.call("unpublish", model=MODEL, version=version, timeout=timeout_s)
    got = [reader.result(timeout=timeout_s) for reader in group]
    egress = hosts.tx_bytes("trainer") - sent
    if any(g["mismatched"] for g in got):
        raise RuntimeError(f"{method}: a reader received wrong bytes")
    if serve:
        for reader in group:
            reader.call("unpublish", model=MODEL, version=version)
    return Pulled(got=got, egress=egress, stall=stall["end"] - stall["start"], zone_sent=zone_sent)


def run(cfg: ClusterBenchConfig, *, json_path: str | None = None, quiet: bool = False) -> list[Row]:
    from tensorhub.local.hubprocess import HubProcess
    from tensorhub.local.serverprocess import ServerProcess

    reason = netns.available()
    if reason is not None:
        raise SystemExit(f"tensorhub bench cluster: skipped: {reason}")
    readers = [f"r{i}" for i in range(cfg.readers)]
    if cfg.zones < 1:
        raise SystemExit("tensorhub bench cluster: --zones must be >= 1")
    zone = {name: "z0" for name in ("server", "trainer")} | {r: f"z{i % cfg.zones}" for i, r in enumerate(readers)}
    zoned = cfg.zones > 1
    specs = [("w", "bfloat16", (cfg.size // 8192, 4096))]
    size = (cfg.size // 8192) * 8192
    rows: list[Row] = []
    with netns.Hosts(["server", "trainer", *readers], rate=cfg.link, zones=zone if zoned else None,
                     zone_link=cfg.zone_link if zoned else None) as hosts, \
            ServerProcess(host=hosts.addr("server"), netns=hosts.netns("server"), retain=1) as server, \
            Progress(disable=quiet, transient=True) as progress:
        task = progress.add_task("starting hubs on the emulated hosts", total=8)

        def hub(name: str, host: str | None = None, **config: Any) -> HubProcess:
            host = host or name
            labels = {"host": host, "zone": zone[host]} if zoned else {"host": host}
            return HubProcess(server.address, name=name, netns=hosts.netns(host), env=ENV, labels=labels, **config)

        def crossed(since: int) -> dict[str, int]:
            if not zoned:
                return {}
            n = hosts.zone_link_bytes() - since
            return {"cross_zone_bytes": n, "zone_link_bytes": n}

        trainer = hub("trainer")
        pulls = [hub(name) for name in readers]
        unchecked = hub(f"{readers[0]}-unchecked", readers[0], verify_chunks=False)
        try:
            version = 0

            def tensorhub(method: str, group: list[HubProcess], serve: bool) -> None:
                nonlocal version
                version += 1
                progress.update(task, description=f"{method}: {len(group)} reader(s)")
                moved = pull_together(hosts, trainer, group, version=version, specs=specs, chunk=cfg.chunk,
                                      serve=serve, method=method)
                rows.append(Row.of(method, len(group), size, [moved.seconds], trainer_egress_bytes=moved.egress,
                                   trainer_stall_seconds=moved.stall, trainer_copies=round(moved.egress / size, 2),
                                   **crossed(moved.zone_sent)))
                progress.advance(task)

            tensorhub("single", pulls[:1], serve=False)
            tensorhub("single-unchecked", [unchecked], serve=False)
            tensorhub("tensorhub-no-relay", pulls, serve=False)
            tensorhub("tensorhub", pulls, serve=True)
            if cfg.delta:
                from tensorhub.bench.cluster_delta import delta_rows

                rows += delta_rows(trainer=trainer, readers=pulls, size=cfg.size, lr=cfg.delta_lr, chunk_size=cfg.chunk,
                                   zone_link_bytes=hosts.zone_link_bytes, trainer_tx=lambda: hosts.tx_bytes("trainer"),
                                   progress=lambda text: progress.update(task, description=text))
        finally:
            for proc in [*pulls, unchecked, trainer]:
                proc.close(timeout=15)
        rows += _raw_rows(hosts, readers, size, cfg.chunk, crossed, progress, task)
        progress.update(task, description=f"gloo-broadcast: {cfg.readers} reader(s)")
        rows.append(gloo_row(hosts, readers, size, crossed))
    if not quiet:
        where = f", {cfg.zones} zones joined by {cfg.zone_link}" if zoned else ""
        print_table(f"{size:,} bytes to {cfg.readers} reader(s) on emulated hosts, links {cfg.link}{where}", rows,
                    {m: "single" for m in ("tensorhub", "tensorhub-no-relay", "gloo-broadcast")}
                    | {"nixl-raw-relay": "nixl-raw-all"})
        single, gloo = rows[0], next(r for r in rows if r.method == "gloo-broadcast")
        off = next(r for r in rows if r.method == "single-unchecked")
        print(f"chunk checksums cost {1 - off.seconds / single.seconds:.1%} of a lone reader's pull throughput over "
              f"its {cfg.link} link (single against single-unchecked; goal <= 10%)")
        seconds = {row.method: row.seconds for row in rows}
        ours = seconds["tensorhub-no-relay"] / seconds["tensorhub"]
        ceiling = seconds["nixl-raw-all"] / seconds["nixl-raw-relay"]
        print(f"relay against every reader reading the trainer: TensorHub {ours:.2f}x; raw NIXL with a lag-free "
              f"relay {ceiling:.2f}x (what the links allow; a lone raw copy {seconds['nixl-raw-single']:.2f} s)")
        for row in rows:
            across = f", {row.extra['cross_zone_bytes'] / row.bytes:.3f} copies crossed zones" if zoned else ""
            stall = row.extra.get("trainer_stall_seconds")
            if "changed_fraction" in row.extra:  # the delta rows: their own versions
                stalled = f", {row.extra['changed_fraction']:.2%} of the elements changed"
            elif row.method.startswith("nixl-raw") or stall is None:
                stalled = ""
            else:
                stalled = f", trainer stalled {stall:.2f} s = {stall / gloo.extra['trainer_stall_seconds']:.2f}x gloo's"
            print(f"{row.method:>20}: {row.seconds:.2f} s = {row.seconds / single.seconds:.2f}x single, trainer sent "
                  f"{row.extra['trainer_copies']:.2f} copies{stalled}{across}")
        whole = next((r for r in rows if r.method == "tensorhub-whole"), None)
        delta = next((r for r in rows if r.method == "tensorhub-delta"), None)
        if whole is not None and delta is not None:
            f = delta.extra["changed_fraction"]
            print(f"delta: {delta.seconds:.2f} s against {whole.seconds:.2f} s whole "
                  f"({whole.seconds / delta.seconds:.1f}x); {delta.extra['delta_bytes'] / delta.bytes:.2%} of the "
                  f"version's bytes, {f:.2%} of its elements changed"
                  + (f"; the zone link carried {delta.extra['zone_link_bytes'] / delta.bytes:.2%} of them (goal <= "
                     f"1.5 x {f:.2%} + 2% = {1.5 * f + 0.02:.2%})" if zoned else ""))
    if json_path:
        write_json(json_path, rows, benchmark="cluster", link=cfg.link, readers=cfg.readers, zones=cfg.zones,
                   **({"zone_link": cfg.zone_link} if zoned else {}))
    return rows
