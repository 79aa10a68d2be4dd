"""The live view of a run (rich): versions published, which rollout holds
which version and what it is doing, bytes moved, stall so far."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.console import Group
from rich.table import Table
from rich.text import Text


@dataclass(slots=True)
class _Proc:
    version: int | None = None
    doing: str = "starting"
    since: float = 0.0
    stall_s: float = 0.0
    moved: int = 0
    updates: int = 0


class Tracker:
    """Folds a run's events into what the view shows."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.procs: dict[str, _Proc] = {}
        self.published = 0
        self.started: float | None = None

    def go(self) -> None:
        self.started = time.monotonic()

    def gone(self, who: str, why: str) -> None:
        self.procs.setdefault(who, _Proc()).doing = why

    def add(self, e: dict) -> None:
        p = self.procs.setdefault(e["who"], _Proc())
        kind = e["kind"]
        if kind in ("hold", "ready") and e.get("version") is not None:
            p.version = e["version"]
        if kind == "publish":
            self.published = e["version"]
            p.version = e["version"]
        if kind == "stall":
            if self.started is not None and e["start"] >= self.started:
                p.stall_s += e["end"] - e["start"]
            p.moved += e.get("bytes", 0) if e["who"] != "trainer" else 0
            p.updates += e["who"] != "trainer"
        if kind in ("ready", "done", "error"):
            p.doing = {"ready": "ready", "done": "done", "error": f"error: {e.get('error', '')}"}[kind]
        elif kind == "begin":
            p.doing = "waiting in broadcast" if e["what"] == "broadcast" else f"{e['what']}: loading weights"
        elif kind == "generate":
            p.doing = "generating"
        elif kind == "compute":
            p.doing = "stepping"
        elif kind == "stall":
            p.doing = "stepping" if e["who"] == "trainer" else "generating"

    def render(self) -> Group:
        elapsed = time.monotonic() - self.started if self.started else 0.0
        stall = sum(p.stall_s for p in self.procs.values())
        moved = sum(p.moved for p in self.procs.values())
        head = Text(f"{self.title}: {elapsed:5.1f} s, trainer published version {self.published}, "
                    f"{moved / 2**20:,.0f} MiB moved to rollouts, stall so far {stall:.1f} s")
        table = Table(show_edge=False, pad_edge=False)
        for col in ("process", "holds version", "doing", "updates", "MiB received", "stall s"):
            table.add_column(col, justify="left" if col in ("process", "doing") else "right")
        for who, p in sorted(self.procs.items(), key=lambda kv: (kv[0] != "trainer", kv[0])):
            table.add_row(who, "-" if p.version is None else str(p.version), p.doing,
                          str(p.updates), f"{p.moved / 2**20:,.0f}", f"{p.stall_s:.2f}")
        return Group(head, table)
