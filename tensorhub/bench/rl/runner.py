"""The driver of ``tensorhub bench rl``: for each method of the scenario, start
the trainer and the rollouts on their hosts, start the run when everyone holds
version 0, preempt and replace spot rollouts on schedule (elastic), end the run
once the trainer has made its steps (and every replacement has joined), and
turn the events into the method's row.
"""

from __future__ import annotations

import contextlib
import time
from multiprocessing.connection import wait
from typing import Any

from rich.console import Console
from rich.live import Live

from tensorhub import processes
from tensorhub.bench.rl import lora, metrics, proc, via_broadcast, via_p2p, via_tensorhub, via_tensorhub_lora
from tensorhub.bench.rl.config import RLBenchConfig
from tensorhub.bench.rl.live import Tracker
from tensorhub.bench.rl.places import places
from tensorhub.bench.rl.schedule import MAX_BATCHES, Schedule, draw


def _run_timeout(cfg: RLBenchConfig) -> float:
    """A whole method's run: generous (stragglers, a slow link), but a run never hangs."""
    return 300.0 + cfg.steps * (cfg.step_s + 10 * cfg.gen_median_s + 60.0)



class RunFailed(RuntimeError):
    pass


class _Run:
    """One method's processes, their event pipes and what they reported."""

    def __init__(self, cfg: RLBenchConfig, method: str, where: dict, tracker: Tracker) -> None:
        self.cfg, self.method, self.where, self.tracker = cfg, method, where, tracker
        self.ctx = processes.context()
        self.go, self.stop = self.ctx.Event(), self.ctx.Event()
        self.procs: dict[str, Any] = {}
        self.conns: dict[Any, str] = {}
        self.killed: set[str] = set()
        self.preempts: dict[str, Any] = {}  # rollout -> its preemption notice (an Event)
        self.events: list[dict] = []
        self.seen: dict[str, set[str]] = {}

    def start(self, who: str, target: Any, *args: Any) -> None:
        reader, writer = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=target, args=(writer, who, *args), name=f"rl-{who}", daemon=True)
        p.start()
        writer.close()
        self.procs[who], self.conns[reader] = p, who

    def notice(self) -> Any:
        return self.ctx.Event()

    def preempt(self, who: str) -> None:
        """Give notice; the rollout dies at its next batch (not mid-transfer), abruptly."""
        self.killed.add(who)
        self.preempts[who].set()
        deadline = time.monotonic() + proc.WAIT_TIMEOUT_S
        while self.procs[who].is_alive():
            if time.monotonic() > deadline:
                raise RunFailed(f"{self.method}: {who} did not go within {proc.WAIT_TIMEOUT_S:.0f} s of its notice")
            self.pump(0.05)
        now = time.monotonic()
        self.events.append({"who": who, "kind": "preempted", "start": now, "end": now})
        self.tracker.gone(who, "preempted")

    def pump(self, timeout: float) -> None:
        """Receive what arrived within ``timeout``; a process that failed ends the run."""
        for conn in wait(list(self.conns), timeout=timeout):
            who = self.conns[conn]
            try:
                e = conn.recv()
            except (EOFError, OSError):
                del self.conns[conn]
                if who not in self.killed and "done" not in self.seen.get(who, ()):
                    code = self.procs[who].exitcode
                    raise RunFailed(f"{self.method}: {who} exited (code {code}) before it was done") from None
                continue
            if e["kind"] == "error":
                raise RunFailed(f"{self.method}: {who} failed: {e['error']}\n{e.get('traceback', '')}")
            self.events.append(e)
            self.seen.setdefault(who, set()).add(e["kind"])
            self.tracker.add(e)

    def until(self, done: Any, timeout: float, what: str, tick: Any = None) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                states = ", ".join(f"{w}: {p.doing} (v{p.version})" for w, p in sorted(self.tracker.procs.items()))
                raise RunFailed(f"{self.method}: {what} did not happen within {timeout:.0f} s; {states}")
            self.pump(0.1)
            if tick is not None:
                tick()

    def has(self, who: str, kind: str) -> bool:
        return kind in self.seen.get(who, ())

    def close(self) -> None:
        self.stop.set()
        for p in self.procs.values():
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def _gens(schedule: Schedule, slot: int, incarnation: int) -> list[float]:
    """A replacement takes the slot's draws from a later offset: same for every method."""
    offset = (incarnation * 97) % MAX_BATCHES
    draws = schedule.gen_s[slot]
    return [*draws[offset:], *draws[:offset]]


def _counters(hosts: Any) -> dict[str, int]:
    """Bytes the trainer's host sent and bytes that crossed a zone link so far (emulated hosts only)."""
    if hosts is None:
        return {}

    out = {"trainer_egress_bytes": hosts.tx_bytes("trainer")}
    if len(getattr(hosts, "zones", ())) > 1:
        out["zone_link_bytes"] = hosts.zone_link_bytes()
    return out


def run_method(cfg: RLBenchConfig, method: str, hosts: Any, where: dict, schedule: Schedule,
               tracker: Tracker) -> tuple[list[dict], dict[str, int]]:
    """The method's events, and what its links carried between the start and the trainer's last step."""
    from tensorhub.local.ports import free_port
    from tensorhub.local.serverprocess import ServerProcess

    slots = [f"r{i}" for i in range(cfg.rollouts)]
    run = _Run(cfg, method, where, tracker)
    trainer_place = where["trainer"]
    with contextlib.ExitStack() as stack:
        gate = None
        if method == "tensorhub":
            server = stack.enter_context(ServerProcess(host=where["server"].addr, netns=where["server"].netns,
                                                       retain=cfg.retain, lease_ttl_s=cfg.lease_ttl_s))
        stack.callback(run.close)  # before the server stops: the processes close their hubs
        if method == "tensorhub":
            run.start("trainer", via_tensorhub.trainer, trainer_place, server.address, cfg, run.go, run.stop)
            # LoRA mode: the base once, then adapter versions (standalone only: no seed)
            via = via_tensorhub_lora if cfg.lora_rank else via_tensorhub
            if "seed" in where:  # crossdc: the far zone's seed
                run.start("seed", via_tensorhub.seed, where["seed"], server.address, cfg, run.go, run.stop)

            def rollout(slot: int, who: str, join_at: float | None, incarnation: int) -> None:
                run.preempts[who] = run.notice()
                run.start(who, via.rollout, where[slots[slot]], server.address, cfg,
                          _gens(schedule, slot, incarnation), slot < cfg.spot, join_at, run.go, run.stop,
                          run.preempts[who])
        elif method == "broadcast":
            world, port = cfg.rollouts + 1, free_port()
            run.start("trainer", via_broadcast.trainer, trainer_place, cfg, world, trainer_place.addr, port,
                      run.go, run.stop)

            def rollout(slot: int, who: str, join_at: float | None, incarnation: int) -> None:
                run.start(who, via_broadcast.rollout, where[slots[slot]], cfg, _gens(schedule, slot, incarnation),
                          slot + 1, world, trainer_place.addr, port, run.go, run.stop)
        else:  # p2p: the rollouts need the trainer's agent metadata first
            gate = via_p2p.Gate(run.ctx, cfg.rollouts)
            run.start("trainer", via_p2p.trainer, trainer_place, cfg, gate, run.go, run.stop)
            run.until(lambda: run.has("trainer", "ready"), proc.START_TIMEOUT_S, "the trainer's start")
            ready = next(e for e in run.events if e["who"] == "trainer" and e["kind"] == "ready")

            def rollout(slot: int, who: str, join_at: float | None, incarnation: int) -> None:
                run.preempts[who] = run.notice()
                run.start(who, via_p2p.rollout, where[slots[slot]], cfg, _gens(schedule, slot, incarnation), slot,
                          gate, ready["metadata"], ready["addr"], ready["adapter_addr"], join_at, run.go, run.stop,
                          run.preempts[who])

        for i, who in enumerate(slots):
            rollout(i, who, None, 0)
        run.until(lambda: all(run.has(w, "ready") for w in run.procs), proc.START_TIMEOUT_S,
                  "every process holding version 0")
        before = _counters(hosts)
        started = time.monotonic()
        run.events.append({"who": "driver", "kind": "go", "start": started, "end": started})
        tracker.go()
        run.go.set()

        current = {i: who for i, who in enumerate(slots)}  # slot -> its live process
        pending = list(schedule.preemptions)
        joiners: list[str] = []

        def preempt() -> None:
            while pending and time.monotonic() >= started + pending[0].at_s:
                wave = pending.pop(0)
                for slot in wave.slots:
                    run.preempt(current[slot])
                join_at = time.monotonic() + cfg.replace_after_s  # the replacements' boot
                for slot in wave.slots:
                    incarnation = sum(1 for w in run.procs if w.split("#")[0] == slots[slot])
                    current[slot] = who = f"{slots[slot]}#{incarnation}"
                    joiners.append(who)
                    rollout(slot, who, join_at, incarnation)

        def finished() -> bool:
            joined = all(run.has(w, "hold") for w in joiners)
            return run.has("trainer", "done") and not pending and joined and delivered()

        def delivered() -> bool:
            """LoRA mode: every rollout holds the last version, so that the links'
            counters hold every version's trip (trainer egress per step)."""
            if not cfg.lora_rank:
                return True
            held = {e["who"] for e in run.events if e["kind"] == "hold" and e.get("version") == cfg.steps}
            return all(w in held for w in current.values())

        run.until(finished, _run_timeout(cfg), "the run's end", tick=preempt)
        carried = {k: v - before[k] for k, v in _counters(hosts).items()}
        run.stop.set()
        alive = [w for w in run.procs if w not in run.killed]
        run.until(lambda: all(run.has(w, "done") for w in alive), proc.WAIT_TIMEOUT_S, "every process finishing")
    return run.events, carried


def run(cfg: RLBenchConfig, *, live: bool = True, console: Console | None = None) -> list[dict]:
    """Every method of ``cfg.scenario`` in turn, on the same hosts with the same
    draws; returns the JSON rows (also written with the table and plot)."""
    from tensorhub.bench.rl import outputs

    console = console or Console()
    schedule = draw(cfg)
    rows = []
    slots = [f"r{i}" for i in range(cfg.rollouts)]
    with places(cfg, slots) as (hosts, where):
        for method in cfg.methods:
            tracker = Tracker(f"{cfg.scenario} / {method}")
            with Live(tracker.render(), console=console, refresh_per_second=4, transient=True,
                      get_renderable=tracker.render) if live else contextlib.nullcontext():
                events, carried = run_method(cfg, method, hosts, where, schedule, tracker)
            if cfg.trace:  # the raw events beside the processes' logs
                import json
                from pathlib import Path

                Path(cfg.trace).mkdir(parents=True, exist_ok=True)  # no process of a baseline made it
                Path(cfg.trace, f"{method}-events.json").write_text(json.dumps(events, default=str))
            row = metrics.summarize(cfg.scenario, method, events, cfg.params(), carried)
            if cfg.lora_rank:
                row.update(metrics.per_step_egress(row, cfg.steps, lora.adapter_bytes(cfg)))
            if method == "tensorhub" and cfg.scenario == "elastic":
                # the joins against one joiner alone on the same hosts (what the links allow it)
                row["lone_copy_s"] = round(via_tensorhub.lone_copy_s(cfg, where), 3)
                row["update_vs_lone"] = round(row["update_s"] / row["lone_copy_s"], 3) if row["lone_copy_s"] else None
                console.print(f"a lone copy on the same hosts: {row['lone_copy_s']:.2f} s; the joins took "
                              f"{row['update_vs_lone']}x that (goal <= 1.15x)")
            rows.append(row)
            console.print(outputs.one_line(row, cfg.metric))
    paths = outputs.write_all(cfg, rows)
    outputs.print_summary(console, cfg, rows, paths)
    return rows
