"""Asking the server again mid-pull who holds the version, and what its
answers, or its silence, say about the holders it lists.

    the pull's first resolve ──▶ ServerAnswers(first): its instance, its change counter
                                        │
    a round ends, holders run out ──▶ ask(wait_s) ──▶ resolve ─┬─ answered ──▶ same instance: as before
         (wait_s > 0: a long poll,                             │               a new one (a restart) ──┐
          from the last change seen)                           │                                       │
                                                               └─ ServerUnavailable ──▶ unanswered():  │
                                                                    the first time since an answer ────┤
                                                                                                       ▼
                                              resettling() for resettle_s: the holders announce their
                                              replicas again at their next heartbeats; meanwhile a
                                              holder missing or a lease refused does not mean it is gone

Asking while nothing changes backs off: a pull that reads on from the holders
it has asks after every round (how it learns of relays to read from), but an
answer that lists what the one before listed (the same holders, each as
complete as before, a filling one with the same chunks; the pull's own
replica is never listed, so its own reports change nothing here) doubles the
quiet time before the next ask, from ``QUIET_FIRST_S`` to ``QUIET_MAX_S``; a
change ends it. A lone serving reader of the trainer asked 17 times in a 5.6 s
pull, 8 with the quiet time (``tensorhub bench cluster --readers 1``), and a
thousand such readers would keep the server's one core busy answering "no change".

Why a module of its own: ``PullJob`` decides what a fresh list of holders
means for its rounds and leases (keep reading a withdrawn holder, let it go,
fail over); this class only keeps what the server's answers to one pull
said, so that every place the pull asks reads a restart or an outage alike.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from tensorhub.client.rpc import Resolved

log = logging.getLogger(__name__)

# Asking again while the answers stay the same: the quiet time after the
# first unchanged answer, doubled for each further one up to the most.
QUIET_FIRST_S = 0.05
QUIET_MAX_S = 2.0


class Resolves(Protocol):
    """The server's resolve (``ReferenceClient.resolve``), as a pull asks it again."""

    def resolve(self, agent_id: str, model: str, version: int | None, *, wait_change_s: float = 0.0,
                seen_change: int = 0) -> Resolved: ...


class ServerAnswers:
    """What the server told one pull so far: which instance answered, the
    version's change counter, and whether its holders are resettling."""

    def __init__(self, rpc: Resolves, agent_id: str, first: Resolved, *, resettle_s: float) -> None:
        self._rpc, self._agent_id = rpc, agent_id
        self._model, self._version = first.model, first.version
        self._resettle_s = resettle_s
        self._instance = first.instance_id  # the server instance that last answered a resolve of this pull
        self._seen_change = first.change  # the version's change counter in its last answer (a long poll's start)
        self._out_of_reach = False  # its last answer to this pull was none (ServerUnavailable)
        self._resettle_until = 0.0
        self.asked = 0  # resolves sent after the first answer (PullStats.refreshes)
        self._unchanged = 0  # answers in a row that listed what the one before did (the quiet time)
        self._listed = _listed(first)
        self.pace_s = first.pace_s  # the server's pace in its last answer (``pacing.server_pace_s``)

    def ask(self, wait_s: float = 0.0) -> Resolved:
        """Who holds the version now; ``wait_s`` > 0: once that changed since the
        last answer, or after that long. ServerUnavailable, VersionNotFound as
        the server raises them (``unanswered`` is the caller's to call)."""
        self.asked += 1
        if wait_s > 0:
            fresh = self._rpc.resolve(self._agent_id, self._model, self._version, wait_change_s=wait_s,
                                      seen_change=self._seen_change)
        else:
            fresh = self._rpc.resolve(self._agent_id, self._model, self._version)
        self._answered_by(fresh)
        return fresh

    def _answered_by(self, fresh: Resolved) -> None:
        """Note which server instance answered: a new one (a restart) knows no
        holder until they announce themselves again (``resettle_s``)."""
        self._out_of_reach = False
        listed = _listed(fresh)
        self._unchanged = self._unchanged + 1 if listed == self._listed else 0
        self._listed = listed
        self._seen_change = fresh.change
        self.pace_s = fresh.pace_s
        if fresh.instance_id and fresh.instance_id != self._instance:
            if self._instance:
                log.info("the server restarted mid-pull: its holders get %.0f s to announce themselves",
                         self._resettle_s)
                self._resettle_until = max(self._resettle_until, time.monotonic() + self._resettle_s)
            self._instance = fresh.instance_id

    @property
    def quiet_s(self) -> float:
        """How long to let pass since the last ask before asking again while the
        pull reads on: 0 until an answer repeats the one before, then doubling."""
        if not self._unchanged:
            return 0.0
        return min(QUIET_MAX_S, QUIET_FIRST_S * 2 ** (self._unchanged - 1))

    def unanswered(self) -> bool:
        """The server did not answer. The first time since its last answer, its
        holders get ``resettle_s`` (it may be restarting); True while they have it."""
        if not self._out_of_reach:
            self._out_of_reach = True
            self._resettle_until = max(self._resettle_until, time.monotonic() + self._resettle_s)
        return self.resettling()

    def resettling(self) -> bool:
        """Whether the server's holders may still be announcing themselves again."""
        return time.monotonic() < self._resettle_until


def _listed(answer: Resolved) -> tuple[str, frozenset[tuple[str, bool, bytes]]]:
    """What an answer says a pull can read: its server instance, and each
    holder's replica, whether it is complete, and a filling one's chunks."""
    return answer.instance_id, frozenset((r.source.replica_id, r.source.complete, b"" if r.source.complete
                                          else bytes(r.bitmap)) for r in answer.replicas)
