"""Method ``broadcast``: ``torch.distributed`` gloo, the trainer (rank 0) and
every rollout in one fixed group, one ``broadcast`` per step: what NCCL weight
sync does in today's frameworks. Every rank must join every broadcast, so the
trainer waits for the slowest batch and each rollout for the trainer and for
the slowest of the others.

Stall: the trainer's whole broadcast call; a rollout's time from the end of its
batch until it holds the new version.

LoRA mode (``lora_rank > 0``): the frozen base is broadcast once, before the
run, and each step broadcasts only the adapter (its matrices as one flat
buffer, as frameworks bucket them).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

from tensorhub.bench.rl import lora, proc


def _join(place: Any, rank: int, world: int, master: str, port: int) -> Any:
    proc.enter(place)
    os.environ["GLOO_SOCKET_IFNAME"] = place.ifname
    import torch.distributed as dist

    # A deadline on every collective: a rank that never comes fails the run instead of hanging it.
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=proc.WAIT_TIMEOUT_S))
    return dist


def _version_0(dist: Any, cfg: Any, *, write: bool) -> Any:
    """Everyone starts from version 0 (the trainer, ``write``, makes it); returns
    the buffer each step broadcasts: the weights, or in LoRA mode the adapter
    (after the base, broadcast once here)."""
    buf = proc.weights(cfg.size)
    if write:
        proc.write_version(buf, 0)
    dist.broadcast(buf, src=0)
    if not cfg.lora_rank:
        return buf
    adapter = lora.flat(cfg)
    if write:
        proc.write_version(adapter, 0)
    dist.broadcast(adapter, src=0)
    return adapter


def trainer(events: Any, who: str, place: Any, cfg: Any, world: int, master: str, port: int, go: Any,
            stop: Any) -> None:
    with proc.reporting(events, who) as report:
        dist = _join(place, 0, world, master, port)
        buf = _version_0(dist, cfg, write=True)
        report("ready", version=0)
        for version, t1 in proc.trainer_steps(report, cfg, go):
            proc.write_version(buf, version, cfg.changed)
            t2 = time.monotonic()
            report("begin", what="broadcast")
            dist.broadcast(buf, src=0)
            t3 = time.monotonic()
            report("stall", t2, t3, version=version, what="broadcast")
            report("publish", t3, t3, version=version)
        report("done")
        dist.destroy_process_group()


def rollout(events: Any, who: str, place: Any, cfg: Any, gen_s: list[float], rank: int, world: int, master: str,
            port: int, go: Any, stop: Any) -> None:
    with proc.reporting(events, who) as report:
        dist = _join(place, rank, world, master, port)
        buf = _version_0(dist, cfg, write=False)
        report.check(buf, 0)
        report("hold", version=0)
        report("ready", version=0)
        if not go.wait(proc.WAIT_TIMEOUT_S):
            raise TimeoutError("the run did not start")
        for version in range(1, cfg.steps + 1):
            t0 = time.monotonic()
            time.sleep(gen_s[version - 1])  # one batch per step: the group moves together
            t1 = time.monotonic()
            report("generate", t0, t1, version=version - 1)
            report("begin", what="broadcast")
            dist.broadcast(buf, src=0)
            t2 = time.monotonic()
            report.check(buf, version)
            report("stall", t1, t2, version=version, what="update", bytes=buf.numel())
            report("hold", t2, t2, version=version)
        report("done")
        dist.destroy_process_group()
