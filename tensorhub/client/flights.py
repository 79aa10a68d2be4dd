"""The READs of one pull in flight, across its rounds: their deadlines, their
polling, the ones given up on, and the drain when the pull ends.

    post ──▶ add(chunk, transfer, handle, deadline(source))
                │
                ▼
    poll(): each READ in flight, in posting order ──┬─ not done, before its deadline: stays
                ▲                                   ├─ not done, past it: deadline(source) again;
                │                                   │    later (lease renewed, source progressed): stays,
                │                                   │    its holder alive to the server: stays,
                │                                   │    else it stalled ──▶ given up ─┐
                │                                   ├─ failed ─────────────────────────┤
                │                                   └─ done ───────────────────────────┤
                │                                                                      ▼
                └──── settle(finished): out of flight, released (not the given-up ones),
                      and the given-up ones that ended since are released (reap)

    pull ends ──▶ drop(): each READ still out gets drain_s() to finish, then released

A stall is silence without an error: a dead holder, or a live one whose bytes
to this reader queue behind others' (16 readers of one trainer over one
100 Mbit/s link starve each other's TCP flows for many seconds: ``tensorhub
bench cluster --readers 16 --size 64MiB``). A READ past its deadline that no
other holder can replace is given up on only once the server says its holder
stopped heartbeating (``wait_on``, the puller's), else it waits on, never past
its lease or the pull's deadline. Given up on, a live holder's READ would be
asked of it again: the same bytes twice over the starved link.

A READ cannot be cancelled (NIXL 1.5): released unfinished, it may still land
bytes later. So a READ given up on stays polled until it ends, and the pull's
read leases, which keep its source's memory as it was, outlive it.

Why a module of its own: ``PullJob`` decides what to read and what a failed
READ means for its chunk and its source (failover); this class keeps the
READs' own bookkeeping, so that no handle is lost track of (a handle released
too early may land bytes in memory the caller reused). It knows no chunk
accounting, no planning and no server beyond the read leases' expiry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from tensorhub.client.leases import PullLeases
from tensorhub.client.rpc import RemoteReplica
from tensorhub.client.transfer import Transfer
from tensorhub.errors import TensorHubError
from tensorhub.transport import TransferFailed

_DRAIN_S = 5.0  # at most this long for a failed pull's READs still out to finish (see drain_s)
_DRAIN_POLL_S = 2e-3  # how often a draining READ is polled
_DETECTION_SLACK_S = 0.5  # the transport's failure reaching our poll after its detection fired


class Handles(Protocol):
    """What the flights ask of the transport (``NixlAgent``): a posted READ polled, then released."""

    def poll(self, pending: Any) -> bool: ...

    def release(self, pending: Any) -> None: ...


def drain_s(chunk_timeout_s: float, failure_detection_s: float | None) -> float:
    """How long the READs still out when a pull ends get to finish before they
    are released. A READ cannot be cancelled: released unfinished, it may still
    land bytes in the destination later. One from a live source ends within the
    chunk timeout (``_DRAIN_S`` at most: the caller is waiting); one from a source
    that vanished ends when the transport fails it, so the drain lasts at least
    that long when it is known and finite (UCX's TCP settings; a user who set
    them longer than TensorHub's defaults gets a longer drain, not late bytes).
    The fault campaign with UCX's detection off had 3 pulls whose given-up READs
    landed a newer version's bytes after the pull returned."""
    base = min(chunk_timeout_s, _DRAIN_S)
    if failure_detection_s is None or failure_detection_s == float("inf"):
        return base
    return max(base, failure_detection_s + _DETECTION_SLACK_S)


@dataclass(eq=False, slots=True)  # compared by identity: a transfer holds descriptor arrays
class Flight:
    """One READ in flight: of ``chunk``, from ``replica``, due by ``deadline``."""

    chunk: int
    transfer: Transfer
    handle: Any
    deadline: float  # when to look at it again: its stall, its lease's renewal or the pull's end
    replica: RemoteReplica
    posted_at: float = 0.0  # (monotonic) or when it was last waited on (``_waits_on``)


class Flights:
    """The READs one pull has in flight, and those it gave up on but that have not ended."""

    def __init__(self, transport: Handles, leases: PullLeases, *, chunk_timeout_s: float, deadline: float,
                 drain_time_s: float, wait_on: Callable[[Flight], bool] | None = None) -> None:
        self._transport, self._leases = transport, leases
        self._wait_on = wait_on  # whether a stalled READ is worth waiting for (None: never)
        # chunk_timeout_s: a READ's time without progress from its source; deadline: the pull's (monotonic);
        # drain_time_s: the READs still out at the end get this long to finish (``drain_s``)
        self._chunk_timeout_s, self._deadline, self._drain_time_s = chunk_timeout_s, deadline, drain_time_s
        self._flying: list[Flight] = []
        # READs given up on (stalled) but not finished: NIXL 1.5 cannot cancel them
        # (a released one may still land), so they are polled until they end and the
        # pull's leases, which keep their sources' memory as it was, outlive them.
        self._given_up: list[Any] = []
        # Per source: when a READ from it last finished. A READ queued behind others on
        # a slow link is not stalled while its source makes progress.
        self._source_progress: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._flying)

    def chunks(self) -> set[int]:
        """The chunks with a READ in flight."""
        return {f.chunk for f in self._flying}

    def from_source(self, replica_id: str) -> int:
        """How many READs from ``replica_id`` are in flight."""
        return sum(1 for f in self._flying if f.transfer.replica_id == replica_id)

    def deadline(self, replica_id: str, now: float, posted_at: float | None = None) -> float:
        """Until when a READ from ``replica_id`` (posted now, or polled: posted
        at ``posted_at``) may take: ``chunk_timeout_s`` from its posting or the
        last READ from that source to finish, whichever came later, and never
        past the pull's deadline; looked at again when its read lease is due
        for renewal (renewed then: a READ waiting on a starved link for longer
        than the lease's TTL keeps its lease). 0 when no lease covers the source
        any more. TensorHubError if the lease cannot be renewed (posting)."""
        lease = self._leases.covering(replica_id)
        if lease is None:
            return 0.0
        try:
            lease.valid_until()
        except TensorHubError:
            if posted_at is not None:  # polling: the READ ends here, under the lease it was posted under
                self._leases.forget(replica_id)
                return 0.0
            raise
        progress = max(now if posted_at is None else posted_at, self._source_progress.get(replica_id, 0.0))
        return min(progress + self._chunk_timeout_s, lease.renewal_due(), self._deadline)

    def add(self, chunk: int, transfer: Transfer, handle: Any, deadline: float, replica: RemoteReplica) -> None:
        """A READ just posted."""
        self._flying.append(Flight(chunk, transfer, handle, deadline, replica, time.monotonic()))

    def newest_landed(self) -> bool:
        """Whether the READ posted last of those in flight has already finished.
        A failed one counts as finished: ``poll`` meets its failure and the pull
        fails its source over (the fault campaign saw NIXL_ERR_REMOTE_DISCONNECT
        escape from here untyped). False with none in flight."""
        if not self._flying:
            return False
        try:
            return self._transport.poll(self._flying[-1].handle)
        except TransferFailed:
            return True

    def poll(self) -> Iterator[tuple[Flight, TransferFailed | None]]:
        """The READs in flight that finished, one at a time, as each is polled:
        landed (None) or failed. One past its deadline, which a renewed lease or
        its source's progress does not move on, fails as stalled and is given up
        on: polled by ``settle`` until it ends. Each stays in flight until
        ``settle`` is told it finished."""
        for flight in self._flying:
            try:
                if not self._transport.poll(flight.handle):
                    now = time.monotonic()
                    if now <= flight.deadline:
                        continue
                    flight.deadline = self.deadline(flight.transfer.replica_id, now, posted_at=flight.posted_at)
                    if now <= flight.deadline or self._waits_on(flight, now):
                        continue  # its lease was renewed, its source made progress, or is alive
                    raise TransferFailed(flight.transfer.replica_id, "no completion before the reader's deadline",
                                         stalled=True)
            except TransferFailed as e:
                if e.stalled and self._waits_on(flight, time.monotonic()):  # a push holder's silence
                    continue
                if e.stalled:
                    self._given_up.append(flight.handle)
                failure: TransferFailed | None = e
            else:
                failure = None
            yield flight, failure

    def _waits_on(self, flight: Flight, now: float) -> bool:
        """A READ past its deadline with no error: whether to wait on (``wait_on``
        says so, and its lease and the pull have time left), with a new deadline
        a chunk timeout away."""
        rid = flight.transfer.replica_id
        if self._wait_on is None or now >= self._deadline or not self._wait_on(flight):
            return False
        try:
            flight.deadline = self.deadline(rid, now)
        except TensorHubError:  # the lease could not be renewed
            return False
        flight.posted_at = now  # its clock starts again
        return now < flight.deadline

    def progressed(self, replica_id: str) -> None:
        """A READ from ``replica_id`` landed: its other READs get ``chunk_timeout_s`` from now."""
        self._source_progress[replica_id] = time.monotonic()

    def settle(self, finished: list[Flight]) -> None:
        """Take the ``finished`` READs out of flight and release them (not the
        given-up ones: they are polled until they end); release the given-up
        READs that ended since."""
        if finished:
            gone = {id(f) for f in finished}
            self._flying[:] = [f for f in self._flying if id(f) not in gone]
        for f in finished:
            if not any(f.handle is h for h in self._given_up):
                self._transport.release(f.handle)
        self._reap_given_up()

    def _reap_given_up(self) -> None:
        """Release the given-up READs that have ended (done or failed)."""
        left = []
        for handle in self._given_up:
            try:
                ended = self._transport.poll(handle)
            except TransferFailed:
                ended = True
            if ended:
                self._transport.release(handle)
            else:
                left.append(handle)
        self._given_up = left

    def drop(self) -> list[Transfer]:
        """Let go of the READs still out when the pull ends (in flight, or given
        up on earlier). Each first gets a short while to finish (its lease is
        still held): released unfinished, a READ on a slow link can still land
        bytes in the destination after the caller reused that memory (the fault
        campaign saw a failed pull's late bytes land in the next pull's new
        tensors, allocated at the same addresses), and bytes its holder wrote
        after the lease ended. Returns the transfers that were in flight: one
        released unfinished may land later, so their scratch is not reused."""
        until = time.monotonic() + self._drain_time_s
        for handle in [f.handle for f in self._flying] + self._given_up:
            try:
                while not self._transport.poll(handle) and time.monotonic() < until:
                    time.sleep(_DRAIN_POLL_S)
            except TransferFailed:  # failed: nothing more will land
                pass
            self._transport.release(handle)
        dropped = [f.transfer for f in self._flying]
        self._flying.clear()
        self._given_up.clear()
        return dropped
