"""A campaign process (a trainer rank or a relaying reader) on its emulated host,
and the driver's handle on it.

The driver sends one operation at a time over a pipe and never waits on it:
it polls for the answer and holds the deadline itself (see campaign.py), so a
process that hangs is found, dumped (``faulthandler`` on SIGUSR1, every thread)
and killed. Answers are dicts; a failed operation answers ``{"error": type,
"typed": is a TensorHubError, "message": ...}``.

Operations: ``step`` (trainer: publish this rank's shard of a version, then
unpublish the previous one), ``withdraw`` (trainer: unpublish what it holds now,
while readers may be mid-pull), ``pull`` (reader: wait briefly for a newer version,
pull it whole with ``serve=True``, check every byte, then unpublish the version it
served before), ``drain`` (unpublish everything, then count what is left) and
``close``; ``stall`` (tests: hold the process, so that the watchdog fires).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

MODEL = "chaos/policy"
START_TIMEOUT_S = 120.0  # imports, NIXL agent, Hub.connect on a busy 2-core machine
WARM_OPS = 5  # operations after which a process counts as warm (for the thread-leak check)


@dataclass(kw_only=True, slots=True)
class WorkerSpec:
    """Everything a campaign process needs, picklable for ``spawn``."""

    name: str  # the host's name, also the agent's name and "host" label
    role: str  # "trainer" or "reader"
    rank: int = 0  # trainer rank
    world: int = 2
    address: str = ""
    netns: str | None = None
    env: dict = field(default_factory=dict)
    seed: int = 0
    scale: float = 1.0
    chunk_size: int = 1 << 20
    hub: dict = field(default_factory=dict)  # HubConfig fields
    dump_path: str = ""  # where faulthandler writes the stacks on SIGUSR1
    log_path: str = ""  # the process's stderr (NIXL's and UCX's messages)


class _Counted:
    """NIXL registrations made and released by this process (the leak check)."""

    def __init__(self) -> None:
        self.registered = 0
        self.deregistered = 0

    def install(self) -> None:
        from tensorhub.transport import nixl

        register, deregister = nixl.NixlAgent.register, nixl.NixlAgent.deregister
        counted = self

        def counting_register(agent: Any, tensors: Any) -> Any:
            out = register(agent, tensors)
            counted.registered += 1
            return out

        def counting_deregister(agent: Any, registration: Any) -> None:
            live = registration._handle is not None
            deregister(agent, registration)
            counted.deregistered += int(live)

        nixl.NixlAgent.register = counting_register  # type: ignore[method-assign]
        nixl.NixlAgent.deregister = counting_deregister  # type: ignore[method-assign]

    @property
    def live(self) -> int:
        return self.registered - self.deregistered


def _thread_names() -> list[str]:
    """The process's Python threads by name (a default name carries its target's):
    which thread a leak is."""
    return sorted(t.name for t in threading.enumerate())


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _failure(e: BaseException) -> dict:
    from tensorhub.errors import TensorHubError

    return {"error": type(e).__name__, "typed": isinstance(e, TensorHubError), "message": str(e)[:500],
            "traceback": "" if isinstance(e, TensorHubError) else traceback.format_exc()[-2000:]}


class _Process:
    """The state of one campaign process: its hub, what it publishes or serves,
    and unpublishes that timed out (their memory must stay alive: retried later)."""

    def __init__(self, spec: WorkerSpec, hub: Any, counted: _Counted) -> None:
        self.spec, self.hub, self.counted = spec, hub, counted
        self.current: Any = None  # the Publication of the newest version held
        self.held_version = -1
        self.pending: list[Any] = []  # publications whose unpublish timed out
        self.unpublish_timeout = float(spec.hub.get("_unpublish_timeout_s", 8.0))
        self.checked_at: float | None = None  # when the bytes of ``current`` (a pull's) were found right

    def _unpublish(self, pub: Any, out: dict) -> None:
        """Unpublish with its timeout, timing it; a timeout keeps the memory for a retry."""
        from tensorhub.errors import TensorHubError

        t0 = time.monotonic()
        try:
            pub.unpublish(self.unpublish_timeout)
        except TensorHubError as e:
            self.pending.append(pub)
            out.setdefault("unpublish_errors", []).append(type(e).__name__)
            out.setdefault("unpublish_messages", []).append(str(e)[:300])
        finally:
            out.setdefault("unpublish_s", []).append(time.monotonic() - t0)

    def _retry_pending(self, out: dict, at_most: int = 2) -> None:
        """Unpublish again what timed out before (a few per operation: the driver's deadline counts on it)."""
        retry, self.pending = self.pending[:at_most], self.pending[at_most:]
        for pub in retry:
            self._unpublish(pub, out)

    def step(self, version: int) -> dict:
        from tensorhub.chaos.payload import rank_shards

        out: dict = {"version": version}
        self._retry_pending(out)
        shards, manifest = rank_shards(version, self.spec.seed, self.spec.rank, self.spec.world, self.spec.scale)
        pub = self.hub.publish(MODEL, version, shards, manifest=manifest, chunk_size=self.spec.chunk_size)
        old, self.current, self.held_version = self.current, pub, version
        if old is not None:
            self._unpublish(old, out)
        return out

    def withdraw(self) -> dict:
        out: dict = {"version": self.held_version}
        self._retry_pending(out)
        if self.current is not None:
            pub, self.current = self.current, None
            self._unpublish(pub, out)
        return out

    def pull(self, timeout: float, wait_s: float) -> dict:
        from tensorhub.chaos.payload import mismatched
        from tensorhub.errors import VersionNotFound

        out: dict = {}
        self._retry_pending(out)
        try:
            self.hub.wait_for_version(MODEL, self.held_version + 1, timeout=wait_s)
        except VersionNotFound:
            return {**out, "idle": True}
        t0 = time.monotonic()
        result = self.hub.pull(MODEL, "latest", serve=True, timeout=timeout)
        out.update(version=result.version, seconds=time.monotonic() - t0, nbytes=result.nbytes,
                   sources=result.bytes_by_source, lost=result.lost_sources, unverified=result.unverified_bytes,
                   checks_failed=result.checks_failed, checks_unplaced=result.checks_failed_unplaced)
        out["mismatched"] = mismatched(result.tensors, result.version, self.spec.seed, self.spec.scale)
        old, self.current, self.held_version = self.current, result.publication, result.version
        if old is not None:
            self._check_served(old, out)
            self._unpublish(old, out)
        self.checked_at = None if out["mismatched"] else time.monotonic()
        return out

    def _check_served(self, pub: Any, out: dict) -> None:
        """Its bytes were right when its pull ended; are they still, now that it
        stops serving them? Bytes that changed meanwhile were written by
        something after the pull (nothing may write a served replica)."""
        from tensorhub.chaos.payload import mismatched
        from tensorhub.client.publication import PubState

        if self.checked_at is None or pub.state is not PubState.COMPLETE:
            return
        changed = mismatched(pub.tensors, pub.version, self.spec.seed, self.spec.scale)
        if changed:
            out["changed_while_served"] = {"version": pub.version, "tensors": changed,
                                           "after_s": round(time.monotonic() - self.checked_at, 2)}

    def stall(self, seconds: float) -> dict:
        """Do nothing for a while: how a test sees the driver's watchdog catch a hang."""
        time.sleep(seconds)
        return {}

    def drain(self) -> dict:
        """Unpublish everything this process holds, then say what is left."""
        out: dict = {}
        self._retry_pending(out, at_most=len(self.pending))
        for pub in self.hub.publications():
            if not pub.retained:  # retained copies are the server's to release (or close's)
                self._unpublish(pub, out)
        self.current = None
        pubs = self.hub.publications()
        retained = sum(p.retained for p in pubs)
        # Every registration left must belong to a retained copy (pulls into new tensors are not cached).
        out.update(registrations=self.counted.live - retained, publications=len(pubs) - retained,
                   retained=retained, undrained=len(self.pending))
        return out


def main(conn: Any, spec: WorkerSpec) -> None:
    """The process: enter the host (before any thread starts), connect, serve operations."""
    if spec.netns:
        from tensorhub import netns

        netns.enter(spec.netns)
    os.environ.update(spec.env)
    if spec.log_path:  # NIXL and UCX write their complaints to fds 1 and 2: keep them off the live line
        log_fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    dump = open(spec.dump_path or os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    faulthandler.enable(all_threads=True)  # a crash (SIGSEGV in NIXL/UCX) leaves its Python stacks in the log
    import torch

    torch.set_num_threads(1)
    counted = _Counted()
    counted.install()
    from tensorhub import Hub

    config = {k: v for k, v in spec.hub.items() if not k.startswith("_")}
    try:
        hub = Hub.connect(spec.address, name=spec.name, labels={"host": spec.name}, **config)
    except Exception as e:  # noqa: BLE001 - the driver counts it (typed or not) and starts another
        conn.send(_failure(e))
        return
    proc = _Process(spec, hub, counted)
    conn.send({"ready": True, "threads": threading.active_count(), "os_threads": _os_threads(),
               "thread_names": _thread_names()})
    while True:
        op, kwargs = conn.recv()
        if op == "close":
            hub.close(timeout=proc.unpublish_timeout)
            conn.send({"closed": True})
            return
        try:
            out = getattr(proc, op)(**kwargs)
        except Exception as e:  # noqa: BLE001 - every failure goes to the driver, typed or not
            out = _failure(e)
        out.update(threads=threading.active_count(), os_threads=_os_threads(), thread_names=_thread_names())
        conn.send(out)


class Worker:
    """The driver's handle: start (without waiting), send an operation, poll for
    its answer, dump and kill. Never blocks."""

    def __init__(self, ctx: Any, spec: WorkerSpec) -> None:
        self.spec = spec
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=main, args=(child, spec), name=f"chaos-{spec.name}", daemon=True)
        self.process.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.op: str | None = None  # the operation in flight
        self.op_started = 0.0
        self.deadline = self.started + START_TIMEOUT_S
        self.ops_done = 0
        # (python, os) threads once warm: lazily started pools (lease releases, chores) are running by then
        self.warm_threads: tuple[int, int] | None = None
        self.warm_thread_names: list[str] = []  # their names then

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def busy(self) -> bool:
        return not self.ready or self.op is not None

    def send(self, op: str, deadline_s: float, **kwargs: Any) -> None:
        self.op, self.op_started = op, time.monotonic()
        self.deadline = self.op_started + deadline_s
        self._conn.send((op, kwargs))

    def poll(self) -> dict | None:
        """The answer, if one came; ``{"died": True}`` if the process is gone."""
        try:
            if not self._conn.poll(0):
                if not self.process.is_alive() and not self._conn.poll(0):
                    return {"died": True}
                return None
            answer = self._conn.recv()
        except (EOFError, OSError):
            return {"died": True}
        if answer.get("ready"):
            self.ready = True
        else:
            self.ops_done += 1
            if self.ops_done == WARM_OPS:
                self.warm_threads = (answer.get("threads", 0), answer.get("os_threads", 0))
                self.warm_thread_names = answer.get("thread_names", [])
        answer["op"], self.op = self.op or "start", None
        return answer

    def dump(self, wait_s: float = 1.0) -> str:
        """The stacks of every thread (faulthandler), as text."""
        if self.process.is_alive() and self.process.pid:
            try:
                os.kill(self.process.pid, signal.SIGUSR1)
            except ProcessLookupError:
                return ""
            time.sleep(wait_s)
        try:
            with open(self.spec.dump_path) as f:
                # Every thread's, whole: the stuck call may be in any of them (NIXL, UCX and gRPC
                # threads list first or last), and a tail of 8,000 characters once cut it off.
                return f.read(1 << 16)
        except OSError:
            return ""

    def stderr_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.spec.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        if self.process.is_alive() and self.process.pid:
            try:
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.join(timeout=10)
        self._conn.close()

    def request_close(self) -> None:
        """Ask it to close its hub (unpublishing what is left), without waiting."""
        if self.process.is_alive() and self.ready and self.op is None:
            try:
                self._conn.send(("close", {}))
                self.op = "close"
            except OSError:
                pass

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a requested close; kill it if it does not end."""
        if self.op == "close":
            try:
                self._conn.poll(timeout)
            except (OSError, EOFError):
                pass
        self.process.join(timeout=5)
        self.kill()
