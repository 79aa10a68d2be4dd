"""``tensorhub chaos``: a fault campaign on emulated hosts.

    server ── t0, t1 (trainer ranks: each publishes its rows of every version)
           └─ r0 .. rN (readers: pull the newest version whole, serve it, check every byte)

Trainer ranks publish a new sharded version every ``step_s`` and unpublish the
previous one; readers pull whatever is newest with ``serve=True`` (they relay to
each other) while a seeded schedule (schedule.py) kills holders, cuts and
restores links, restarts the server, slows readers and withdraws versions
mid-pull (faults.py). The driver below never blocks on a process: every
operation has a deadline, and one that runs past it is a hang (the process's
stacks are dumped with faulthandler, then it is killed and replaced).

At the end: links restored, every process drains (unpublishes what it holds) and
reports its NIXL registrations and threads, closes; then the server must hold
no replica, lease or agent once the TTLs have passed. Needs root (netns, tc).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable

from tensorhub import netns, processes
from tensorhub.chaos import faults
from tensorhub.chaos.config import ChaosConfig
from tensorhub.chaos.schedule import Fault, schedule
from tensorhub.chaos.server import Server
from tensorhub.chaos.tally import Tally
from tensorhub.chaos.worker import START_TIMEOUT_S, WARM_OPS, Worker, WorkerSpec

ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}  # no shared memory between emulated hosts
PORT = 50151
GRACE_S = 20.0  # past an operation's own deadlines, before it counts as a hang


class Campaign:
    def __init__(self, cfg: ChaosConfig, hosts: netns.Hosts, server: Server, dump_dir: str) -> None:
        self.cfg, self.hosts, self.server, self.dump_dir = cfg, hosts, server, dump_dir
        self.trainers = [f"t{i}" for i in range(cfg.trainer_ranks)]
        self.readers = [f"r{i}" for i in range(cfg.readers)]
        self.tally = Tally(seed=cfg.seed, minutes=cfg.minutes, unpublish_timeout_s=cfg.unpublish_timeout_s)
        self.ctx = processes.context()
        self.workers: dict[str, Worker] = {}
        self.impaired: dict[str, tuple[float, Callable[[], None]]] = {}  # host -> (until, undo)
        self.version = 0
        self.next_step = 0.0
        self.t0 = time.monotonic()
        self._spawns = 0
        self.drained: dict[str, dict] = {}  # the answers to the final drain

    # ---------------------------------------------------------------- processes

    def spawn(self, name: str) -> None:
        cfg = self.cfg
        self._spawns += 1
        hub = {"chunk_timeout_s": cfg.chunk_timeout_s, "rpc_timeout_s": cfg.rpc_timeout_s,
               "pull_timeout_s": cfg.pull_timeout_s, "connect_timeout_s": 10.0,
               "_unpublish_timeout_s": cfg.unpublish_timeout_s}
        spec = WorkerSpec(name=name, role="trainer" if name in self.trainers else "reader",
                          rank=self.trainers.index(name) if name in self.trainers else 0, world=cfg.trainer_ranks,
                          address=self.server.address, netns=self.hosts.netns(name), env=ENV, seed=cfg.seed,
                          scale=cfg.scale, hub=hub, dump_path=os.path.join(self.dump_dir, f"{name}-{self._spawns}.stacks"),
                          log_path=os.path.join(self.dump_dir, f"{name}.log"))
        self.workers[name] = Worker(self.ctx, spec)

    def kill_and_replace(self, name: str) -> None:
        self.workers.pop(name).kill()
        self.spawn(name)

    def op_deadline_s(self, op: str) -> float:
        """How long an operation may take at most, by the deadlines it is given, plus GRACE_S."""
        cfg = self.cfg
        unpublish = 2 * cfg.unpublish_timeout_s  # with a retention copy: two drains
        pending = 2 * unpublish  # the retries of earlier timeouts (two at most per operation)
        rpc = 2 * cfg.rpc_timeout_s + cfg.lease_ttl_s  # a call, a re-register, a lease-TTL wait
        return GRACE_S + pending + {"step": rpc + unpublish, "withdraw": unpublish,
                                    "pull": cfg.wait_s + rpc + cfg.pull_timeout_s + unpublish,
                                    "drain": 6 * unpublish}.get(op, 0.0)

    def impair(self, host: str, seconds: float, undo: Callable[[], None]) -> None:
        self.impaired[host] = (time.monotonic() + seconds, undo)

    def _heal(self, now: float, everything: bool = False) -> None:
        for host, (until, undo) in list(self.impaired.items()):
            if everything or now >= until:
                undo()
                del self.impaired[host]

    # ---------------------------------------------------------------- the loop

    def _collect(self, now: float) -> None:
        for name, worker in list(self.workers.items()):
            answer = worker.poll()
            if answer is None:
                if worker.busy and now > worker.deadline:
                    self._hang(name, worker, now)
                continue
            if answer.get("died"):
                self.tally.crashes += 1
                worker.process.join(timeout=5)
                self.tally.crash_details.append(f"{name} died during {worker.op or 'start'} "
                                                f"(exit code {worker.process.exitcode}); its stderr ends: "
                                                f"{worker.stderr_tail(8000)}")
                self.kill_and_replace(name)
            elif answer.get("op") == "start" and "error" in answer:
                self.tally.failure(name, answer)  # e.g. its link was cut while it connected
                self.kill_and_replace(name)
            elif not answer.get("ready"):
                if answer.get("op") == "drain":
                    self.drained[name] = answer
                elapsed = now - worker.op_started
                self.tally.answer(name, answer, elapsed, worker.deadline - worker.op_started - GRACE_S)

    def _hang(self, name: str, worker: Worker, now: float) -> None:
        self.tally.hangs += 1
        stacks = worker.dump()
        self.tally.hang_details.append({"who": name, "op": worker.op or "start", "at_s": round(now - self.t0, 1),
                                        "seconds": round(now - (worker.op_started or worker.started), 1),
                                        "stacks": stacks})
        self.kill_and_replace(name)

    def _drive(self, now: float) -> None:
        trainers = [self.workers[n] for n in self.trainers]
        ready = [w for w in trainers if w.ready]
        if now >= self.next_step and ready and all(w.op is None for w in ready) and self.server.ready():
            self.version += 1
            self.tally.versions = self.version
            for w in ready:
                w.send("step", self.op_deadline_s("step"), version=self.version)
            self.next_step = now + self.cfg.step_s
        for name in self.readers:
            w = self.workers[name]
            if w.ready and w.op is None:
                w.send("pull", self.op_deadline_s("pull"), timeout=self.cfg.pull_timeout_s, wait_s=self.cfg.wait_s)

    def run(self, *, live: Callable[[Tally], None] | None = None) -> Tally:
        cfg = self.cfg
        mark = time.monotonic()
        for name in [*self.trainers, *self.readers]:
            self.spawn(name)
        start_by = time.monotonic() + START_TIMEOUT_S
        while not all(w.ready for w in self.workers.values()):
            self._collect(time.monotonic())
            if time.monotonic() > start_by:
                raise RuntimeError("the campaign's processes did not start")
            time.sleep(0.1)
        mark = self._phase("start", mark)
        seconds = cfg.minutes * 60
        plan: list[Fault] = schedule(cfg.seed, seconds, mean_gap_s=cfg.mean_gap_s, kinds=cfg.kinds)
        self.t0 = time.monotonic()
        end = self.t0 + seconds
        shown = 0.0
        while (now := time.monotonic()) < end:
            while plan and now - self.t0 >= plan[0].at_s:
                self._apply(plan.pop(0), now)
            self._heal(now)
            self._collect(now)
            self._drive(now)
            self.tally.seconds = now - self.t0
            if live is not None and now - shown >= 0.5:
                live(self.tally)
                shown = now
            time.sleep(0.02)
        self._phase("faults", mark)
        self._finish(live)
        return self.tally

    def _phase(self, name: str, since: float) -> float:
        now = time.monotonic()
        self.tally.phases[name] = now - since
        return now

    def _apply(self, fault: Fault, now: float) -> None:
        target = faults.APPLY[fault.kind](self, fault)
        if target is None:
            self.tally.skipped[fault.kind] += 1
            return
        self.tally.faults[fault.kind] += 1
        self.tally.applied.append([round(now - self.t0, 2), fault.kind, target, fault.duration_s])

    # ---------------------------------------------------------------- the end

    def _settle(self, until: float) -> None:
        """Let the operations in flight finish (or hang), starting none."""
        while any(w.busy for w in self.workers.values()) and time.monotonic() < until:
            self._collect(time.monotonic())
            time.sleep(0.05)

    def _finish(self, live: Callable[[Tally], None] | None) -> None:
        cfg = self.cfg
        mark = time.monotonic()
        self._heal(mark, everything=True)
        self.server.wait_ready(30)
        self._settle(time.monotonic() + max(self.op_deadline_s("pull"), START_TIMEOUT_S))
        mark = self._phase("settle", mark)
        for w in self.workers.values():
            if w.ready and w.op is None:
                w.send("drain", self.op_deadline_s("drain"))
        self._settle(time.monotonic() + self.op_deadline_s("drain") + 5)
        mark = self._phase("drain", mark)
        leaks = dict.fromkeys(("nixl_registrations", "publications", "undrained", "threads", "os_threads",
                               "not_drained_processes"), 0)
        for name, w in self.workers.items():
            drained = self.drained.get(name)
            if drained is None or "error" in drained:
                leaks["not_drained_processes"] += 1
                continue
            for key in ("registrations", "publications", "undrained"):
                leaks["nixl_registrations" if key == "registrations" else key] += max(0, drained.get(key, 0))
            if w.warm_threads is not None and w.ops_done >= 2 * WARM_OPS:  # threads started for good once warm
                threads, os_threads, new = thread_leaks(w.warm_threads, w.warm_thread_names, drained)
                leaks["threads"] += threads
                leaks["os_threads"] += os_threads
                if new:
                    self.tally.leak_details.append({"who": name, "new_threads": new})
        for w in self.workers.values():
            w.request_close()
        for w in self.workers.values():  # they close at the same time; each within its own deadline
            w.close(timeout=max(0.0, mark + 2 * cfg.unpublish_timeout_s + 10 - time.monotonic()))
        mark = self._phase("close", mark)
        # Killed processes' agents and leases go at their TTL; after that nothing may be left.
        time.sleep(cfg.agent_ttl_s + cfg.lease_ttl_s + 1.5)
        counts = self.server.counts()
        leaks.update(server_replicas=counts["replicas"], server_leases=counts["leases"],
                     server_agents=counts["agents"])
        self.tally.leaks = leaks
        self._phase("ttl_wait", mark)
        if live is not None:
            live(self.tally)


# Threads a hub starts lazily, once, and ends at close: one that first starts
# after a process was warm (a trainer's first release of a retained copy) is
# not a leak (found by the campaign: "tensorhub-chores_0" in a trainer).
LIFETIME_THREADS = ("tensorhub-chores",)


def thread_leaks(warm: tuple[int, int], warm_names: list[str], drained: dict) -> tuple[int, int, list[str]]:
    """Threads and OS threads a drained process has beyond those it had once
    warm, less the hub's lifetime threads, and the names of the new Python
    threads when any leaked."""
    new = Counter(drained.get("thread_names", [])) - Counter(warm_names)
    lifetime = sum(n for thread, n in new.items() if thread.startswith(LIFETIME_THREADS))
    threads = max(0, drained["threads"] - warm[0] - lifetime)
    os_threads = max(0, drained["os_threads"] - warm[1] - lifetime)
    names = sorted(t for t in new.elements() if not t.startswith(LIFETIME_THREADS))
    return threads, os_threads, names if threads or os_threads else []


def run(cfg: ChaosConfig, *, json_path: str | None = None, quiet: bool = False) -> Tally:
    """The whole campaign on fresh emulated hosts; writes ``json_path`` if given."""
    reason = netns.available()
    if reason is not None:
        raise SystemExit(f"tensorhub chaos: {reason}")
    from tensorhub.chaos.live import live_line

    names = ["server", *(f"t{i}" for i in range(cfg.trainer_ranks)), *(f"r{i}" for i in range(cfg.readers))]
    # The workers' logs (NIXL's and UCX's messages, stacks of hangs) are kept
    # when the campaign is not clean: the JSON's "logs" names the folder.
    dumps = tempfile.mkdtemp(prefix="tensorhub-chaos-")
    with netns.Hosts(names, rate=cfg.link) as hosts, live_line(quiet) as show:
        server = Server(hosts.addr("server"), PORT, hosts.netns("server"), agent_ttl_s=cfg.agent_ttl_s,
                        lease_ttl_s=cfg.lease_ttl_s)
        server.start()
        campaign = Campaign(cfg, hosts, server, dumps)
        try:
            server.wait_ready(60)
            tally = campaign.run(live=show)
        finally:
            for w in campaign.workers.values():
                w.kill()
            server.stop()
    if tally.clean:
        shutil.rmtree(dumps, ignore_errors=True)
    else:
        tally.logs = dumps
    if json_path:
        tally.write(json_path)
    return tally
