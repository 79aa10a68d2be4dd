"""What a pull makes of a holder it hears nothing from: slow or dead.

A stall is silence without an error: no READ from the holder landed within
the chunk timeout, or a push holder said nothing for ``push.SILENCE_S``. It
may be a dead holder (over TCP a dead push holder fails nothing the reader
can see), or a live one whose bytes to this reader queue behind others'
(sixteen readers of one trainer over one 100 Mbit/s link starve each other's
TCP flows for many seconds: ``tensorhub bench cluster --readers 16 --size
64MiB --link 100mbit``). The reader cannot tell; the server, which hears
every holder's heartbeats, can (``ReportLostRequest.stalled``: a holder heard
from lately stays listed, and the answer says ``kept``).

    a READ past its deadline (flights) ──▶ worth_waiting?
        another holder this round has its chunk ──▶ no: fail over, as from a dead one
        the server says its holder is alive ─────▶ yes: it stays posted, a new deadline
          (asked once a chunk timeout per holder)
        else ──▶ given up: lost(stalled) ──▶ excluded; its connection kept until the pull ends
                                                │
    no holder left for some chunks ──▶ read_again(answer): a stalled one the server lists
                                       again (it came back) is planned again

Why a module of its own: ``PullJob`` runs the rounds and decides what a failed
READ means for its chunk; this class keeps what the pull concluded about each
silent holder, so the waiting, the giving up and the reading again follow one
rule. No I/O but the one question to the server it is handed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable

from tensorhub.errors import TensorHubError

log = logging.getLogger(__name__)


class Stalls:
    """The holders one pull heard nothing from, and what the server said of them."""

    def __init__(self, ask_server: Callable[[str], bool], *, chunk_timeout_s: float) -> None:
        # replica id -> whether the server keeps it listed (its holder heartbeats): a stalled report
        self._ask_server = ask_server
        self._chunk_timeout_s = chunk_timeout_s
        self._alive_at: dict[str, float] = {}  # replica id -> when the server last said its holder is alive
        self._given_up: set[str] = set()  # given up on as stalled, not read again since

    def worth_waiting(self, replica_id: str, replaceable: bool) -> bool:
        """A READ from ``replica_id`` stalled: wait on it (True) or give it up.
        ``replaceable``: another holder this round can give its chunk."""
        if replaceable:
            return False
        now = time.monotonic()
        if now - self._alive_at.get(replica_id, -math.inf) < self._chunk_timeout_s:
            return True
        try:
            alive = bool(self._ask_server(replica_id))
        except TensorHubError:
            return False
        if alive:
            self._alive_at[replica_id] = now
        return alive

    def lost(self, replica_id: str, *, stalled: bool) -> bool:
        """The pull gave ``replica_id`` up: as stalled (it may be read again),
        or for an error or bad bytes (never again). Returns whether to close
        its connection now (not while it may be read again)."""
        if stalled:
            self._given_up.add(replica_id)
            return False
        self._given_up.discard(replica_id)
        return True

    def read_again(self, listed: Iterable[str], excluded: set[str]) -> list[str]:
        """Some chunks have no holder left: the holders given up on as stalled
        that the server lists (again) leave ``excluded``; returns them. No
        count: a reader of a busy holder may hear nothing for many silences in
        a row, so the pull's deadline bounds it (a holder alive to the server
        but cut off from this reader only is waited for until then)."""
        back = sorted(self._given_up & excluded & set(listed))
        for rid in back:
            excluded.discard(rid)
            self._given_up.discard(rid)
        return back

    def suspects(self) -> set[str]:
        """Given up on as stalled and not read again: their connections close when the pull ends."""
        return set(self._given_up)
