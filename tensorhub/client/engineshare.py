"""One engine, two control messages per step: the workers of an engine share
its Resolve, its relays' announces and their last reports over the engine's
own channel (a ``torch.distributed`` CPU group: vLLM's world group among its
TP workers, ``tensorhub_vllm.groupshare``), and its first worker sends each
for all of them (``groupanswer`` draws the Hub's side).

    every worker, each update, in the same order (collective):
      exchange   all: its previous replica's withdrawal, the holders its previous pull read from
                 (``Hub.named_layouts``), and in the steady state (it named them) its announce of the
                 replica it is about to fill (``Hub.announce_ahead``: ``ahead``) ── gather ─▶ first worker
                 first worker ── Hub.resolve_for_group(withdrawals=, named_layouts=, announces=) ──▶ server:
                              the answer (the holders named, when all are there; else ranked), then
                              the withdrawals (drains together), then the announces
                              ──▶ answer + outcomes ─┐
                                                     ├─ broadcast ─▶ all: withdrawn, ahead_taken, pull(answer=)
                 a failed resolve: None, each resolves on its own; the withdrawals go in a Batch of
                 their own (a withdrawal not drained or not sent: its worker unpublishes alone before its pull)
      announce   skipped when the server took every worker's announce with the Resolve; else
                 all (inside pull, before any READ): its announce (b"": it went ahead) ── gather ─▶
                 first worker ── one Batch of the announces ──▶ server ── taken? ─▶ broadcast
                 (lean by layout from the second version on; one not taken, or a replica that differs
                 from what went ahead: that worker announces alone)
      finish     all: barrier (bounded) ─▶ gather the last reports (held) and pulled bytes
                 first worker ── one Batch: reports, pulled bytes, the answer's lease ──▶ server
                 a report the server did not take: its worker's heartbeat sends it

So a version costs the server three messages per engine (the Resolve with
the withdrawals, the announces, the end), and two in the steady state (the
announces with the Resolve), not four per worker. The answer is a few KiB in the steady
state (holders come lean), so its broadcast costs less than the Resolve each
worker would send. The lease must outlive every worker's reads, hence the
barrier before its release; it is bounded by the pull's own deadline, so a
worker that died cannot hang the others past it. Until the end's Batch
arrives the server lists the relays as filling with the chunks they reported
on the way, so peers read what they have.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tensorhub.client.groupanswer import GroupAnswer
from tensorhub.client.groupmessages import AnnounceOnce
from tensorhub.client.groupsend import sent_by_first
from tensorhub.client.hub import Hub, PullResult
from tensorhub.client.publication import Publication

log = logging.getLogger(__name__)

_BARRIER_SLACK_S = 60.0  # beyond the pull's own deadline: the slowest worker's apply-free end of its pull


@dataclass
class Withdrawal:
    """A worker's withdrawal of its previous replica, sent with the engine's:
    ``message`` from ``Hub.withdrawal`` (b"": none); ``done`` is called with its
    outcome (None: not sent) before the worker's pull, and finishes it
    (``Hub.withdrawn``: closed, or unpublished alone)."""

    message: bytes
    done: Callable[[Any], None]
    # The replica withdrawn, whose memory the pull fills again: its announce of
    # the next version goes ahead with the Resolve (``tensorhub.client.ahead``)
    publication: Publication | None = None


class EngineShare:
    """This worker's part in sharing its engine's control messages: ``group``
    is the engine's CPU process group (None: the default one), ``rank`` and
    ``world`` this worker's place in it."""

    def __init__(self, group: Any, rank: int, world: int, *, model: str, engine: str, pull_timeout_s: float) -> None:
        self._group, self.rank, self.world = group, rank, world
        self._model, self._engine = model, engine
        self._timeout = datetime.timedelta(seconds=pull_timeout_s + _BARRIER_SLACK_S)
        self._members: list[str] | None = None  # every worker's agent id, learnt at the first update

    def update(self, hub: Hub, version: int | str,
               pull: Callable[[GroupAnswer | None, Callable[[bytes], bool]], PullResult],
               withdrawal: Withdrawal | None = None) -> PullResult:
        """One update of this worker in step with the engine's others: the
        shared withdrawals and Resolve, then ``pull(answer, announce_with)``
        (which passes both to ``Hub.pull``, with ``defer_complete=True``), then
        the shared end. Every worker takes part in every round whatever fails
        on its side (a failed Resolve, a pull that raises before it announces),
        so that none waits on a round another skipped."""
        answer, failure = self.exchange(hub, version, withdrawal)
        # Every announce went ahead with the Resolve: no round (each worker knows it from the same answer)
        ahead = answer is not None and bool(answer.announced) and all(answer.announced)
        announce = AnnounceOnce(None if ahead else self.announcer(hub))
        result = None
        try:
            if failure is not None:
                raise failure
            result = pull(answer, announce)
            return result
        finally:
            announce(b"")  # this worker's turn in the announces' round, if its pull did not take it
            hub.forget_ahead(version)  # one no pull took (the resolve failed: no pull ran)
            self.finish(hub, answer, result)

    def exchange(self, hub: Hub, version: int | str, withdrawal: Withdrawal | None = None
                 ) -> tuple[GroupAnswer | None, BaseException | None]:
        """Every worker calls this once per update: the first sends the
        workers' withdrawals and resolves for all. Returns (the answer or None,
        this worker's own failure to raise: the first worker's resolve, a
        withdrawal that could not finish)."""
        if self._members is None:
            members: list[Any] = [None] * self.world
            dist.all_gather_object(members, hub.agent_id, group=self._group)
            self._members = [str(m) for m in members]
        layouts = hub.named_layouts(self._model)
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, (withdrawal.message if withdrawal is not None else b"", layouts,
                                          self._ahead(hub, version, withdrawal, layouts)), group=self._group)
        messages = [message for message, _, _ in gathered]
        # The group reads what its members read: all of them named, or none (a member's pull was not steady).
        named = tuple(dict.fromkeys(k for _, layouts, _ in gathered for k in layouts)) \
            if all(layouts for _, layouts, _ in gathered) else ()
        failure: BaseException | None = None
        sent: list[Any] = [None, [None] * self.world]
        if self.rank == 0:
            try:
                sent[0] = hub.resolve_for_group(self._model, version, group=self._engine, members=self._members,
                                                withdrawals=messages, named_layouts=named,
                                                announces=[ahead for _, _, ahead in gathered])
                sent[1] = list(sent[0].withdrawn)
            except Exception as e:  # noqa: BLE001  the others resolve on their own and meet it too
                failure = e
                if any(messages):  # the resolve handled none of them: in a Batch of their own
                    sent[1] = hub.send_group_withdrawals(messages)  # never raises: None for each where it failed
        dist.broadcast_object_list(sent, src=0, group=self._group)
        if sent[0] is not None and sent[0].announced:
            hub.ahead_taken(self._model, sent[0].version, sent[0].announced[self.rank])
        if withdrawal is not None:
            try:
                withdrawal.done(sent[1][self.rank])
            except Exception as e:  # noqa: BLE001  raised by this worker's pull (nothing of it is written)
                failure = failure or e
        return sent[0], failure

    def _ahead(self, hub: Hub, version: int | str, withdrawal: Withdrawal | None, layouts: tuple) -> bytes:
        """This worker's announce of ``version`` to go with the Resolve: in the
        steady state (its last pull named its holders), serving again into the
        memory it withdraws (``Hub.announce_ahead``); else b""."""
        if withdrawal is None or withdrawal.publication is None or not layouts or not isinstance(version, int) \
                or not hub.config.announce_ahead:
            return b""
        try:
            return hub.announce_ahead(withdrawal.publication, version)
        except Exception:  # never skip the engine's rounds: the pull announces as before
            log.warning("could not encode this worker's announce ahead; its pull announces", exc_info=True)
            return b""

    def announcer(self, hub: Hub) -> Callable[[bytes], bool]:
        """``pull(announce_with=)`` for this worker: every worker's announce
        goes to the first, which sends them in one message."""

        def announce(data: bytes) -> bool:
            # Bounded: a worker that died before its turn fails this round at the
            # pull's deadline (each then announces alone), not at the group's own timeout.
            return bool(sent_by_first([data], self._group, hub.send_group_announces,
                                      bound_s=self._timeout.total_seconds())[0])

        return announce

    def finish(self, hub: Hub, answer: GroupAnswer | None, result: PullResult | None) -> None:
        """Every worker's pull is over (``result``; None: it failed): the
        workers' last reports and the lease go to the server in one message."""
        mine = hub.member_report(result)
        gathered: list[Any] = [None] * self.world
        try:
            dist.monitored_barrier(group=self._group, timeout=self._timeout)
            dist.all_gather_object(gathered, mine, group=self._group)
        except BaseException:
            # A worker is gone: each sends its own (the lease with the first worker's).
            if hub.send_group_reports(answer if self.rank == 0 else None, [mine])[0]:
                hub.report_later(result)
            raise
        why: list[Any] = [hub.send_group_reports(answer, gathered) if self.rank == 0 else None]
        dist.broadcast_object_list(why, src=0, group=self._group)
        if why[0][self.rank]:
            log.info("the server did not take this worker's last report (%s); the heartbeat sends it",
                     why[0][self.rank])
            hub.report_later(result)
