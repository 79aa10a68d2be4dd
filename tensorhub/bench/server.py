"""``tensorhub bench server``: one reference server process under simulated agents.

For each agent count N (a sweep up to ``--agents``), a fresh ``tensorhub server``
process gets N registered agents; ``--holders`` of them publish one version of a
model (``--tensors`` tensors, NIXL metadata the size a real agent sends for
them); then every other agent resolves ``latest`` every ``--resolve-interval``
seconds, as a pull does: with a read lease, the previous lease released on the
same call, and, as ``client/rpc.py`` asks, without the manifest and the
holders' memory (NIXL metadata) it already has. Every agent heartbeats every
``--heartbeat-interval`` seconds, as ``client/holdings.py`` does: a reader that
holds nothing skips a heartbeat when its last Resolve, sent less than an
interval ago, was answered by the same server instance (a Resolve keeps the
agent alive on the server); ``--heartbeats-while-resolving`` sends them all, as
the client did before. Load generator processes (asyncio, one gRPC channel
each) time every call from the client's side.

Reports, per N: resolve latency p50 / p99 / max, heartbeat p99, calls per
second, holders per resolve answer, the server's resident memory and what each
agent and each replica adds to it; and the first N at which resolve p99 passes
``--goal-ms`` (20 ms). Ratios only mean something within one run: the load
generators share the machine with the server. On a machine with two or more
CPUs the server gets one of its own and the generators the others (every
thread pinned; ``--no-pin``: the OS places them), so a generator's turn on
the CPU does not count as the server's latency; the generators' own lateness
is reported beside it. Each step also reports the CPU the server, the load
generators and everything else on the machine used (cores, from /proc), and
the server's CPU per call: one core of its own answers about 1e6 / that calls
a second.
"""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing as mp
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from tensorhub.bench.cpu import cpu_seconds

MODEL = "bench/server"
# NIXL partial agent metadata for 200 registered tensors (measured with NIXL 1.5.1):
# what a real holder sends with its replica, about 46 bytes per region.
METADATA_BYTES_PER_TENSOR = 46
WARMUP_S = 1.0  # calls that start this soon after the load begins are not counted


@dataclass(kw_only=True, slots=True, frozen=True)
class ServerBenchConfig:
    agents: int = 1000  # the largest agent count of the sweep
    holders: int = 100  # agents that hold the version (at most the agent count)
    tensors: int = 200  # tensors of the version (memory regions per replica)
    seconds: float = 6.0  # of load per agent count
    heartbeat_interval_s: float = 1.0  # HubConfig's default
    resolve_interval_s: float = 1.0  # per reading agent
    sweep: tuple[int, ...] = ()  # agent counts; default: halvings of ``agents`` down to about 100, and agents
    generators: int = 2  # load generator processes
    goal_ms: float = 20.0
    heartbeats_while_resolving: bool = False  # True: readers heartbeat although they resolve (the client before)
    # The server on a core of its own and the load generators on the others (on
    # a machine with at least two): else they preempt each other and a late
    # generator counts as server latency. False: the OS places them all.
    pin: bool = True

    def __post_init__(self) -> None:
        if min(self.agents, self.holders, self.tensors, self.generators) < 1:
            raise ValueError("ServerBenchConfig: agents, holders, tensors and generators must each be >= 1")
        if not (self.seconds > WARMUP_S and self.heartbeat_interval_s > 0 and self.resolve_interval_s > 0):
            raise ValueError(f"ServerBenchConfig: seconds must exceed the {WARMUP_S} s warm-up; intervals positive")

    def counts(self) -> list[int]:
        if self.sweep:
            return sorted(set(self.sweep))
        out, n = [], self.agents
        while n >= 100 or not out:
            out.append(n)
            n //= 2
        return sorted(out)


@dataclass(kw_only=True, slots=True)
class Step:
    agents: int
    holders: int
    resolves: int
    heartbeats: int
    calls_per_s: float
    resolve_ms: dict[str, float]
    heartbeat_ms: dict[str, float]
    holders_per_answer: float
    errors: int
    server_rss_mb: float
    bytes_per_agent: float
    bytes_per_replica: float
    server_cpu: float  # cores the server process used during the load (1.0: one whole core)
    generator_cpu: float  # cores the load generators used, all together (they share the machine with the server)
    server_us_per_call: float  # server CPU per call: what one core of the server alone can answer is 1e6 / this
    other_cpu: float  # cores everything else on the machine used meanwhile (other jobs: not this benchmark)
    heartbeats_skipped: int  # heartbeats readers left out because a Resolve stood in for them
    # How late the load generators' agents woke for their calls: a busy generator
    # also delays seeing an answer, which then counts as latency.
    generator_lag_ms: dict[str, float]
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------- the server process


def _busy_s() -> float:
    """CPU seconds the whole machine has been busy (every core, not idle or waiting on I/O)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _placement(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """CPUs for the server and for the load generators; (None, None): wherever the OS puts them."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None, None
    return {cpus[0]}, set(cpus[1:])


def _pin(pid: int, cpus: set[int] | None) -> None:
    """Every thread of the process (grpc starts its own) onto ``cpus``."""
    if cpus is None:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def _agent_id(i: int) -> str:
    return f"bench-agent-{i}"


def _manifest(pb: Any, tensors: int) -> Any:
    return pb.Manifest(tensors=[pb.TensorSpec(name=f"layers.{i}.weight", dtype="bfloat16", shape=[1024, 1024],
                                              nbytes=2 << 20) for i in range(tensors)])


def _populate(address: str, cfg: ServerBenchConfig, agents: int, server_pid: int) -> tuple[dict[str, int], str]:
    """Register the agents, then publish the holders' replicas; the server's RSS
    at each stage, and its instance id."""
    import grpc

    from tensorhub.proto import tensorhub_pb2 as pb
    from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc

    rss = {"empty": _rss(server_pid)}
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ReferenceServiceStub(channel)
        for i in range(agents):
            instance = stub.RegisterAgent(pb.RegisterAgentRequest(
                agent_id=_agent_id(i), name=f"rollout-{i}",
                labels=pb.Labels(host=f"host-{i // 8}", rack=f"rack-{i // 64}", zone=f"zone-{i // 512}")),
                timeout=30).instance_id
        rss["agents"] = _rss(server_pid)
        manifest = _manifest(pb, cfg.tensors)
        metadata = bytes(METADATA_BYTES_PER_TENSOR * cfg.tensors)
        for i in range(min(cfg.holders, agents)):
            stub.Publish(pb.PublishRequest(
                agent_id=_agent_id(i), replica_id=f"{_agent_id(i)}.0", model=MODEL, version=1, manifest=manifest,
                chunk_size=32 << 20, state=pb.REPLICA_STATE_COMPLETE, origin=i == 0,
                memory=pb.ReplicaMemory(kind=pb.MEMORY_KIND_DRAM, nixl_metadata=metadata, regions=[
                    pb.MemoryRegion(addr=(1 << 32) + k * (2 << 20), size=2 << 20) for k in range(cfg.tensors)]),
            ), timeout=30)
        rss["replicas"] = _rss(server_pid)
    return rss, instance


# ---------------------------------------------------------------- load generators


async def _agent(stub: Any, pb: Any, agent: int, reads: bool, cfg: ServerBenchConfig, start: float, end: float,
                 fingerprint: str, instance: str, out: dict[str, list]) -> None:
    agent_id = _agent_id(agent)
    lease = ""
    resolved = ("", -float("inf"))  # (instance that answered, when sent): Holdings._resolve_stood_in
    known: list[bytes] = []  # memory digests of the last answer's holders, as client/rpc.py sends
    loop = asyncio.get_running_loop()
    next_hb = start + random.uniform(0, cfg.heartbeat_interval_s)
    next_resolve = start + random.uniform(0, cfg.resolve_interval_s) if reads else float("inf")
    while True:
        due = min(next_hb, next_resolve)
        if due >= end:
            return
        await asyncio.sleep(max(0.0, due - loop.time()))
        t0 = loop.time()
        if t0 - start >= WARMUP_S:
            out["lag"].append(t0 - due)  # the generator's own lateness: its loop shares the machine too
        try:
            if next_hb <= next_resolve:
                next_hb += cfg.heartbeat_interval_s
                if (reads and not cfg.heartbeats_while_resolving and resolved[0] == instance
                        and t0 - resolved[1] < cfg.heartbeat_interval_s):
                    out["skipped"].append(1)
                    continue
                await stub.Heartbeat(pb.HeartbeatRequest(agent_id=agent_id), timeout=10)
                kind = "heartbeat"
            else:
                next_resolve += cfg.resolve_interval_s
                resp = await stub.Resolve(pb.ResolveRequest(
                    agent_id=agent_id, model=MODEL, latest=True, lease=True, known_fingerprint=fingerprint,
                    release_leases=[lease] if lease else [], known_memory=known), timeout=10)
                lease = resp.lease_id
                resolved = (resp.instance_id, t0)
                known = [r.memory_digest for r in resp.replicas]
                out["holders"].append(len(resp.replicas))
                kind = "resolve"
        except Exception as e:  # noqa: BLE001 - counted and reported, the load goes on
            out["errors"].append(f"{type(e).__name__}: {e}"[:200])
            continue
        if t0 - start >= WARMUP_S:
            out[kind].append(loop.time() - t0)


async def _generate(address: str, agents: list[int], holders: int, cfg: ServerBenchConfig, start_at: float,
                    fingerprint: str, instance: str) -> dict[str, list]:
    import grpc

    from tensorhub.proto import tensorhub_pb2 as pb
    from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc

    out: dict[str, list] = {"resolve": [], "heartbeat": [], "holders": [], "errors": [], "skipped": [], "lag": []}
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.ReferenceServiceStub(ch)
        loop = asyncio.get_running_loop()
        # Wall clock to this loop's clock: every generator starts the load at the same moment.
        start = loop.time() + max(0.0, start_at - time.time())
        await asyncio.sleep(max(0.0, start - loop.time()))
        cpu0 = time.process_time()
        # No cyclic garbage collection in a generator during the load: a full
        # collection stops its hundreds of agents at once (measured: wake-ups up to
        # 0.3 s late at 1,000 agents), and that would count as the server's latency.
        gc.freeze()
        gc.disable()
        try:
            await asyncio.gather(*(_agent(stub, pb, i, i >= holders, cfg, start, start + cfg.seconds, fingerprint,
                                          instance, out) for i in agents))
        finally:
            gc.enable()
        out["cpu_s"] = [time.process_time() - cpu0]
    return out


def _generator_main(conn: Any, address: str, agents: list[int], holders: int, cfg: ServerBenchConfig,
                    start_at: float, fingerprint: str, instance: str, cpus: set[int] | None) -> None:
    _pin(os.getpid(), cpus)  # before grpc starts its threads: they inherit it
    out = asyncio.run(_generate(address, agents, holders, cfg, start_at, fingerprint, instance))
    out["skipped"] = [len(out["skipped"])]  # a count is all the parent needs
    conn.send(out)


# ---------------------------------------------------------------- one step, the sweep


def _ms(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    a = np.asarray(samples) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def run_step(cfg: ServerBenchConfig, agents: int) -> Step:
    from tensorhub.local.serverprocess import ServerProcess
    from tensorhub.proto import tensorhub_pb2 as pb
    from tensorhub.proto import wire

    holders = min(cfg.holders, agents)
    ttl = 10 * cfg.seconds + 60  # nobody expires while the sweep sets up
    server_cpus, generator_cpus = _placement(cfg.pin)
    with ServerProcess(agent_ttl_s=ttl, lease_ttl_s=ttl, retain=0) as server:
        assert server.proc is not None
        _pin(server.proc.pid, server_cpus)
        rss, instance = _populate(server.address, cfg, agents, server.proc.pid)
        fingerprint = wire.manifest_from_wire(_manifest(pb, cfg.tensors)).fingerprint
        ctx = mp.get_context("spawn")
        start_at = time.time() + 3.0  # the generators' start-up (imports) fits in this
        procs, conns = [], []
        for g in range(cfg.generators):
            mine = list(range(g, agents, cfg.generators))
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_generator_main, args=(child, server.address, mine, holders, cfg, start_at,
                                                             fingerprint, instance, generator_cpus), daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
        merged: dict[str, list] = {"resolve": [], "heartbeat": [], "holders": [], "errors": [], "cpu_s": [],
                                   "skipped": [], "lag": []}
        time.sleep(max(0.0, start_at - time.time()))
        server_cpu0, busy0 = cpu_seconds(server.proc.pid), _busy_s()
        deadline = start_at + cfg.seconds + 60
        for conn in conns:
            if not conn.poll(max(1.0, deadline - time.time())):
                raise TimeoutError("a load generator did not report within a minute of the end of the load")
            for key, values in conn.recv().items():
                merged[key].extend(values)
        server_cpu = cpu_seconds(server.proc.pid) - server_cpu0
        busy = _busy_s() - busy0
        wall = time.time() - start_at
        rss_end = _rss(server.proc.pid)
        for proc in procs:
            proc.join(timeout=10)
    counted = cfg.seconds - WARMUP_S
    calls_per_s = (len(merged["resolve"]) + len(merged["heartbeat"])) / counted
    return Step(
        agents=agents, holders=holders, resolves=len(merged["resolve"]), heartbeats=len(merged["heartbeat"]),
        calls_per_s=calls_per_s,
        resolve_ms=_ms(merged["resolve"]), heartbeat_ms=_ms(merged["heartbeat"]),
        holders_per_answer=float(np.mean(merged["holders"])) if merged["holders"] else 0.0,
        errors=len(merged["errors"]), server_rss_mb=rss_end / 2**20,
        bytes_per_agent=(rss["agents"] - rss["empty"]) / agents,
        bytes_per_replica=(rss["replicas"] - rss["agents"]) / holders,
        server_cpu=server_cpu / wall, generator_cpu=sum(merged["cpu_s"]) / cfg.seconds,
        # The load ran ``seconds`` at calls_per_s; the CPU was read over ``wall`` (a little longer).
        server_us_per_call=server_cpu / max(1.0, calls_per_s * cfg.seconds) * 1e6,
        # The generators' CPU was read over ``seconds`` and the machine's over ``wall``: a rough split.
        other_cpu=max(0.0, busy / wall - server_cpu / wall - sum(merged["cpu_s"]) / cfg.seconds),
        heartbeats_skipped=sum(merged["skipped"]), generator_lag_ms=_ms(merged["lag"]),
        extra={"first_errors": merged["errors"][:3], "rss_bytes": {**rss, "end": rss_end}},
    )


def run(cfg: ServerBenchConfig, *, json_path: str | None = None, console: Console | None = None) -> dict:
    console = console or Console(width=200)  # the table is wide; a pipe would cut it at 80 columns
    steps = []
    for n in cfg.counts():
        console.print(f"[dim]{n} agents, {min(cfg.holders, n)} holders, {cfg.seconds:.0f} s of load...[/dim]")
        steps.append(run_step(cfg, n))
    passes = next((s.agents for s in steps if s.resolve_ms["p99"] > cfg.goal_ms), None)
    table = Table(title=f"reference server under simulated agents ({cfg.tensors} tensors a version, "
                        f"resolve every {cfg.resolve_interval_s:g} s, heartbeat every {cfg.heartbeat_interval_s:g} s)")
    for col in ("agents", "holders", "calls/s", "resolve p50", "resolve p99", "max", "heartbeat p99",
                "holders/answer", "errors", "heartbeats skipped", "generators' lag p99", "server CPU", "per call", "generators' CPU",
                "others' CPU", "server RSS", "per agent", "per replica"):
        table.add_column(col, justify="right")
    for s in steps:
        table.add_row(str(s.agents), str(s.holders), f"{s.calls_per_s:.0f}", f"{s.resolve_ms['p50']:.2f} ms",
                      f"{s.resolve_ms['p99']:.2f} ms", f"{s.resolve_ms['max']:.1f} ms",
                      f"{s.heartbeat_ms['p99']:.2f} ms", f"{s.holders_per_answer:.1f}", str(s.errors),
                      str(s.heartbeats_skipped), f"{s.generator_lag_ms['p99']:.1f} ms", f"{s.server_cpu:.2f} cores", f"{s.server_us_per_call:.0f} us",
                      f"{s.generator_cpu:.2f} cores", f"{s.other_cpu:.2f} cores", f"{s.server_rss_mb:.0f} MiB", f"{s.bytes_per_agent / 1024:.1f} KiB",
                      f"{s.bytes_per_replica / 1024:.1f} KiB")
    console.print(table)
    verdict = f"first passes {cfg.goal_ms:g} ms at {passes} agents" if passes else \
        f"stays within {cfg.goal_ms:g} ms up to {steps[-1].agents} agents"
    console.print(f"resolve p99 {verdict}")
    last = steps[-1]
    # What the server could do with a core of its own: its CPU per call, at this
    # mix of calls per agent (the load generators' share of the machine left out).
    per_core = 1e6 / max(last.server_us_per_call, 1)
    alone = int(per_core / (last.calls_per_s / last.agents)) if last.calls_per_s else 0
    console.print(f"at {last.agents} agents the server used {last.server_cpu:.2f} cores ({last.server_us_per_call:.0f} "
                  f"us a call: one core of its own answers about {per_core:.0f} calls/s, {alone} agents at this mix), "
                  f"the load generators {last.generator_cpu:.2f} cores and other processes {last.other_cpu:.2f} "
                  f"cores of this machine's {os.cpu_count()}")
    server_cpus, generator_cpus = _placement(cfg.pin)
    where = (f"the server pinned to CPU {sorted(server_cpus)}, the load generators to {sorted(generator_cpus)}"
             if server_cpus and generator_cpus else "the server and the load generators placed by the OS")
    console.print(where)
    report = {"config": asdict(cfg), "steps": [asdict(s) for s in steps], "goal_ms": cfg.goal_ms,
              "p99_passes_goal_at_agents": passes, "server_alone_agents_per_core": alone,
              "placement": {"server": sorted(server_cpus or ()), "generators": sorted(generator_cpus or ())}}
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report
