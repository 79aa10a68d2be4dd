"""The messages a group's members hand to its first member, who sends them in
one ``Batch`` (``engineshare`` draws the whole step; ``Hub`` fronts these):

    member: pull(announce_with=) ── its announce (AnnounceOnce: exactly once) ──────┐
                                                                                     ▼
    first member: announces(all) ──Batch(publishes)──▶ server ──▶ taken? per member (else it announces alone)

    member: Hub.withdrawal(its previous replica) ─┐  (at the update's start, with the Resolve)
                                                  ▼
    first member: withdrawals(all) ──Batch(withdrawals)──▶ server (drains waited for together)
        ──▶ outcome per member ──▶ Hub.withdrawn: drained, closed; else it unpublishes alone

    member: pull(defer_complete=True) ── member_report: last report held + pulled bytes ─┐
                                                                                          ▼
    first member: reports(answer, all) ──Batch(reports, pulled, the lease)──▶ server
        ──▶ why not taken, per member (that member: Hub.report_later, its heartbeat sends it)

Nothing here raises for the server: a Batch that fails as a whole leaves each
message to its own member, as if there were no group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from tensorhub.client.groupanswer import GroupAnswer, MemberReport
from tensorhub.client.rpc import ReferenceClient
from tensorhub.errors import TensorHubError

log = logging.getLogger(__name__)


class GroupMessages:
    """One process's side of its group's Batches (``agent_id``: this member)."""

    def __init__(self, rpc: ReferenceClient, agent_id: str) -> None:
        self._rpc, self._agent_id = rpc, agent_id

    def announces(self, announces: Sequence[bytes]) -> list[bool]:
        """Every member's announce (b"": none) in one message; per member, whether the server took it."""
        sent = [(i, a) for i, a in enumerate(announces) if a]
        taken = [False] * len(announces)
        if not sent:
            return taken
        try:
            errors, _, _ = self._rpc.batch(self._agent_id, publishes=[a for _, a in sent])
        except TensorHubError as e:
            log.info("the group's announces did not reach the server (%s); each member announces alone", e)
            return taken
        for (i, _), error in zip(sent, errors, strict=True):
            taken[i] = error is None
            if error is not None:
                log.info("the server did not take a member's announce in the group's Batch: %s", error)
        return taken

    def withdrawals(self, withdrawals: Sequence[bytes]) -> list[tuple[bool, int, bool] | Exception | None]:
        """Every member's withdrawal of its previous replica (``Holdings.withdrawal``;
        b"": none) in one message; per member its outcome (None: not sent, that
        member withdraws alone)."""
        sent = [w for w in withdrawals if w]
        if not sent:
            return [None] * len(withdrawals)
        try:
            outcomes = iter(self._rpc.withdraw_batch(sent))
        except TensorHubError as e:
            log.info("the group's withdrawals did not reach the server (%s); each member withdraws alone", e)
            return [None] * len(withdrawals)
        return [next(outcomes) if w else None for w in withdrawals]

    def member_report(self, held_report: bytes) -> MemberReport:
        """This member's end of the update: its held last report and the bytes its pulls read (taken)."""
        return MemberReport(self._agent_id, held_report, self._rpc.take_pulled_report(self._agent_id))

    def reports(self, answer: GroupAnswer | None, reports: Sequence[MemberReport]) -> list[str]:
        """Every member's report and ``answer``'s lease release in one message;
        per member, why its report was not taken ("" if it was)."""
        held = [(i, r) for i, r in enumerate(reports) if r.report]
        pulled = [r.pulled for r in reports if r.pulled]
        why = [""] * len(reports)
        if not held and not pulled and answer is None:
            return why
        try:
            _, errors, _ = self._rpc.batch(self._agent_id, reports=[r.report for _, r in held], releases=pulled,
                                           lease_id=answer.lease_id if answer is not None else "")
        except TensorHubError as e:
            log.info("the group's reports did not reach the server (%s); each member's heartbeat sends its own", e)
            return [f"not sent: {e}" if r.report else "" for r in reports]
        for (i, _), error in zip(held, errors, strict=True):
            why[i] = str(error) if error is not None else ""
        return why


class AnnounceOnce:
    """``pull(announce_with=)``, called exactly once per pull (b"": nothing to
    hand over), so that a collective behind it sees every member; a failure
    of the group's channel means announcing alone."""

    def __init__(self, announce_with: Callable[[bytes], bool] | None) -> None:
        self._announce_with, self._called = announce_with, announce_with is None

    @property
    def waiting(self) -> bool:
        """Whether a group waits for this pull's announce (else building it is wasted)."""
        return not self._called

    def __call__(self, data: bytes) -> bool:
        """Whether the group had ``data`` taken by the server."""
        if self._called:
            return False
        self._called = True
        try:
            return bool(self._announce_with(data)) and bool(data)  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001  the announce goes alone, as without a group
            log.warning("the group could not send this pull's announce (%s); sending it alone", e)
            return False
