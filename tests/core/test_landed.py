"""A serving pull's chunk reports (``client/landed.py``): one on the wire at a
time, what landed meanwhile in the next one, the last one complete. The
reporter here stands in for the server's side (``Holdings``): it records what
it was sent and can be slow or fail; the real path runs in every relay test."""

from __future__ import annotations

import threading
import time

import pytest

from tensorhub.client.landed import LandedReports


class Recorder:
    def __init__(self, *, fail_on: int | None = None) -> None:
        self.calls: list[tuple[str, list[int], bool]] = []
        self.marked: list[list[int]] = []  # chunks marked landed (and told to peers), as they came
        self.gate = threading.Event()  # a report waits for it: the server is slow
        self.gate.set()
        self.fail_on = fail_on

    def announce(self, pub: object) -> None:
        self.calls.append(("announce", [], False))

    def landed_here(self, pub: object, chunks: list[int], tell=None) -> bool:
        self.marked.append(list(chunks))
        return bool(tell is not None and tell(chunks, None))

    def report_landed(self, pub: object, chunks: list[int], complete: bool = False) -> None:
        self.calls.append(("report", list(chunks), complete))
        if self.fail_on is not None and len(self.calls) - 1 == self.fail_on:
            raise RuntimeError("server refused the report")
        assert self.gate.wait(10)


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_chunks_that_land_while_a_report_is_on_the_wire_ride_in_the_next_and_the_last_says_complete():
    server = Recorder()
    server.gate.clear()  # the first report waits on the server
    reports = LandedReports(server, publication=object())
    reports.submit([0])
    _wait_for(lambda: len(server.calls) == 2)
    for chunk in range(1, 11):  # ten landings while the first report is on the wire
        reports.submit([chunk])
    server.gate.set()
    reports.finish()
    assert server.calls[0] == ("announce", [], False)
    sent = server.calls[1:]
    assert sent[0] == ("report", [0], False)
    assert len(sent) <= 3  # the ten rode together (and the last may carry none)
    assert [c for _, chunks, _ in sent for c in chunks] == list(range(11))  # each once, in order
    assert sent[-1][2] is True and not any(complete for _, _, complete in sent[:-1])
    assert reports.reports == len(sent)


def test_a_pull_with_nothing_left_to_report_still_ends_complete():
    server = Recorder()
    reports = LandedReports(server, publication=object())
    reports.finish()
    assert server.calls == [("announce", [], False), ("report", [], True)]


def test_a_failed_report_is_raised_by_finish_and_nothing_more_is_sent():
    server = Recorder(fail_on=1)
    reports = LandedReports(server, publication=object())
    reports.submit([0])
    _wait_for(lambda: len(server.calls) == 2)
    reports.submit([1])
    with pytest.raises(RuntimeError, match="refused"):
        reports.finish()
    assert server.calls == [("announce", [], False), ("report", [0], False)]


def test_an_abandoned_pull_drops_what_was_not_sent():
    server = Recorder()
    server.gate.clear()
    reports = LandedReports(server, publication=object())
    reports.submit([0])
    _wait_for(lambda: len(server.calls) == 2)
    reports.submit([1, 2])
    releaser = threading.Timer(0.05, server.gate.set)  # the report on the wire ends, then abandon returns
    releaser.start()
    reports.abandon()
    releaser.join()
    assert server.calls == [("announce", [], False), ("report", [0], False)]


def test_while_news_reaches_peers_the_server_hears_at_its_pace_and_the_peers_at_once():
    server = Recorder()
    told: list[list[int]] = []
    reports = LandedReports(server, publication=object())
    reports.tell = lambda chunks, crcs: told.append(list(chunks)) or True
    reports.pace_s = 1.0
    start = time.monotonic()
    for chunk in range(10):
        reports.submit([chunk])
        _wait_for(lambda n=chunk + 1: sum(map(len, told)) == n)  # told before the next lands
        time.sleep(0.005)
    assert time.monotonic() - start < 1.0
    assert server.calls == [("announce", [], False), ("report", [0], False)]  # the first at once, then paced
    _wait_for(lambda: len(server.calls) == 3)
    assert server.calls[2] == ("report", list(range(1, 10)), False)  # the rest together, one pace later
    reports.finish()
    assert server.calls[-1] == ("report", [], True)
    assert [c for chunks in told for c in chunks] == list(range(10))


def test_the_servers_pace_slows_the_reports_where_it_is_longer_than_the_pulls_own():
    server = Recorder()
    reports = LandedReports(server, publication=object())
    reports.tell = lambda chunks, crcs: True
    reports.pace_s = 0.05
    pace = [30.0]  # the server's, from the pull's latest answer (PullJob.server_pace_s)
    reports.server_pace = lambda: pace[0]
    reports.submit([0])
    _wait_for(lambda: len(server.calls) == 2)
    reports.submit([1])
    time.sleep(0.3)  # six of the pull's own paces: the server's 30 s holds the report back
    assert server.calls == [("announce", [], False), ("report", [0], False)]
    reports.finish()  # the last report goes at once, whatever the pace
    assert server.calls[-1] == ("report", [1], True)


def test_a_steady_pulls_first_report_waits_its_pace_too():
    server = Recorder()
    reports = LandedReports(server, publication=object(), paced_from_start=True)
    reports.server_pace = lambda: 30.0  # wired after the reports' thread started, as Hub does
    reports.submit([0, 1])
    time.sleep(0.8)  # past the client's own 0.5 s: the server's 30 s holds it (and without the pace from the start it went at once)
    assert server.calls == [("announce", [], False)]
    reports.finish()
    assert server.calls[-1] == ("report", [0, 1], True)
