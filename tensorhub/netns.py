"""Several emulated hosts on one Linux machine, for tests and benchmarks:
network namespaces on one bridge, each link optionally capped with ``tc``.
Needs root and iproute2. Traffic stays inside the namespaces created here.

    with Hosts(["server", "trainer", "rollout"], rate="1gbit") as hosts:
        hosts.addr("server")        # 10.213.N.10
        hosts.cut("trainer")        # pull the trainer's cable

Zones: ``zones={"trainer": "a", "rollout": "b", ...}`` puts each zone's hosts on
a bridge of their own; zone ``i > 0``'s bridge joins zone 0's through one veth
pair capped at ``zone_link`` (both directions), and ``zone_link_bytes()`` counts
what crossed.

    trainer ─┐               ┌─ r1
    server  ─┤ br0 ═══════ br1 ├─ r3      (═══ zone link, e.g. 200mbit)
    r0, r2  ─┘               └─
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

_CLONE_NEWNET = 0x40000000


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    return None


def enter(name: str) -> None:
    """Move the calling thread (call it before any other thread starts) into
    network namespace ``name``."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(fd)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _tx_bytes(netns_name: str, dev: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", netns_name, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def _tbf(netns_name: str, dev: str, rate: str) -> None:
    subprocess.run(["tc", "-n", netns_name, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", "256kb", "latency", "20ms"], check=True, capture_output=True)


class Hosts:
    def __init__(self, names: list[str], *, rate: str | None = None, zones: dict[str, str] | None = None,
                 zone_link: str | None = None) -> None:
        self.tag = f"th{os.getpid() % 100000}"
        self.subnet = f"10.213.{os.getpid() % 250}"
        self.switch = f"{self.tag}sw"
        self.names = list(names)
        self._ns = {name: f"{self.tag}{name}" for name in names}
        zones = zones or {}
        self.zones = list(dict.fromkeys(zones.get(name, "") for name in names))  # zone 0: the first host's
        self._zone_of = {name: self.zones.index(zones.get(name, "")) for name in names}
        try:
            self._build(rate, zone_link)
        except BaseException:
            self.close()
            raise

    def _build(self, rate: str | None, zone_link: str | None) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "set", "lo", "up")
        for z in range(len(self.zones)):
            _ip("-n", sw, "link", "add", f"br{z}", "type", "bridge")
            _ip("-n", sw, "link", "set", f"br{z}", "up")
            if z:  # zone z's bridge joins zone 0's through one (capped) pair
                _ip("-n", sw, "link", "add", f"zl{z}a", "type", "veth", "peer", "name", f"zl{z}b")
                for end, bridge in ((f"zl{z}a", "br0"), (f"zl{z}b", f"br{z}")):
                    _ip("-n", sw, "link", "set", end, "master", bridge)
                    _ip("-n", sw, "link", "set", end, "up")
                    if zone_link:
                        _tbf(sw, end, zone_link)
        for i, name in enumerate(self.names):
            ns, port = self._ns[name], f"p{i}"
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")  # NIXL agent creation fails without it
            _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", sw, "link", "set", port, "master", f"br{self._zone_of[name]}")
            _ip("-n", sw, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(name)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            if rate:
                for where, dev in ((ns, "eth0"), (sw, port)):
                    _tbf(where, dev, rate)

    def tx_bytes(self, name: str) -> int:
        """Bytes host ``name`` has sent so far (its interface counter)."""
        return _tx_bytes(self._ns[name], "eth0")

    def zone_link_bytes(self) -> int:
        """Bytes that crossed a zone link so far, both directions."""
        return sum(_tx_bytes(self.switch, end) for z in range(1, len(self.zones)) for end in (f"zl{z}a", f"zl{z}b"))

    def netns(self, name: str) -> str:
        return self._ns[name]

    def addr(self, name: str) -> str:
        return f"{self.subnet}.{10 + self.names.index(name)}"

    def cut(self, name: str) -> None:
        """Take the host's switch port down: its peers' packets vanish, nothing errors."""
        _ip("-n", self.switch, "link", "set", f"p{self.names.index(name)}", "down")

    def restore(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", f"p{self.names.index(name)}", "up")

    def set_rate(self, name: str, rate: str) -> None:
        """Cap host ``name``'s link at ``rate`` (both directions, as tc writes it,
        e.g. "20mbit"), replacing its cap: a slow host; set the old rate to undo."""
        _tbf(self._ns[name], "eth0", rate)
        _tbf(self.switch, f"p{self.names.index(name)}", rate)

    def close(self) -> None:
        for ns in [*self._ns.values(), self.switch]:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):  # already gone
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
