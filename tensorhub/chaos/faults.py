"""Applying one scheduled fault to the running cluster (see schedule.py for the
kinds). Each returns the target it hit, or None when no target fits right now
(the fault is then counted as skipped, not as injected)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tensorhub.chaos.schedule import Fault

if TYPE_CHECKING:
    from tensorhub.chaos.config import ChaosConfig
    from tensorhub.chaos.server import Server
    from tensorhub.chaos.worker import Worker
    from tensorhub.netns import Hosts


@runtime_checkable
class Cluster(Protocol):
    """What a fault acts on: the running campaign (``campaign.Campaign``)."""

    cfg: ChaosConfig
    hosts: Hosts
    server: Server
    workers: dict[str, Worker]  # by name, the processes running now
    trainers: list[str]
    readers: list[str]
    impaired: dict[str, tuple[float, Callable[[], None]]]  # host -> (until, undo)

    def kill_and_replace(self, name: str) -> None: ...

    def impair(self, host: str, seconds: float, undo: Callable[[], None]) -> None: ...

    def op_deadline_s(self, op: str) -> float: ...


def _pick(candidates: list[str], fault: Fault) -> str | None:
    return sorted(candidates)[fault.pick % len(candidates)] if candidates else None


def holder_kill(c: Cluster, fault: Fault) -> str | None:
    """SIGKILL a reader or a trainer rank (whatever it is doing), start a new one on its host."""
    starting = sum(not w.ready for w in c.workers.values())
    if starting >= 2:  # spawning is seconds of CPU each on 2 cores: keep the cluster mostly up
        return None
    name = _pick([n for n, w in c.workers.items() if w.ready], fault)
    if name is not None:
        c.kill_and_replace(name)
    return name


def link_cut(c: Cluster, fault: Fault) -> str | None:
    """Take a host's switch port down (peers' packets vanish, nothing errors) until restored."""
    name = _pick([n for n in c.hosts.names if n not in c.impaired], fault)
    if name is not None:
        c.hosts.cut(name)
        c.impair(name, fault.duration_s, lambda: c.hosts.restore(name))
    return name


def server_restart(c: Cluster, fault: Fault) -> str | None:
    """SIGKILL the reference server and start a new one on the same port."""
    if not c.server.ready():
        return None
    c.server.restart()
    return "server"


def slow_reader(c: Cluster, fault: Fault) -> str | None:
    """Cap a reader's link at ``slow_rate`` for a while (its pulls and the relays from it slow down)."""
    name = _pick([n for n in c.readers if n not in c.impaired], fault)
    if name is not None:
        c.hosts.set_rate(name, c.cfg.slow_rate)
        c.impair(name, fault.duration_s, lambda: c.hosts.set_rate(name, c.cfg.link))
    return name


def unpublish_mid_pull(c: Cluster, fault: Fault) -> str | None:
    """Every idle trainer rank unpublishes its newest version now, while readers may be pulling it."""
    ranks = [w for n, w in c.workers.items() if n in c.trainers and w.ready and w.op is None]
    if not ranks or not any(c.workers[n].op == "pull" for n in c.readers if n in c.workers):
        return None
    for worker in ranks:
        worker.send("withdraw", c.op_deadline_s("withdraw"))
    return ",".join(w.name for w in ranks)


APPLY = {"holder_kill": holder_kill, "link_cut": link_cut, "server_restart": server_restart,
         "slow_reader": slow_reader, "unpublish_mid_pull": unpublish_mid_pull}
