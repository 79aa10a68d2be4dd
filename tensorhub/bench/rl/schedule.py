"""The random parts of a run, drawn once from the seed so that every method sees
the same stragglers and the same preemptions. Pure: no I/O, no clock."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MAX_BATCHES = 512  # generation draws per rollout slot; a run uses a few dozen


@dataclass(frozen=True, slots=True)
class Preemption:
    at_s: float  # seconds after the trainer's first step starts
    slots: tuple[int, ...]  # rollout slots killed together; replacements join replace_after_s later


@dataclass(frozen=True, slots=True)
class Schedule:
    gen_s: tuple[tuple[float, ...], ...]  # [slot][batch]: generation seconds
    preemptions: tuple[Preemption, ...]


def generation_times(slots: int, median_s: float, sigma: float, seed: int) -> tuple[tuple[float, ...], ...]:
    """Lognormal generation times (median ``median_s``): most batches near the
    median, a few several times longer (long answers: the stragglers)."""
    rng = random.Random(seed)
    mu = math.log(median_s) if median_s > 0 else -math.inf
    return tuple(tuple(rng.lognormvariate(mu, sigma) if median_s > 0 else 0.0 for _ in range(MAX_BATCHES))
                 for _ in range(slots))


def preemptions(*, spot: int, wave: int, waves: int, horizon_s: float, seed: int) -> tuple[Preemption, ...]:
    """``waves`` preemptions of ``wave`` spot slots (0..spot-1) each, at random
    times spread over the run's first ``horizon_s`` seconds, one per segment."""
    rng = random.Random(seed * 7919 + 1)
    out = []
    segment = horizon_s / max(waves, 1)
    for i in range(waves):
        at = segment * i + rng.uniform(0.1, 0.5) * segment
        slots = tuple(sorted(rng.sample(range(spot), wave)))
        out.append(Preemption(at_s=round(at, 3), slots=slots))
    return tuple(out)


def draw(cfg) -> Schedule:  # cfg: RLBenchConfig
    horizon = cfg.steps * max(cfg.step_s, cfg.gen_median_s) * 0.8
    preempt = preemptions(spot=cfg.spot, wave=cfg.wave, waves=cfg.waves, horizon_s=horizon,
                          seed=cfg.seed) if cfg.scenario == "elastic" else ()
    return Schedule(gen_s=generation_times(cfg.rollouts, cfg.gen_median_s, cfg.gen_sigma, cfg.seed),
                    preemptions=preempt)
