"""How the rollouts' pulls reach verl's step metrics.

verl's ``CheckpointEngineManager`` logs what the trainer ranks' ``send_weights``
return and drops what the rollout workers return. So each rollout worker drops
a line (version, bytes, seconds) into a small named Ray actor per model, and
trainer rank 0 takes the lines when its next ``send_weights`` starts: the
update of step ``t`` reports the pulls of the updates before it (normally step
``t-1``'s, which verl's manager has waited for).

The actor is detached (a non-detached one goes as soon as the handle of the
worker that made it is dropped) and keeps at most ``_KEEP`` lines: it lives
with the cluster, like the reference server's actor. Metrics are best effort:
outside Ray, or if the actor cannot be reached within ``_TIMEOUT_S``, nothing
is recorded and training goes on.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

NAMESPACE = "tensorhub"
_TIMEOUT_S = 5.0
_KEEP = 4096  # lines kept if no trainer takes them (a trainer that is down)


@dataclass(frozen=True, slots=True)
class PullLine:
    worker: str
    version: int
    nbytes: int
    seconds: float


class PullLog:
    """The Ray actor: lines in arrival order, taken (and forgotten) by the trainer."""

    def __init__(self) -> None:
        self._lines: list[dict[str, Any]] = []

    def add(self, line: dict[str, Any]) -> None:
        self._lines = [*self._lines[-(_KEEP - 1):], line]

    def take(self) -> list[dict[str, Any]]:
        lines, self._lines = self._lines, []
        return lines


def record(model: str, line: PullLine) -> None:
    """Rollout side: drop a line; returns once it is stored (milliseconds; the
    first call starts the actor), so the trainer's next update finds it.
    Blocks: call it off the event loop."""
    ray = _ray()
    if ray is None:
        return
    try:
        actor = ray.remote(PullLog).options(name=_name(model), namespace=NAMESPACE, get_if_exists=True,
                                            lifetime="detached", num_cpus=0, scheduling_strategy="DEFAULT").remote()
        ray.get(actor.add.remote(asdict(line)), timeout=_TIMEOUT_S)
    except ray.exceptions.RayError as e:  # metrics must never fail a weight update
        log.warning("could not record the pull of %r version %d for the trainer's metrics: %s",
                    model, line.version, e)


def take(model: str) -> list[PullLine]:
    """Trainer side: the lines recorded since the last take (none if no rollout recorded any)."""
    ray = _ray()
    if ray is None:
        return []
    try:
        actor = ray.get_actor(_name(model), namespace=NAMESPACE)
        return [PullLine(**line) for line in ray.get(actor.take.remote(), timeout=_TIMEOUT_S)]
    except ValueError:  # no rollout has recorded a pull yet
        return []
    except ray.exceptions.RayError as e:  # timed out, or the actor died
        log.warning("could not read the rollouts' pulls of %r for the metrics: %s", model, e)
        return []


def summarize(lines: list[PullLine]) -> dict[str, float]:
    """Per rollout worker pull: how many, bytes and seconds (mean and worst), newest version."""
    if not lines:
        return {}
    mb = [line.nbytes / 2**20 for line in lines]
    seconds = [line.seconds for line in lines]
    return {
        "tensorhub/pull/workers": float(len({line.worker for line in lines})),
        "tensorhub/pull/version": float(max(line.version for line in lines)),
        "tensorhub/pull/mb_mean": sum(mb) / len(mb),
        "tensorhub/pull/mb_max": max(mb),
        "tensorhub/pull/seconds_mean": sum(seconds) / len(seconds),
        "tensorhub/pull/seconds_max": max(seconds),
    }


def _name(model: str) -> str:
    return f"tensorhub-verl-pulls:{model}"


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        return None
    return ray if ray.is_initialized() else None
