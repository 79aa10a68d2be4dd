"""The seeded schedule of faults: the same seed gives the same list of
(when, kind, target pick, duration), so a run that found a bug can be repeated
(the processes' timing still varies; the JSON records what was applied when).

Kinds and what each does (faults.py):

=====================  =============================================================
``holder_kill``        SIGKILL a reader or a trainer rank mid-whatever; a new process
                       takes its host
``link_cut``           a host's switch port down for ``duration`` s (reader, trainer
                       rank or the server's host), then up again
``server_restart``     SIGKILL the reference server, start a new one on the same port
``slow_reader``        a reader's link capped at a few Mbit/s for ``duration`` s
``unpublish_mid_pull`` the trainer ranks unpublish the newest version while readers
                       pull it (the next step publishes a newer one)
=====================  =============================================================
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("holder_kill", "link_cut", "server_restart", "slow_reader", "unpublish_mid_pull")
# Relative frequencies: kills and restarts cost seconds of process start-up on
# a 2-core machine, so they are the rarer ones.
WEIGHTS = {"holder_kill": 0.15, "link_cut": 0.3, "server_restart": 0.08, "slow_reader": 0.22,
           "unpublish_mid_pull": 0.25}


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float  # seconds after the campaign's start
    kind: str
    pick: int  # which target, modulo the candidates at that moment
    duration_s: float = 0.0  # link_cut, slow_reader: how long until restored


def schedule(seed: int, seconds: float, *, mean_gap_s: float = 2.4, kinds: tuple[str, ...] = KINDS,
             warmup_s: float = 3.0) -> list[Fault]:
    """Faults from ``warmup_s`` until ``seconds``, gaps drawn from an exponential
    distribution of mean ``mean_gap_s`` (a Poisson process), kinds by WEIGHTS."""
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"fault kinds must be some of {KINDS}, not {sorted(unknown) or 'none'}")
    rng = random.Random(seed)
    weights = [WEIGHTS[k] for k in kinds]
    faults, t = [], warmup_s
    while True:
        t += rng.expovariate(1.0 / mean_gap_s)
        if t >= seconds:
            return faults
        kind = rng.choices(kinds, weights)[0]
        duration = {"link_cut": rng.uniform(1.0, 6.0), "slow_reader": rng.uniform(2.0, 8.0)}.get(kind, 0.0)
        faults.append(Fault(round(t, 3), kind, rng.randrange(1 << 30), round(duration, 3)))
