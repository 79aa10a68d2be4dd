"""Where each process of an RL run lives: an emulated host (network namespace,
capped link; with zones, two switches joined by one slower link) or, without
root, this host with no caps.

    crossdc:  server, trainer ── switch a ══ zone_link ══ switch b ── r0, r1, ..., seed
    others:   server, trainer, r0, r1, ... ── one switch (every link capped)

crossdc's ``seed`` host is zone b's seed for TensorHub (a process holding the
versions in host memory, no GPU: see via_tensorhub.seed); the broadcast leaves it idle.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from tensorhub import netns

# UCX must not use shared memory between emulated hosts: that would bypass the links.
NETNS_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}


@dataclass(frozen=True, slots=True)
class Place:
    name: str  # the host's name, also its topology label "host"
    netns: str | None  # None: this host's namespace
    addr: str  # where others reach it (gloo's rendezvous, the server)
    zone: str = ""
    env: dict = field(default_factory=dict)  # set in the process before NIXL/UCX start
    ifname: str = "lo"  # the interface gloo binds

    @property
    def labels(self) -> dict[str, str]:
        return {"host": self.name, **({"zone": self.zone} if self.zone else {})}


@contextlib.contextmanager
def places(cfg, slots: list[str]):  # cfg: RLBenchConfig
    """``(hosts, {name: Place})`` for "server", "trainer" and every rollout slot,
    for the run's duration (emulated hosts, None with hosts=local, are torn down after)."""
    names = ["server", "trainer", *slots, *(["seed"] if cfg.scenario == "crossdc" else [])]
    if cfg.hosts == "local":
        yield None, {n: Place(n, None, "127.0.0.1") for n in names}
        return
    reason = netns.available()
    if reason is not None:
        raise SystemExit(f"tensorhub bench rl: {reason} (or run with hosts=local: one host, no link caps)")
    zones = {n: "b" if n in slots or n == "seed" else "a" for n in names} if cfg.scenario == "crossdc" else {}
    with netns.Hosts(names, rate=cfg.link, **({"zones": zones, "zone_link": cfg.zone_link} if zones else {})) as hosts:
        yield hosts, {n: Place(n, hosts.netns(n), hosts.addr(n), zones.get(n, ""), NETNS_ENV, "eth0") for n in names}
