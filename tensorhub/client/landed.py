"""What a serving pull tells the server about the chunks it landed.

A reader that serves what it pulls (``Hub.pull(serve=True)``) is a holder
while it fills: its peers read the chunks it has, so the server must hear of
them soon. One thread per pull sends, in order:

    announce (Publish FILLING) ─▶ report ─▶ report ─▶ … ─▶ last report, complete
                                    ▲
    PullJob.landed(chunks) ─────────┘  chunks that landed while the report
                                       before was on the wire ride together

At most one report is on the wire at a time, and everything that landed
meanwhile goes in the next one: a pull never waits on its reports, and the
reports' rate follows the server's answers. A busy server (a thousand relays
reporting at once) answers slower, so each relay sends fewer, larger reports
instead of a queue of small ones; an idle one still hears within one round
trip of the puller's report period. The last report carries ``complete``, so
a relay's version costs its announce and its reports, no message more.

Each landing is first marked here (checksums, bitmap) and told to the pull's
filling peers (``PullNews.tell``, ``peernews``) at once. While that news
reaches peers, the server's record can lag: reports then go every
``REPORT_WITH_NEWS_S`` at most, carrying everything that landed since (at 16
relays a report per landing was a quarter of the server's messages).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

# How often a relay whose news reaches its peers (``peernews``) reports to the
# server: its readers know sooner from the news (each subscribed to it), the
# server's record serves joiners, which subscribe once they read from it.
# 0.5 s (pacing.ASK_WITH_NEWS_S says why not 2 s); a named pull's reports
# follow the server's pace where longer (``server_pace``).
REPORT_WITH_NEWS_S = 0.5


class Reporter(Protocol):
    """Where the reports go (``Holdings``)."""

    def announce(self, pub: object) -> None: ...

    def landed_here(self, pub: object, chunks: list[int], tell: Callable[[list[int], Any], bool] | None = None
                    ) -> bool: ...

    def report_landed(self, pub: object, chunks: list[int], complete: bool = False) -> None: ...

    def hold_complete(self, pub: object, chunks: list[int]) -> bytes: ...


class LandedReports:
    """Reports of one serving pull, on a thread of their own (see the module
    docstring). ``submit`` never blocks on the server; ``finish`` sends what
    is left as the complete report and raises what a report raised;
    ``abandon`` lets the report on the wire end and drops the rest."""

    def __init__(self, reporter: Reporter, publication: object, *, announced: bool = False,
                 paced_from_start: bool = False) -> None:
        """``announced``: the server has the announce already (the pull's
        group sent it with the others'): only reports follow.
        ``paced_from_start``: even the first report waits a pace (a steady
        pull's: its readers subscribe to its news; ``Hub`` sets it for named
        answers), where otherwise it goes at once until news reaches a peer."""
        self._paced_from_start = paced_from_start
        self._reporter, self._publication = reporter, publication
        self._announced = announced
        # The pull's chunk news to its peers (``PullNews.tell``), set before it runs
        self.tell: Callable[[list[int], Any], bool] | None = None
        # While news reaches peers, the server hears at most this often (its
        # record, for joiners and pulls no peer tells); 0: at once, as before.
        self.pace_s = REPORT_WITH_NEWS_S
        # The server's pace for the version (``PullJob.server_pace_s``), where longer, set before the pull runs
        self.server_pace: Callable[[], float] | None = None
        self._wake = threading.Condition()
        self._pending: list[int] = []
        self._finishing = self._dropped = self._hold_last = False
        self.held = b""  # the last report, held for the group (``finish(hold_last=True)``)
        self._error: BaseException | None = None
        self.reports = 0  # sent after the announce, the complete one included
        self._thread = threading.Thread(target=self._send, name="tensorhub-landed", daemon=True)
        self._thread.start()

    def _pace(self) -> float:
        return max(self.pace_s, self.server_pace()) if self.server_pace is not None else self.pace_s

    def submit(self, chunks: list[int]) -> None:
        with self._wake:
            self._pending.extend(chunks)
            self._wake.notify()

    def finish(self, *, hold_last: bool = False) -> bytes:
        """Send what landed since the last report, with ``complete``; wait for it.
        ``hold_last``: that last report is not sent but returned, encoded, for
        the pull's group to send with its other members' (``Hub.send_group_reports``)."""
        with self._wake:
            self._finishing = True
            self._hold_last = hold_last
            self._wake.notify()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.held

    def abandon(self) -> None:
        """The pull failed: the report on the wire ends (before the replica is withdrawn), the rest is dropped."""
        with self._wake:
            self._dropped = True
            self._wake.notify()
        self._thread.join()

    def _send(self) -> None:
        try:
            if not self._announced:
                self._reporter.announce(self._publication)
            unreported: list[int] = []
            report_at = 0.0  # the next report waits until then (paced while news reaches peers)
            # A steady pull's first report waits a pace from its first landing (the
            # server's pace is known by then: ``server_pace`` is set after this thread starts)
            first_paced = self._paced_from_start
            while True:
                with self._wake:
                    while not (self._pending or self._finishing or self._dropped
                               or (unreported and time.monotonic() >= report_at)):
                        self._wake.wait(max(0.0, report_at - time.monotonic()) if unreported else None)
                    if self._dropped:
                        return
                    chunks, self._pending = self._pending, []
                    last, hold = self._finishing, self._hold_last
                told = bool(chunks) and self._reporter.landed_here(self._publication, chunks, tell=self.tell)
                unreported.extend(chunks)
                if first_paced and chunks:
                    first_paced = False
                    report_at = time.monotonic() + self._pace()
                if last and hold:
                    self.held = self._reporter.hold_complete(self._publication, unreported)
                    return
                if last or (unreported and time.monotonic() >= report_at):
                    self._reporter.report_landed(self._publication, unreported, complete=last)
                    unreported = []
                    self.reports += 1
                    report_at = time.monotonic() + (self._pace() if told else 0.0)
                if last:
                    return
        except BaseException as e:  # noqa: BLE001  handed to finish(), which raises it in the pull's thread
            self._error = e
