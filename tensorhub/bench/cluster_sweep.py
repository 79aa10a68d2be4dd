"""``tensorhub bench cluster --readers 1,2,4,8,16``: fan-out at scale, every
reader count in one run on one set of emulated hosts (``netns.Hosts``: the
server, the trainer and max(readers) reader hosts, every link capped with
``tc``), and the amplification figure beside the JSON.

Rows, per reader count N (the first N reader hosts):

* ``tensorhub``: N readers pull together and serve what lands (relay);
* ``nixl-raw-relay``: raw NIXL, a relay with no lag on a fixed schedule
  (``bench.rawrelay``): what the links allow;
* ``nixl-raw-all``: raw NIXL, every reader READs the whole version from the trainer;
* ``gloo-broadcast``: one gloo ``broadcast`` from the trainer to the N readers;

and once per run ``single`` (one TensorHub reader alone: the time to beat) and
``nixl-raw-single`` (one raw NIXL reader alone: the link's payload rate, shown
against the cap).

Links: 100mbit per host by default (``--link``), so that 2 CPU cores are not
what binds at 16 readers: a relay moves N copies at once across the emulated
links, 16 x 12.5 MB/s = 200 MB/s through UCX's TCP and the chunk checks, where
1gbit would ask 2 GB/s of the same 2 cores. The run shows it: the raw single
reader's rate against the cap ("raw single reader 12.3 MB/s = 0.98 of the
100mbit cap" in a smoke run), and every row's ``cpu_busy`` (the share of all
the machine's cores busy during it: near 1.0, the cores bind, not the links).

Chunks: 1 MiB by default (``--chunk-size``; 4 MiB for one reader count, as
ever). A relay of k chunks to N readers takes at least about k + log2(N)
chunk times of one link (the last chunk has to cross a tree's depth), against
k for a lone copy: with 64 MiB in 4 MiB chunks that is 20 / 16 = 1.25x at 16
readers, the goal itself; in 1 MiB chunks 68 / 64 = 1.06x.

Each row: ``seconds`` (the first reader's start until every reader holds the
version), ``trainer_egress_bytes`` (the trainer host's interface counter),
``trainer_copies`` (that / ``bytes``), ``cpu_busy``; ``tensorhub`` and
``single`` rows also ``reader_seconds`` (each reader's finish, from the first
start), ``depth`` (hops from the trainer of its deepest chunk, see
``chunk_depths``), ``parent`` (where each reader's bytes came from most) and ``trainer_share`` (of its bytes, from
the trainer). The goals of the issue are printed as met or not, and recorded.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import Progress

from tensorhub import netns
from tensorhub.bench.cluster import ENV, gloo_row, pull_together, raw_cluster, raw_row
from tensorhub.bench.report import Row, print_table, write_json

DEFAULT_LINK = "100mbit"
DEFAULT_SIZE = 64 << 20
DEFAULT_CHUNK = 1 << 20
# Per reader count; ``tensorhub-steady`` with ``--versions`` > 1.
METHODS = ("tensorhub", "tensorhub-steady", "nixl-raw-relay", "nixl-raw-all", "gloo-broadcast")
RAW = ("nixl-raw-relay", "nixl-raw-all")
ORIGIN = "trainer"


@dataclass(kw_only=True, slots=True)
class SweepConfig:
    readers: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    size: int = DEFAULT_SIZE
    link: str = DEFAULT_LINK
    chunk: int = DEFAULT_CHUNK
    versions: int = 1  # per reader count; the later ones are the steady state (tensorhub-steady)


def parse_readers(text: str) -> list[int]:
    """``"1,2,4,8,16"`` -> [1, 2, 4, 8, 16]; ``"4"`` -> [4]: reader counts, each
    at least 1, ascending, once each."""
    parts = [p.strip() for p in str(text).split(",")]
    if not all(re.fullmatch(r"[0-9]+", p) for p in parts) or any(int(p) < 1 for p in parts):
        raise ValueError(f"--readers {text!r}: a reader count (>= 1) or a comma list of them, e.g. 1,2,4,8,16")
    return sorted({int(p) for p in parts})


_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
               "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40}


def link_bytes_per_s(rate: str) -> float:
    """A rate as tc writes it (``100mbit``, ``1gbit``; ``bps`` units are bytes
    per second, as in tc) -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]+)\s*", rate)
    if not m or m.group(2).lower() not in _RATE_UNITS:
        raise ValueError(f"link rate {rate!r} is not a tc rate such as 100mbit or 1gbit")
    return float(m.group(1)) * _RATE_UNITS[m.group(2).lower()] / 8


def depths(sources: dict[str, dict[str, int]]) -> tuple[dict[str, int], dict[str, str | None]]:
    """Each reader's depth in the relay tree, and its parent.

    ``sources``: reader name -> its pull's ``bytes_by_source`` (source agent
    name -> bytes). A reader's parent is the source it got the most bytes from
    (a source that is not one of the readers, the trainer, wins ties; then
    the first name); None if it got no bytes. Depth: 1 when the parent is not
    a reader (the bytes came straight from the trainer), else 1 + the parent's
    depth; 0 with no bytes. A chain that does not end (readers that got most
    from each other, in a cycle) stops at the number of readers."""
    parent: dict[str, str | None] = {}
    for name, got in sources.items():
        counted = sorted((src, n) for src, n in got.items() if n > 0)
        parent[name] = max(counted, key=lambda kv: (kv[1], kv[0] not in sources))[0] if counted else None
    cap = len(sources)
    depth = {}
    for name in sources:
        d, node = 0, name
        while d < cap:
            up = parent[node]
            if up is None:  # ``node`` got nothing: no hop more
                break
            d += 1
            if up not in sources:
                break
            node = up
        depth[name] = d
    return depth, parent


def chunk_depths(chunk_sources: dict[str, dict[int, str]]) -> dict[str, int]:
    """Each reader's depth traced chunk by chunk: a chunk read from a source that
    is not a reader (the trainer) is 1 hop from it, one read from a reader
    1 + that reader's hops for the same chunk; a reader's depth is its deepest
    chunk. ``chunk_sources``: reader name -> its pull's ``chunk_sources``.
    Unlike ``depths`` it does not saturate when readers exchange chunks both
    ways: a chunk's source held it before the reader did, so a chunk's path
    has no cycle (a source without a record of the chunk counts as the origin;
    a path longer than the readers, which cannot happen, stops there)."""
    cap = len(chunk_sources)
    memo: dict[tuple[str, int], int] = {}

    def hops(reader: str, chunk: int, seen: int) -> int:
        key = (reader, chunk)
        if key not in memo:
            src = chunk_sources[reader].get(chunk)
            up = chunk_sources.get(src) if src is not None else None
            memo[key] = 1 if up is None or chunk not in up or seen >= cap else 1 + hops(src, chunk, seen + 1)
        return memo[key]

    return {r: max((hops(r, c, 1) for c in got), default=0) for r, got in chunk_sources.items()}


def tree_summary(depth: list[int]) -> str:
    """``[1, 2, 2, 3]`` -> "depth 1: 1 reader, depth 2: 2, depth 3: 1"."""
    counts = sorted(Counter(depth).items())
    return ", ".join(f"depth {d}: {n}" + (f" reader{'s' if n != 1 else ''}" if i == 0 else "")
                     for i, (d, n) in enumerate(counts))


def _copies(row: Row) -> float:
    return row.extra["trainer_egress_bytes"] / row.bytes


@dataclass(frozen=True, slots=True)
class Goal:
    text: str
    met: bool | None  # None: not measured in this run


def goals(rows: list[Row]) -> list[Goal]:
    """The issue's goals, from one run's rows."""
    by = {(r.method, r.readers): r for r in rows}
    single = next((r for r in rows if r.method == "single"), None)
    out = []
    for n, limit, copies in ((16, 1.25, 1.1), (8, 1.15, None)):
        ours = by.get(("tensorhub", n))
        what = f"{n} readers finish <= {limit}x a lone reader" + (f", trainer egress <= {copies} copies" if copies else "")
        if ours is None or single is None:
            out.append(Goal(f"{what}: not measured ({n} is not in --readers)", None))
            continue
        ratio = ours.seconds / single.seconds
        got = f"{ours.seconds:.2f} s = {ratio:.2f}x single {single.seconds:.2f} s"
        got += f", {_copies(ours):.2f} copies" if copies else ""
        out.append(Goal(f"{what}: {got}", ratio <= limit and (copies is None or _copies(ours) <= copies)))
    for n in sorted({r.readers for r in rows if r.method == "tensorhub"}):
        ours, raw = by[("tensorhub", n)], by.get(("nixl-raw-relay", n))
        if raw is None:
            continue
        ratio = ours.seconds / raw.seconds
        out.append(Goal(f"{n} reader(s): tensorhub {ours.seconds:.2f} s = {ratio:.2f}x nixl-raw-relay "
                        f"{raw.seconds:.2f} s (goal <= 1.10x)", ratio <= 1.10))
    steady = by.get(("tensorhub-steady", 16))
    if steady is not None and ("nixl-raw-relay", 16) in by:
        ratio = steady.seconds / by[("nixl-raw-relay", 16)].seconds
        out.append(Goal(f"16 readers, later versions from the same buffers: {steady.seconds:.2f} s = {ratio:.2f}x "
                        f"nixl-raw-relay (goal <= 1.10x)", ratio <= 1.10))
    return out


def plot(rows: list[Row], path: str | Path, *, title: str = "") -> Path:
    """Left: seconds until all readers are done against the reader count, a line
    per method, ``single`` (and ``nixl-raw-single``) as horizontal references;
    right: trainer egress in copies of the version against the reader count."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    counts = sorted({r.readers for r in rows if r.method in METHODS})
    for method, marker in zip(METHODS, "oxsd^"):
        points = sorted((r.readers, r.seconds, _copies(r)) for r in rows if r.method == method)
        if not points:
            continue
        x, seconds, copies = zip(*points)
        left.plot(x, seconds, marker=marker, label=method)
        right.plot(x, copies, marker=marker, label=method)
    for method, style in (("single", "--"), ("nixl-raw-single", ":")):
        lone = next((r for r in rows if r.method == method), None)
        if lone is not None:
            left.axhline(lone.seconds, color="gray", linestyle=style, label=f"{method} {lone.seconds:.2f} s")
    right.axhline(1.0, color="gray", linestyle="--", label="one copy")
    for ax, ylabel in ((left, "seconds until every reader holds the version"), (right, "trainer egress (copies)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        if counts:
            ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("readers")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_path(json_path: str | None, plot: str | None) -> Path | None:
    """``--plot PATH``, else next to ``--json F``: F with .png; None: neither."""
    if plot:
        return Path(plot)
    return Path(json_path).with_suffix(".png") if json_path else None


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, all) jiffies of every core so far (/proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # idle, iowait


def _busy_since(since: tuple[int, int], row: Row) -> Row:
    """``row`` with ``cpu_busy``: the share of all cores busy since ``since`` (``_cpu_jiffies``)."""
    busy, total = _cpu_jiffies()
    row.extra["cpu_busy"] = round((busy - since[0]) / max(1, total - since[1]), 3)
    return row


def _messages(hosts: netns.Hosts, address: str) -> dict[str, int]:
    """Every message the server has received so far, by method (``ControlView.calls``),
    asked from inside the server's host (the emulated hosts' addresses are theirs alone)."""
    out = subprocess.run(["ip", "netns", "exec", hosts.netns("server"), sys.executable, "-m", "tensorhub.cli",
                          "status", "--address", address, "--json"], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout)["control"]["calls"]


def _per_reader(before: dict[str, int], after: dict[str, int], readers: int) -> dict[str, float]:
    """Messages the server received between two ``_messages``, by method, per reader:
    every process's (the trainer's too) but the status queries' own (Describe) and
    heartbeats (sent by time, not by version)."""
    return {name: round((n - before.get(name, 0)) / readers, 2) for name, n in sorted(after.items())
            if name not in ("Describe", "Heartbeat") and n > before.get(name, 0)}


def _tensorhub_row(method: str, moved: Any, size: int, names: list[str]) -> Row:
    start = min(g["start"] for g in moved.got)
    depth, parent = depths({name: g["sources"] for name, g in zip(names, moved.got)})
    if all(g.get("chunk_sources") for g in moved.got):  # traced chunk by chunk: no saturation on cycles
        depth = {**depth, **chunk_depths({name: g["chunk_sources"] for name, g in zip(names, moved.got)})}
    share = [round(sum(n for s, n in g["sources"].items() if s not in depth) / max(1, sum(g["sources"].values())), 3)
             for g in moved.got]
    return Row.of(method, len(names), size, [moved.seconds], trainer_egress_bytes=moved.egress,
                  trainer_stall_seconds=moved.stall, trainer_copies=round(moved.egress / size, 2),
                  reader_seconds=[round(g["end"] - start, 3) for g in moved.got],
                  depth=[depth[n] for n in names], parent=[parent[n] for n in names], trainer_share=share)


def _steady_row(later: list[Row], size: int, readers: int) -> Row:
    """The versions after a count's first, as one row: the median time, each
    version's time and messages per reader, how many pulls replayed their plans."""
    last = later[-1].extra
    return Row.of("tensorhub-steady", readers, size, [r.seconds for r in later],
                  trainer_egress_bytes=last["trainer_egress_bytes"], trainer_copies=last["trainer_copies"],
                  cpu_busy=max(r.extra["cpu_busy"] for r in later), depth=last["depth"], parent=last["parent"],
                  reader_seconds=last["reader_seconds"], messages_per_reader=last["messages_per_reader"],
                  replayed=[r.extra["replayed"] for r in later],
                  not_replayed=sorted({why for r in later for why in r.extra["not_replayed"]}))


def _order(row: Row) -> tuple:
    lone = ("single", "nixl-raw-single")
    return (0, lone.index(row.method), 0) if row.method in lone else (1, row.readers, METHODS.index(row.method))


def run(cfg: SweepConfig, *, json_path: str | None = None, plot_to: str | Path | None = None,
        quiet: bool = False) -> list[Row]:
    from tensorhub.local.hubprocess import HubProcess
    from tensorhub.local.serverprocess import ServerProcess

    reason = netns.available()
    if reason is not None:
        raise SystemExit(f"tensorhub bench cluster: skipped: {reason}")
    counts = sorted(set(cfg.readers))
    names = [f"r{i}" for i in range(max(counts))]
    specs = [("w", "bfloat16", (cfg.size // 8192, 4096))]
    size = (cfg.size // 8192) * 8192
    cap = link_bytes_per_s(cfg.link)
    timeout_s = max(300.0, 3 * max(counts) * size / cap)  # every reader from the trainer, with room
    rows: list[Row] = []

    def none(_: int) -> dict[str, int]:  # one zone: no cross-zone bytes
        return {}

    with netns.Hosts(["server", ORIGIN, *names], rate=cfg.link) as hosts, \
            ServerProcess(host=hosts.addr("server"), netns=hosts.netns("server"), retain=1) as server, \
            Progress(disable=quiet, transient=True) as progress:
        task = progress.add_task("starting hubs on the emulated hosts", total=2 + 4 * len(counts))

        def hub(name: str) -> HubProcess:
            return HubProcess(server.address, name=name, netns=hosts.netns(name), env=ENV, labels={"host": name})

        trainer = hub(ORIGIN)
        pulls: list[HubProcess] = []
        try:
            for name in names:
                progress.update(task, description=f"starting hub {name} of {len(names)}")
                pulls.append(hub(name))
            version = 0
            for method, n in [("single", 1)] + [("tensorhub", n) for n in counts]:
                # The first version in fresh buffers, as ever; with --versions, the later ones from the
                # same buffers into the same destinations (the steady state): one row for them all.
                steady: list[Row] = []
                for k in range(cfg.versions if method == "tensorhub" else 1):
                    version += 1
                    progress.update(task, description=f"{method}: {n} reader(s)" +
                                    (f", version {k + 1} of {cfg.versions}" if cfg.versions > 1 else ""))
                    before, since = _messages(hosts, server.address), _cpu_jiffies()
                    moved = pull_together(hosts, trainer, pulls[:n], version=version, specs=specs, chunk=cfg.chunk,
                                          serve=method == "tensorhub", method=method, timeout_s=timeout_s,
                                          of=version - 1 if k else None, keep=f"x{n}" if cfg.versions > 1 else None)
                    row = _busy_since(since, _tensorhub_row(method, moved, size, names[:n]))
                    sent = _per_reader(before, _messages(hosts, server.address), n)
                    row.extra.update(messages_per_reader=sent, replayed=sum(g["path"] == "replayed" for g in moved.got),
                                     not_replayed=sorted({g["not_replayed"] for g in moved.got} - {""}))
                    if k == 0:
                        rows.append(row)
                    else:
                        steady.append(row)
                if steady:
                    rows.append(_steady_row(steady, size, n))
                progress.advance(task)
        finally:
            for proc in [*pulls, trainer]:
                proc.close(timeout=15)
        progress.update(task, description="raw NIXL: starting agents")
        with raw_cluster(hosts, names, size, cfg.chunk) as raw:
            for method, n in [("nixl-raw-single", 1)] + [(m, n) for n in counts for m in RAW]:
                progress.update(task, description=f"{method}: {n} reader(s), raw NIXL, no server")
                since = _cpu_jiffies()
                rows.append(_busy_since(since, raw_row(hosts, raw, method, n, size, none, timeout_s=timeout_s)))
                progress.advance(task)
        for k, n in enumerate(counts):
            progress.update(task, description=f"gloo-broadcast: {n} reader(s)")
            since = _cpu_jiffies()
            rows.append(_busy_since(since, gloo_row(hosts, names[:n], size, none, port_offset=k, timeout_s=timeout_s)))
            progress.advance(task)
    rows.sort(key=_order)
    raw_single = next(r for r in rows if r.method == "nixl-raw-single")
    rate = size / raw_single.seconds
    checked = goals(rows)
    if not quiet:
        _print(cfg, rows, size, cap, rate, checked)
    meta: dict[str, Any] = {"benchmark": "cluster", "sweep": True, "link": cfg.link, "readers": counts,
                            "size": size, "chunk_size": cfg.chunk, "link_bytes_per_s": cap,
                            "raw_single_bytes_per_s": round(rate), "raw_single_of_cap": round(rate / cap, 3),
                            "goals": [{"goal": g.text, "met": g.met} for g in checked]}
    if json_path:
        write_json(json_path, rows, **meta)
    where = plot_path(json_path, str(plot_to) if plot_to else None)
    if where is not None:
        plot(rows, where, title=f"{size / 2**20:.0f} MiB to N readers, links {cfg.link}, "
                                f"{cfg.chunk / 2**20:g} MiB chunks")
        if not quiet:
            print(f"plot: {where}")
    return rows


def _print(cfg: SweepConfig, rows: list[Row], size: int, cap: float, rate: float, checked: list[Goal]) -> None:
    single = next(r for r in rows if r.method == "single")
    print_table(f"{size:,} bytes to 1..{max(cfg.readers)} readers on emulated hosts, links {cfg.link}, "
                f"{cfg.chunk:,}-byte chunks", rows, {m: "nixl-raw-relay" for m in ("tensorhub", "tensorhub-steady", "gloo-broadcast")})
    print(f"raw single reader {rate / 1e6:.1f} MB/s = {rate / cap:.2f} of the {cfg.link} cap ({cap / 1e6:.1f} MB/s)")
    for row in rows:
        tree = f"; {tree_summary(row.extra['depth'])}" if "depth" in row.extra else ""
        print(f"{row.method:>16} x{row.readers:<3}: {row.seconds:7.2f} s = {row.seconds / single.seconds:5.2f}x single, "
              f"trainer sent {_copies(row):5.2f} copies, cpu {row.extra['cpu_busy']:.0%} busy{tree}")
    for row in rows:
        if row.method == "tensorhub" and row.readers > 1:
            slow = max(range(row.readers), key=lambda i: row.extra["reader_seconds"][i])
            chain = " <- ".join(_chain(row, slow))
            print(f"tensorhub x{row.readers}: last reader r{slow} at {row.extra['reader_seconds'][slow]:.2f} s, "
                  f"its bytes came most through {chain}")
    for row in rows:
        if "messages_per_reader" in row.extra:
            sent = row.extra["messages_per_reader"]
            print(f"{row.method:>16} x{row.readers:<3}: {sum(sent.values()):6.1f} messages to the server per reader"
                  f" and version ({', '.join(f'{k} {v:g}' for k, v in sent.items())})"
                  + (f"; pulls that replayed their plans: {row.extra['replayed']}" if "steady" in row.method else "")
                  + (f" (the others: {'; '.join(row.extra['not_replayed'])})" if row.extra.get("not_replayed") else ""))
    for goal in checked:
        verdict = "not measured" if goal.met is None else ("met" if goal.met else "NOT met")
        print(f"goal {verdict}: {goal.text}")


def _chain(row: Row, i: int) -> list[str]:
    """Reader ``i`` of a tensorhub row, then the parents its bytes came through
    most, up to the trainer, or up to a reader already on the path (readers
    that gave each other most of their bytes: shown once, then "...")."""
    parent = dict(zip((f"r{k}" for k in range(row.readers)), row.extra["parent"]))
    out = [f"r{i}"]
    while parent.get(out[-1]) is not None:
        up = parent[out[-1]]
        if up in out:
            out.append(f"{up} ...")
            break
        out.append(up)
        if up not in parent:
            break
    return out
