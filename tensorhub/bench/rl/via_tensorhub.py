"""Method ``tensorhub``: the trainer publishes each version and steps on; a
rollout that finishes a batch pulls the newest version if it has not got it
(serving what lands to the next ones), else generates on.

The trainer's stall is what it cannot skip: unpublishing the previous version
(which waits for reads in flight, and keeps a host copy if no reliable rollout
holds it) before its optimizer overwrites the buffer, and publishing the next.
A rollout's stall is its update: unpublishing what it served, then the pull
(again, for the newest version, if the one it pulled was let go meanwhile).

Across zones (crossdc) the far zone has a seed (``seed``): a process on its own
host that holds versions in host memory (no GPU) and pulls each new version
across the slow link as soon as it is published. The zone's rollouts move to
the newest version their zone holds (``Hub.latest_near``), not to ``latest``:
they generate on while the next version crosses, then read it from the seed
over their own link. The version crosses once, and no rollout waits for it.
"""

from __future__ import annotations

import time
from typing import Any

from tensorhub.bench.rl import lora, proc, trace

RETRIES = 3
NOTICE_S = 30.0  # a spot notice's length: the longest a preempted rollout waits for its readers
NEAR_POLL_S = 0.2  # a far rollout waiting for its zone's first version asks this often


class Weights:
    """What the trainer makes each step: the whole weights buffer, published in
    place (with ``delta``: and its delta from the last version)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.buf = proc.weights(cfg.size)
        proc.write_version(self.buf, 0)
        # delta: the last version's bytes, to take the next one's delta against
        # (published in place, the buffer itself no longer has them)
        self.prev = proc.weights(cfg.size) if cfg.delta else None

    def publish(self, hub: Any, version: int) -> Any:
        delta = {"delta_from": version - 1, "previous": {"w": self.prev}} if self.prev is not None and version else {}
        return hub.publish(proc.MODEL, version, {"w": self.buf}, **delta)

    def step(self, report: Any, version: int) -> None:
        """The optimizer step, in place (its delta's copy of the last version first: a stall)."""
        if self.prev is not None:
            t0 = time.monotonic()
            self.prev.copy_(self.buf)
            report("stall", t0, time.monotonic(), version=version, what="delta copy")
        proc.write_version(self.buf, version, self.cfg.changed)

    def close(self) -> None:
        """Nothing to release: its buffers are plain tensors (the LoRA trainer's close has work to do)."""


def trainer(events: Any, who: str, place: Any, address: str, cfg: Any, go: Any, stop: Any) -> None:
    proc.enter(place)
    trace.install(cfg.trace, "tensorhub", who)
    from tensorhub import Hub

    with proc.reporting(events, who) as report:
        made = lora.Adapter(cfg) if cfg.lora_rank else Weights(cfg)
        with Hub.connect(address, name=who, labels=place.labels, chunk_size=cfg.chunk_size) as hub:
            pub = made.publish(hub, 0)
            report("ready", version=0)
            for version, t1 in proc.trainer_steps(report, cfg, go):
                pub.unpublish(timeout=proc.WAIT_TIMEOUT_S)  # the readers of the old version are done
                t2 = time.monotonic()
                made.step(report, version)
                t3 = time.monotonic()
                pub = made.publish(hub, version)
                t4 = time.monotonic()
                report("stall", t1, t2, version=version, what="unpublish")
                report("stall", t3, t4, version=version, what="publish")
                report("publish", t4, t4, version=version)
            report("done")
            stop.wait(proc.WAIT_TIMEOUT_S)  # stay a holder until every rollout is done
            pub.unpublish(timeout=proc.WAIT_TIMEOUT_S)
            made.close()


def rollout_hub(address: str, who: str, place: Any, cfg: Any, spot: bool = False) -> Any:
    """A rollout's (or the seed's) Hub: its host's labels, the run's chunks, spot or reliable."""
    from tensorhub import Hub

    return Hub.connect(address, name=who, labels=place.labels, chunk_size=cfg.chunk_size,
                       chunk_timeout_s=cfg.chunk_timeout_s, reliability="spot" if spot else "reliable")


def retried(pull: Any) -> tuple[Any, int, list[str]]:
    """``pull(retry)`` until it succeeds, at most ``RETRIES`` times again; returns
    its result, the retries and why each failed."""
    from tensorhub.errors import SourceLost, VersionNotFound

    failures: list[str] = []
    for retry in range(RETRIES + 1):
        try:
            return pull(retry), retry, failures
        except (SourceLost, VersionNotFound, KeyError) as e:
            # SourceLost / VersionNotFound: the version was superseded mid-pull and its last
            # holder let it go (retention keeps the latest only): as a real rollout would,
            # take the newest. KeyError: a puller bug seen under relay (a replica's lease
            # entry gone mid-round), reported, and listed in the row's failed_pulls.
            failures.append(f"{type(e).__name__}: {e}"[:300])
            if retry == RETRIES:
                raise
    raise AssertionError("unreachable")


def _pull(hub: Any, version: Any, into: dict, have: int | None = None) -> tuple[Any, int, list[str]]:
    """``hub.pull(..., serve=True)`` of ``version()`` (asked again on each try;
    ``have``: the version ``into`` holds), retried."""
    return retried(lambda retry: hub.pull(proc.MODEL, version(), into=into, serve=True,
                                          have=have if retry == 0 else None))


def _wait_near(hub: Any) -> None:
    """Until some holder of the caller's zone has a version (the seed's first)."""
    from tensorhub.errors import VersionNotFound

    deadline = time.monotonic() + proc.WAIT_TIMEOUT_S
    while True:
        try:
            hub.latest_near(proc.MODEL)
            return
        except VersionNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(NEAR_POLL_S)


def rollout(events: Any, who: str, place: Any, address: str, cfg: Any, gen_s: list[float], spot: bool,
            join_at: float | None, go: Any, stop: Any, preempt: Any) -> None:
    """``join_at``: None for a rollout of the start (it holds version 0 before the
    run starts), else the instant a replacement starts loading the newest version."""
    proc.enter(place)
    trace.install(cfg.trace, "tensorhub", who)
    far = cfg.scenario == "crossdc"  # the far zone has a seed: move to what it holds
    with proc.reporting(events, who) as report:
        buf = proc.weights(cfg.size)
        into = {"w": buf}
        with rollout_hub(address, who, place, cfg, spot) as hub:
            served = None
            held: int | None = None  # the version ``buf`` holds whole
            newest = (lambda: hub.latest_near(proc.MODEL)) if far else (lambda: hub.latest(proc.MODEL))

            def update(what: str) -> int:
                nonlocal served, held
                t0 = time.monotonic()
                report("begin", what=what)
                if served is not None:
                    served.unpublish(timeout=proc.WAIT_TIMEOUT_S)  # nobody reads it while it is overwritten
                    served = None
                if far:
                    version = newest
                else:
                    version = (lambda: 0) if what == "initial" else (lambda: "latest")
                have, held = (held if cfg.delta else None), None  # overwritten from here on
                result, retries, failures = _pull(hub, version, into, have)
                t1 = time.monotonic()
                served, held = result.publication, result.version
                report.check(buf, result.version)
                report("stall", t0, t1, version=result.version, what=what, bytes=result.nbytes,
                       sources=result.bytes_by_source, retries=retries, failures=failures,
                       read_bytes=result.read_bytes, delta_from=result.delta_from)
                report("hold", t1, t1, version=result.version)
                return result.version

            def notice() -> None:
                # A spot rollout's notice: withdraw what it serves (readers mid-pull finish or
                # move on), so no joiner is planned onto it after the kill; only a kill without
                # notice is left to the readers' failover and the server's agent TTL.
                hub.close(timeout=NOTICE_S)

            if join_at is None:
                hub.wait_for_version(proc.MODEL, 0, timeout=proc.WAIT_TIMEOUT_S)  # the trainer may start later
                if far:
                    _wait_near(hub)
            proc.rollout_steps(report, update, newest, join_at=join_at, gen_s=gen_s, go=go, stop=stop,
                               preempt=preempt, on_notice=notice if spot else None)
            if served is not None:
                served.unpublish(timeout=proc.WAIT_TIMEOUT_S)


def seed(events: Any, who: str, place: Any, address: str, cfg: Any, go: Any, stop: Any) -> None:
    """The far zone's seed: two buffers in host memory, the newest version it
    has served from one while the next crosses into the other (rollouts still
    reading the older one finish first: its unpublish waits for them). Not a
    rollout: it generates nothing, so it has no stall; its ``hold`` events
    show when each version reached the zone."""
    proc.enter(place)
    trace.install(cfg.trace, "tensorhub", who)
    from tensorhub.errors import VersionNotFound

    with proc.reporting(events, who) as report:
        bufs = [proc.weights(cfg.size), proc.weights(cfg.size)]
        served: list[Any] = [None, None]
        with rollout_hub(address, who, place, cfg) as hub:
            held, slot = -1, 1

            def newer() -> int:
                # The newest version, never one it holds (the trainer may have let
                # its newer ones go at the run's end): that ends the pull as lost.
                latest = hub.latest(proc.MODEL)
                if latest <= held:
                    raise VersionNotFound(proc.MODEL, f"> {held}", "nothing newer than the seed's")
                return latest

            def fetch() -> None:
                nonlocal held, slot
                nxt = slot ^ 1  # the buffer of the older version: its readers finish first
                if served[nxt] is not None:
                    served[nxt].unpublish(timeout=proc.WAIT_TIMEOUT_S)
                    served[nxt] = None
                t0 = time.monotonic()
                result, retries, failures = _pull(hub, newer if held >= 0 else (lambda: 0), {"w": bufs[nxt]})
                t1 = time.monotonic()
                slot, served[nxt], held = nxt, result.publication, result.version
                report.check(bufs[slot], held)
                report("seed", t0, t1, version=held, bytes=result.nbytes, sources=result.bytes_by_source,
                       retries=retries, failures=failures)
                report("hold", t1, t1, version=held)

            hub.wait_for_version(proc.MODEL, 0, timeout=proc.WAIT_TIMEOUT_S)
            fetch()
            report("ready", version=held)
            if not go.wait(proc.WAIT_TIMEOUT_S):
                raise TimeoutError("the run did not start")
            while not stop.is_set():
                try:
                    hub.wait_for_version(proc.MODEL, held + 1, timeout=NEAR_POLL_S)
                    fetch()
                except VersionNotFound:  # none newer yet, or the newer ones went before it got them
                    continue
            report("done")


def lone_copy_s(cfg: Any, where: dict, reps: int = 3) -> float:
    """What one joiner alone takes to pull a version on the same hosts: the
    trainer's host publishes it, rollout slot r0's host pulls it, nothing else
    runs (the elastic scenario's joins are compared with it). Median of ``reps``."""
    from tensorhub.local.hubprocess import HubProcess
    from tensorhub.local.serverprocess import ServerProcess

    server_place, trainer_place, joiner_place = where["server"], where["trainer"], where["r0"]
    # what a join pulls: the version (LoRA mode: the base and an adapter, one buffer here)
    specs = [("w", "uint8", (cfg.size + (lora.matrix_bytes(cfg) if cfg.lora_rank else 0),))]
    with ServerProcess(host=server_place.addr, netns=server_place.netns, retain=0,
                       lease_ttl_s=cfg.lease_ttl_s) as server, \
            HubProcess(server.address, name="lone-trainer", netns=trainer_place.netns, env=trainer_place.env,
                       labels=trainer_place.labels, chunk_size=cfg.chunk_size) as trainer, \
            HubProcess(server.address, name="lone-joiner", netns=joiner_place.netns, env=joiner_place.env,
                       labels=joiner_place.labels, chunk_timeout_s=cfg.chunk_timeout_s) as joiner:
        trainer.call("publish", model=proc.MODEL, version=1, specs=specs, seed=1, chunk_size=cfg.chunk_size)
        seconds = []
        for _ in range(reps):
            got = joiner.call("pull", model=proc.MODEL, version=1, specs=specs, expect_seed=1, timeout=300)
            if got["mismatched"]:
                raise RuntimeError("the lone copy received wrong bytes")
            seconds.append(got["end"] - got["start"])
        trainer.call("unpublish", model=proc.MODEL, version=1)
    return sorted(seconds)[len(seconds) // 2]
