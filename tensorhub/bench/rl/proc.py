"""What every process of an RL run shares: entering its host, the weights
buffer, and the events it reports to the driver.

Events are dicts, each process sending its own on its own pipe (a process
killed mid-send spoils only its pipe), times from ``time.monotonic()`` (one clock for
every process of the machine, whatever their network namespace):

    {"who": "trainer" | "r0" ..., "kind": ..., "start": s, "end": s, "version": v, ...}

kinds: ``ready`` (holds version 0 / joined), ``compute`` (a trainer step),
``generate`` (a rollout batch), ``stall`` (time not computing or generating:
``what`` says why), ``hold`` (from ``end`` on, ``who`` holds ``version``),
``publish`` (the trainer made ``version`` available), ``begin`` (a stall for
``what`` starts: for the live view), ``done``, ``error``.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from typing import Any

MODEL = "bench/rl"
START_TIMEOUT_S = 180.0  # a process's imports and NIXL agent, on a busy 2-core machine
WAIT_TIMEOUT_S = 300.0  # any wait on another process of the run


def enter(place: Any) -> None:
    """Join the emulated host (before any thread starts), set its environment."""
    if place.netns:
        from tensorhub import netns

        netns.enter(place.netns)
    os.environ.update(place.env)
    import torch

    torch.set_num_threads(1)  # 2 cores, several processes: one thread each


def marker(version: int) -> int:
    return version % 251 + 1  # never 0, the value of a fresh buffer


def weights(size: int):
    """The process's weights: one buffer, allocated and touched once."""
    import torch

    return torch.zeros(size, dtype=torch.uint8)


def write_version(buf: Any, version: int, changed: float = 1.0) -> None:
    """The optimizer step, in place: every byte becomes ``version``'s marker,
    or only a ``changed`` share of them (every n-th byte), and the sampled ones
    (``holds``)."""
    if changed >= 1:
        buf.fill_(marker(version))
        return
    buf[:: max(1, round(1 / changed))] = marker(version)
    buf[:: 1 << 20] = marker(version)
    buf[-1] = marker(version)


def holds(buf: Any, version: int) -> bool:
    """A sample of every MiB and the last byte carry ``version``'s marker."""
    sample = buf[:: 1 << 20]
    return bool((sample == marker(version)).all()) and int(buf[-1]) == marker(version)


class Reporter:
    def __init__(self, events: Any, who: str) -> None:
        self.events, self.who = events, who  # events: the write end of a Pipe

    def __call__(self, kind: str, start: float | None = None, end: float | None = None, **fields: Any) -> None:
        now = time.monotonic()
        self.events.send({"who": self.who, "kind": kind, "start": now if start is None else start,
                         "end": now if end is None else end, **fields})

    def check(self, buf: Any, version: int) -> None:
        if not holds(buf, version):
            raise RuntimeError(f"{self.who}: the bytes it holds are not version {version}'s")


@contextlib.contextmanager
def reporting(events: Any, who: str):
    """The process's Reporter; a failure inside reaches the driver as an ``error`` event."""
    try:
        yield Reporter(events, who)
    except BaseException as e:  # the driver prints it and stops the run
        events.send({"who": who, "kind": "error", "start": time.monotonic(), "end": time.monotonic(),
                    "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        raise


def trainer_steps(report: Reporter, cfg: Any, go: Any):
    """The trainer's loop, the same for every method: wait for the run's start,
    then for each step compute (``step_s``, slept) and yield the new version and
    when its compute ended; the caller makes it available and reports its stall."""
    if not go.wait(WAIT_TIMEOUT_S):
        raise TimeoutError("the run did not start")
    for version in range(1, cfg.steps + 1):
        t0 = time.monotonic()
        time.sleep(cfg.step_s)
        t1 = time.monotonic()
        report("compute", t0, t1, version=version)
        yield version, t1


def rollout_steps(report: Reporter, update: Any, newest: Any, *, join_at: float | None, gen_s: list[float],
                  go: Any, stop: Any, preempt: Any, on_notice: Any = None) -> None:
    """A pulling rollout's loop (p2p, tensorhub): hold version 0 before the run
    starts (or, joining at ``join_at``, the newest); then generate batches and
    after each move to the newest version if there is a newer one.
    ``update(what) -> version`` loads weights; ``newest() -> version`` asks;
    ``on_notice()``: what the rollout does with its preemption notice before it dies."""
    if join_at is None:
        held = update("initial")
        report("ready", version=held)
        if not go.wait(WAIT_TIMEOUT_S):
            raise TimeoutError("the run did not start")
    else:
        report("ready")
        time.sleep(max(0.0, join_at - time.monotonic()))
        held = update("join")
    for gen in gen_s:
        t0 = time.monotonic()
        if not generate(gen, stop, preempt, on_notice):
            break
        report("generate", t0, time.monotonic(), version=held)
        if newest() > held:
            held = update("update")
    report("done")


def generate(gen_s: float, stop: Any, preempt: Any = None, on_notice: Any = None) -> bool:
    """Generate one batch (the GPU work, slept); False when the run ends meanwhile.
    A preempted rollout dies here, as a spot node does: a notice (the cloud's
    30 s to 2 min), on which it does ``on_notice()`` (stop serving what it holds),
    then the kill, abrupt (no goodbye to anyone). Never mid-transfer, where a
    killed raw NIXL reader took its source down with it (a segfault in UCX over TCP)."""
    end = time.monotonic() + gen_s
    while (left := end - time.monotonic()) > 0:
        if stop.wait(min(left, 0.05)):
            return False
        if preempt is not None and preempt.is_set():
            if on_notice is not None:
                on_notice()
            os._exit(137)
    return not stop.is_set()
