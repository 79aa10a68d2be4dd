"""Method ``tensorhub`` in LoRA mode (``lora_rank > 0``): the trainer
(``via_tensorhub.trainer`` with ``lora.Adapter``) publishes the frozen base once
(version 0 of its model) and each step only an adapter version
(``tensorhub.lora.publish_adapter``: its live LoRA matrices in place, as a
PEFT trainer does); a rollout pulls the base once, serving it, and after
each batch pulls the newest adapter version (``tensorhub.lora.pull_adapter``),
serving that too, so that the other rollouts can read it from it.

Stalls are counted as in ``via_tensorhub``: the trainer's unpublish of the
last adapter and publish of the next, a rollout's unpublish and pull.
"""

from __future__ import annotations

import time
from typing import Any

from tensorhub.bench.rl import lora, proc, trace
from tensorhub.bench.rl.via_tensorhub import NOTICE_S, retried, rollout_hub


def rollout(events: Any, who: str, place: Any, address: str, cfg: Any, gen_s: list[float], spot: bool,
            join_at: float | None, go: Any, stop: Any, preempt: Any) -> None:
    """As ``via_tensorhub.rollout`` (one zone): its first update, at the start or on joining, also pulls the base."""
    proc.enter(place)
    trace.install(cfg.trace, "tensorhub", who)
    from tensorhub.lora import pull_adapter

    with proc.reporting(events, who) as report:
        base = proc.weights(cfg.size)
        staging: dict = {}  # the adapter lands in one buffer kept across versions (registered once)
        with rollout_hub(address, who, place, cfg, spot) as hub:
            serving: dict[str, Any] = {}  # model (base, adapter) -> the publication of it this rollout serves

            def update(what: str) -> int:
                t0 = time.monotonic()
                report("begin", what=what)
                old = serving.pop(lora.MODEL, None)
                if old is not None:
                    old.unpublish(timeout=proc.WAIT_TIMEOUT_S)  # nobody reads it while it is overwritten
                retries, failures = 0, []
                sources: dict[str, int] = {}
                nbytes = read = 0
                if proc.MODEL not in serving:  # the first update: the frozen base, once
                    result, retries, failures = retried(
                        lambda _: hub.pull(proc.MODEL, 0, into={"w": base}, serve=True))
                    report.check(base, 0)
                    serving[proc.MODEL], nbytes, read = result.publication, result.nbytes, result.read_bytes
                    sources.update(result.bytes_by_source)
                wanted = 0 if what == "initial" else "latest"
                got, more, why = retried(lambda _: pull_adapter(hub, lora.MODEL, wanted, staging=staging, serve=True))
                t1 = time.monotonic()
                serving[lora.MODEL] = got.result.publication
                if not lora.holds(got.tensors, got.version):
                    raise RuntimeError(f"{who}: the adapter it holds is not version {got.version}'s")
                for source, n in got.result.bytes_by_source.items():
                    sources[source] = sources.get(source, 0) + n
                report("stall", t0, t1, version=got.version, what=what, bytes=nbytes + got.result.nbytes,
                       sources=sources, retries=retries + more, failures=failures + why,
                       read_bytes=read + got.result.read_bytes, delta_from=None)
                report("hold", t1, t1, version=got.version)
                return got.version

            def notice() -> None:
                hub.close(timeout=NOTICE_S)  # as via_tensorhub: withdraw what it serves before the kill

            if join_at is None:
                hub.wait_for_version(lora.MODEL, 0, timeout=proc.WAIT_TIMEOUT_S)  # the trainer may start later
            proc.rollout_steps(report, update, lambda: hub.latest(lora.MODEL), join_at=join_at, gen_s=gen_s,
                               go=go, stop=stop, preempt=preempt, on_notice=notice if spot else None)
            for pub in serving.values():
                pub.unpublish(timeout=proc.WAIT_TIMEOUT_S)
