"""The READs of one pull in flight (client/flights.py), against a fake transport
and a fake lease service.

The puller's tests (test_lost_holder.py) drive these paths through whole
pulls; here each rule is pinned on its own: a READ finishes once, in posting
order; its deadline moves on while its source makes progress or its lease is
renewed, and not past the lease or the pull; a stalled READ is given up on but
released only once it ended; and the pull's end drains, then releases, every
handle it still has.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tensorhub.client.flights import Flights, drain_s
from tensorhub.client.leases import PullLeases
from tensorhub.errors import TensorHubError
from tensorhub.transport import TransferFailed


class Read:
    """A posted READ's handle: ``done`` once it landed, ``error`` when the transport fails it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.done = False
        self.error = ""


class FakeTransport:
    def __init__(self) -> None:
        self.polls: dict[str, int] = {}
        self.released: list[str] = []

    def poll(self, read: Read) -> bool:
        self.polls[read.name] = self.polls.get(read.name, 0) + 1
        if read.error:
            raise TransferFailed(read.name, read.error)
        return read.done

    def release(self, read: Read) -> None:
        self.released.append(read.name)


class Leases:
    """A lease service whose leases last ``ttl_s``; ``unrenewable`` ones cannot be renewed."""

    def __init__(self, ttl_s: float = 60.0) -> None:
        self.ttl_s = ttl_s
        self.unrenewable = False

    def acquire_lease(self, agent_id: str, replica_ids: list[str]) -> tuple[str, list[str], float]:
        return "L", list(replica_ids), self.ttl_s

    def renew_lease(self, agent_id: str, lease_id: str) -> float:
        if self.unrenewable:
            raise TensorHubError("the server cannot renew it")
        return self.ttl_s

    def release_lease_async(self, agent_id: str, lease_id: str) -> None:
        pass


def _flights(*sources: str, timeout_s: float = 60.0, pull_s: float = 60.0, drain_time_s: float = 0.0,
             service: Leases | None = None) -> tuple[Flights, FakeTransport, PullLeases]:
    transport = FakeTransport()
    leases = PullLeases(service or Leases(), "reader")
    if sources:
        leases.take(list(sources))
    flights = Flights(transport, leases, chunk_timeout_s=timeout_s, deadline=time.monotonic() + pull_s,
                      drain_time_s=drain_time_s)
    return flights, transport, leases


def _post(flights: Flights, chunk: int, source: str, name: str) -> Read:
    read = Read(name)
    transfer = SimpleNamespace(replica_id=source)
    flights.add(chunk, transfer, read, flights.deadline(source, time.monotonic()), SimpleNamespace())  # type: ignore[arg-type]
    return read


def _finished(flights: Flights) -> list[tuple[str, str]]:
    """Poll once, settle what finished: (READ, "" or how it failed) each, in posting order."""
    finished = list(flights.poll())
    flights.settle([f for f, _ in finished])
    return [(f.handle.name, "" if e is None else ("stalled" if e.stalled else "failed")) for f, e in finished]


def test_reads_finish_once_in_posting_order_and_are_released():
    flights, transport, _ = _flights("a.0", "b.0")
    first, second, third = _post(flights, 0, "a.0", "r0"), _post(flights, 1, "a.0", "r1"), _post(flights, 1, "b.0", "r2")
    assert len(flights) == 3 and flights.chunks() == {0, 1}
    assert flights.from_source("a.0") == 2 and flights.from_source("b.0") == 1 and flights.from_source("c.0") == 0
    assert _finished(flights) == []
    third.done = first.done = True
    assert _finished(flights) == [("r0", ""), ("r2", "")]
    assert transport.released == ["r0", "r2"] and len(flights) == 1 and flights.chunks() == {1}
    second.error = "NIXL_ERR_REMOTE_DISCONNECT"
    assert _finished(flights) == [("r1", "failed")]
    assert transport.released == ["r0", "r2", "r1"] and len(flights) == 0  # a failed READ has ended: released


def test_a_read_past_its_deadline_is_given_up_on_and_released_only_once_it_ends():
    flights, transport, _ = _flights("a.0", timeout_s=0.05)
    stuck = _post(flights, 0, "a.0", "stuck")
    time.sleep(0.08)
    assert _finished(flights) == [("stuck", "stalled")]
    assert transport.released == [] and len(flights) == 0, "a READ that may still land was released"
    flights.settle([])
    assert transport.released == []
    stuck.done = True  # it landed after all
    flights.settle([])
    assert transport.released == ["stuck"]
    flights.settle([])
    assert transport.released == ["stuck"]  # once


def test_a_reads_deadline_moves_on_while_its_source_makes_progress():
    flights, _, _ = _flights("a.0", timeout_s=0.4)
    first, _queued = _post(flights, 0, "a.0", "first"), _post(flights, 1, "a.0", "queued")
    time.sleep(0.2)
    first.done = True
    assert _finished(flights) == [("first", "")]
    flights.progressed("a.0")
    time.sleep(0.3)  # past the queued READ's first deadline, not past its source's progress + timeout
    assert _finished(flights) == []
    time.sleep(0.2)
    assert _finished(flights) == [("queued", "stalled")]


def test_a_reads_deadline_stops_at_its_lease_and_at_the_pulls_deadline():
    flights, _, leases = _flights("a.0", timeout_s=60.0, pull_s=0.5)
    now = time.monotonic()
    assert now + 0.4 < flights.deadline("a.0", now) <= now + 0.5  # the pull's
    assert flights.deadline("nobody.0", now) == 0.0  # no lease covers it: not readable
    flights, _, leases = _flights("a.0", timeout_s=60.0, service=Leases(ttl_s=1.0))
    lease = leases.covering("a.0")
    assert flights.deadline("a.0", time.monotonic()) == lease.expiry - lease.ttl_s / 2  # looked at again to renew it


def test_a_lease_that_cannot_be_renewed_fails_a_post_and_ends_a_polled_read_at_its_expiry():
    service = Leases(ttl_s=1.0)
    flights, _, leases = _flights("a.0", service=service)
    _post(flights, 0, "a.0", "r0")
    leases.covering("a.0").expiry = time.monotonic() + 0.1  # half its TTL gone: renewed when next asked
    service.unrenewable = True
    with pytest.raises(TensorHubError):
        flights.deadline("a.0", time.monotonic())  # posting: the caller leases again next round
    assert leases.covers("a.0")
    assert flights.deadline("a.0", time.monotonic(), posted_at=time.monotonic()) == 0.0  # polling
    assert not leases.covers("a.0"), "the lease that could not be renewed is still read under"


def test_the_newest_read_landed_at_once_or_failed_counts_as_finished():
    flights, _, _ = _flights("a.0")
    assert not flights.newest_landed()
    read = _post(flights, 0, "a.0", "r0")
    assert not flights.newest_landed()
    read.error = "NIXL_ERR_REMOTE_DISCONNECT"
    assert flights.newest_landed()  # the poll loop meets the failure
    read.error, read.done = "", True
    assert flights.newest_landed()


def test_the_pulls_end_drains_every_read_still_out_then_releases_it():
    flights, transport, _ = _flights("a.0", timeout_s=0.01, drain_time_s=0.2)
    _post(flights, 0, "a.0", "stalled")
    time.sleep(0.02)
    assert _finished(flights) == [("stalled", "stalled")]
    _post(flights, 1, "a.0", "slow")
    failing = _post(flights, 2, "a.0", "failing")
    failing.error = "gone"
    t0 = time.monotonic()
    dropped = flights.drop()
    assert 0.2 <= time.monotonic() - t0 < 1.0  # the unfinished ones got the drain time, no more
    assert sorted(t.replica_id for t in dropped) == ["a.0", "a.0"]  # the two in flight: their scratch is not reused
    assert sorted(transport.released) == ["failing", "slow", "stalled"] and len(flights) == 0
    assert flights.drop() == [] and len(transport.released) == 3  # nothing is released twice


def test_drain_time_covers_the_transports_failure_detection():
    assert drain_s(10.0, None) == 5.0 and drain_s(2.0, None) == 2.0
    assert drain_s(2.0, 5.0) == 5.5 and drain_s(2.0, float("inf")) == 2.0
