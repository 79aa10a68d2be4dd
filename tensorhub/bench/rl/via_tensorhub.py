"""Method ``tensorhub``: the trainer publishes each version and steps on; a
rollout that finishes a batch pulls the newest version if it has not got it
(serving what lands to the next ones), else generates on.

The trainer's stall is what it cannot skip: unpublishing the previous version
(which waits for reads in flight, and keeps a host copy if no reliable rollout
holds it) before its optimizer overwrites the buffer, and publishing the next.
A rollout's stall is its update: unpublishing what it served, then the pull
(again, for the newest version, if the one it pulled was let go meanwhile).
"""

from __future__ import annotations

import time
from typing import Any

from tensorhub.bench.rl import proc

RETRIES = 3


def trainer(events: Any, who: str, place: Any, address: str, cfg: Any, go: Any, stop: Any) -> None:
    proc.enter(place)
    from tensorhub import Hub

    with proc.reporting(events, who) as report:
        buf = proc.weights(cfg.size)
        proc.write_version(buf, 0)
        with Hub.connect(address, name=who, labels=place.labels, chunk_size=cfg.chunk_size) as hub:
            pub = hub.publish(proc.MODEL, 0, {"w": buf})
            report("ready", version=0)
            for version, t1 in proc.trainer_steps(report, cfg, go):
                pub.unpublish(timeout=proc.WAIT_TIMEOUT_S)  # the readers of the old version are done
                t2 = time.monotonic()
                proc.write_version(buf, version)
                t3 = time.monotonic()
                pub = hub.publish(proc.MODEL, version, {"w": buf})
                t4 = time.monotonic()
                report("stall", t1, t2, version=version, what="unpublish")
                report("stall", t3, t4, version=version, what="publish")
                report("publish", t4, t4, version=version)
            report("done")
            stop.wait(proc.WAIT_TIMEOUT_S)  # stay a holder until every rollout is done
            pub.unpublish(timeout=proc.WAIT_TIMEOUT_S)


def rollout(events: Any, who: str, place: Any, address: str, cfg: Any, gen_s: list[float], spot: bool,
            join_at: float | None, go: Any, stop: Any, preempt: Any) -> None:
    """``join_at``: None for a rollout of the start (it holds version 0 before the
    run starts), else the instant a replacement starts loading the newest version."""
    proc.enter(place)
    from tensorhub import Hub
    from tensorhub.errors import SourceLost, VersionNotFound

    with proc.reporting(events, who) as report:
        buf = proc.weights(cfg.size)
        into = {"w": buf}
        with Hub.connect(address, name=who, labels=place.labels, chunk_size=cfg.chunk_size,
                         chunk_timeout_s=cfg.chunk_timeout_s, reliability="spot" if spot else "reliable") as hub:
            served = None

            def update(version: int | str, what: str) -> int:
                nonlocal served
                t0 = time.monotonic()
                report("begin", what=what)
                if served is not None:
                    served.unpublish(timeout=proc.WAIT_TIMEOUT_S)  # nobody reads it while it is overwritten
                    served = None
                failures = []
                for retry in range(RETRIES + 1):
                    try:
                        result = hub.pull(proc.MODEL, version, into=into, serve=True)
                        break
                    except (SourceLost, VersionNotFound, KeyError) as e:
                        # SourceLost / VersionNotFound: the version was superseded mid-pull and its last
                        # holder let it go (retention keeps the latest only): as a real rollout would,
                        # take the newest. KeyError: a puller bug seen under relay (a replica's lease
                        # entry gone mid-round), reported, and listed in the row's failed_pulls.
                        failures.append(f"{type(e).__name__}: {e}"[:300])
                        if retry == RETRIES:
                            raise
                        version = "latest"
                t1 = time.monotonic()
                served = result.publication
                report.check(buf, result.version)
                report("stall", t0, t1, version=result.version, what=what, bytes=result.nbytes,
                       sources=result.bytes_by_source, retries=retry, failures=failures)
                report("hold", t1, t1, version=result.version)
                return result.version

            if join_at is None:
                hub.wait_for_version(proc.MODEL, 0, timeout=proc.WAIT_TIMEOUT_S)  # the trainer may start later
            proc.rollout_steps(report, lambda what: update(0 if what == "initial" else "latest", what),
                               lambda: hub.latest(proc.MODEL), join_at=join_at, gen_s=gen_s, go=go, stop=stop,
                               preempt=preempt)
            if served is not None:
                served.unpublish(timeout=proc.WAIT_TIMEOUT_S)
