"""``trace=<folder>``: what each process of a TensorHub run did, for finding
where an update's time goes (off by default: it costs a log line per round).

Each process writes ``<folder>/<method>-<who>.log``: tensorhub's own logs at
DEBUG, and for every pull, from wrappers around the puller's steps (the
puller itself is untouched):

    pull start  version, the holders it was told of (name, complete/filling, origin)
    round       chunks planned per holder, how many from filling peers, in the air
    refresh     the holders listed now
    lost        a holder marked lost (why)
    lease       holders leased, withdrawn, released mid-pull

Times are ``time.monotonic()``, the clock of the run's events.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import Counter
from typing import Any

import numpy as np

log = logging.getLogger("tensorhub.bench.rl.trace")


def _holders(replicas: Any) -> str:
    out = []
    for r in replicas:
        s = r.source
        out.append(f"{s.agent_name}[{'C' if s.complete else 'F'}{'o' if s.origin else ''}"
                   f"{'s' if s.reliability.value == 'spot' else ''} {s.replica_id[-6:]}]")
    return " ".join(out)


def _wrap(cls: Any, name: str, before: Any = None, after: Any = None) -> None:
    inner = getattr(cls, name)

    @functools.wraps(inner)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        if before is not None:
            before(self, *args, **kwargs)
        out = inner(self, *args, **kwargs)
        if after is not None:
            after(self, out, time.monotonic() - t0, *args, **kwargs)
        return out

    setattr(cls, name, wrapper)


def install(folder: str, method: str, who: str) -> None:
    """Log to ``folder`` from now on in this process; no-op when ``folder`` is empty."""
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{method}-{who}.log")
    open(path, "w").close()
    # Appending: NIXL's first agent runs logging.config.dictConfig, which closes
    # every handler; a FileHandler in "a" mode opens its file again on the next record.
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter("%(created).3f mono=%(mono).3f %(threadName)s %(name)s: %(message)s"))
    handler.addFilter(_Mono())
    root = logging.getLogger("tensorhub")
    root.setLevel(logging.DEBUG)
    root.addHandler(handler)

    from tensorhub.client import puller

    job = puller.PullJob

    def start(self: Any) -> None:
        r = self.resolved
        log.info("pull start v%d chunks=%d holders: %s", r.version, self.layout.num_chunks, _holders(r.replicas))

    def rounded(self: Any, out: Any, took: float, transfers: dict, maps: dict, needed: set, *a: Any, **k: Any) -> None:
        per = Counter(maps[t.replica_id].replica.source.agent_name for ts in transfers.values() for t in ts
                      if t.replica_id in maps)
        log.info("round %.3fs planned=%d %s relayed=%d needed_after=%d flying=%d", took, len(transfers),
                 dict(per), len(getattr(self, "_relayed", ()) or ()), len(needed), len(self._flying))

    def refreshed(self: Any, out: dict, took: float, *a: Any, **k: Any) -> None:
        log.info("refresh %.3fs holders: %s", took, _holders(m.replica for m in out.values()))

    def lost(self: Any, replica: Any, reason: str, *a: Any) -> None:
        log.info("lost %s: %s", replica.source.agent_name, reason)

    def released(self: Any, gone: set, *a: Any) -> None:
        log.info("release leases of %s", sorted(gone))

    def batched(self: Any, out: tuple, took: float, needed: set, usable: list, *a: Any, **k: Any) -> None:
        peers = [m for m in usable if not m.replica.source.complete]
        have = " ".join(f"{m.replica.source.agent_name}={_spans(np.flatnonzero(m.covered > 0))}" for m in peers)
        log.info("batch %s of %d needed %s; unsettled=%d checking=%d; peers hold %s", _spans(out), len(needed),
                 _spans(needed), len(self._checks._waits), len(self._checks._running), have)

    from tensorhub.client import holdings

    def reported(self: Any, pub: Any, chunks: list, complete: bool = False) -> None:
        log.info("report %s%s", _spans(chunks), " complete" if complete else "")

    _wrap(job, "run", before=start)
    _wrap(job, "_read_round", after=rounded)
    _wrap(job, "_refresh_quietly", after=refreshed)
    _wrap(job, "_refresh", after=refreshed)
    _wrap(job, "_lose", before=lost)
    _wrap(job, "_release", before=released)
    _wrap(job, "_batch", after=batched)
    _wrap(holdings.Holdings, "report_landed", before=reported)
    from tensorhub.client import rpc

    def sent(self: Any, out: Any, took: float, agent_id: str, replica_id: str, chunks: list, *a: Any) -> None:
        log.info("report_chunks %s answered in %.3fs", _spans(chunks), took)

    def resolved(self: Any, out: Any, took: float, *a: Any, **k: Any) -> None:
        log.info("resolve v%d %.3fs: %s", out.version, took, " ".join(
            f"{r.source.agent_name}:{'C' if r.source.complete else sum(b.bit_count() for b in r.bitmap)}"
            for r in out.replicas))

    _wrap(rpc.ReferenceClient, "report_chunks", after=sent)
    _wrap(rpc.ReferenceClient, "resolve", after=resolved)


def _spans(chunks: Any) -> str:
    """``[0-3,7,9-12]``: chunk ids as ranges."""
    ids = sorted(int(c) for c in chunks)
    out: list[list[int]] = []
    for c in ids:
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return "[" + ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out) + "]"


class _Mono(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.mono = time.monotonic()
        return True
