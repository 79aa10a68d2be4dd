"""A change counter per version, for readers that wait for the holders of a
version to change instead of asking again and again (a long-poll Resolve).

    Publish / ReportChunks / Unpublish / ReportLost ──▶ bump(model, version) ──▶ waiters wake
    Resolve(wait_change_s, seen_change) ── counter == seen? ──▶ wait(...) (≤ wait_change_s) ──▶ answer + counter

A relaying reader that has read everything its peers had landed waits here
until one of them reports more (or a holder comes or goes), so it learns of a
peer's chunk as soon as the server does, and the server answers one Resolve
per change instead of one per poll. Changes the server makes by itself (a
holder's agent expiring) wake nobody: a waiter's timeout covers them.
"""

from __future__ import annotations

import asyncio

# At most this many versions keep a counter; the oldest go first. A reader that
# waits on a forgotten version sees counter 0 and is answered at once.
_KEPT = 4096


class VersionChanges:
    def __init__(self) -> None:
        self._count: dict[tuple[str, int], int] = {}
        self._events: dict[tuple[str, int], asyncio.Event] = {}

    def seen(self, model: str, version: int) -> int:
        """The version's counter now (0 before its first change)."""
        return self._count.get((model, version), 0)

    def bump(self, model: str, version: int) -> None:
        """The version's holders changed: wake its waiters."""
        key = (model, version)
        self._keep(key, self._count.pop(key, 0) + 1)
        self._wake(key)

    def _keep(self, key: tuple[str, int], count: int) -> None:
        """Set a counter, newest last; the oldest counters beyond ``_KEPT`` go,
        their waiters answered at once."""
        self._count[key] = count
        while len(self._count) > _KEPT:
            oldest = next(iter(self._count))
            del self._count[oldest]
            self._wake(oldest)

    def _wake(self, key: tuple[str, int]) -> None:
        event = self._events.pop(key, None)
        if event is not None:
            event.set()

    async def wait(self, model: str, version: int, seen: int, timeout_s: float) -> None:
        """Return once the version's counter differs from ``seen``, or after ``timeout_s``."""
        key = (model, version)
        if timeout_s <= 0 or self.seen(model, version) != seen:
            return
        event = self._events.get(key)
        if event is None:
            if key not in self._count:  # kept (and so forgotten) like any counter: no event outlives its key
                self._keep(key, 0)
            event = self._events[key] = asyncio.Event()
        try:
            await asyncio.wait_for(event.wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            pass
