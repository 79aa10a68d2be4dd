"""When a pull asks the server again, waits for its peers, reports and polls. Pure: no I/O; the
clock is read by the caller and passed in (``now``, and the times things last happened).

    a round posts READs ──▶ REFRESH_IDLE_S passed: post only the chunks begun, then
           │                 asking_due(now, asked_at, news flowing?, quiet_s)?
           │                   └─ yes: ask the server who holds what (the puller)
           │
    polls them, poll_backoff(pause) between empty polls; report_due(now, last report)?
           │                                           └─ yes: hand landed chunks to the reports
           ▼
    nothing to read but peers' chunks ──▶ their news flows: wait for it until news_until(...)
                                          else the server's long poll: peer_wait(now, ...)
                                                (a pause first, then how long it may hold the question)
    no chunk landed for PATIENCE_S ──▶ patience_out(now, progress_at): read from anyone

The puller (``client/puller.py``) keeps the times (when it last asked, when a
chunk last landed, its deadline), sleeps and asks; these functions say for
how long and whether.
"""

from __future__ import annotations

# A round posts READs this long, then the pull asks again who holds what (until
# peers' news flows: ASK_WITH_NEWS_S); a serving pull hands its landed chunks
# to its reports this often. How soon relaying readers see each other's chunks
# through the server: 0.2 s / 50 ms took 1.16x a lag-free raw relay,
# 0.05 s / 20 ms 1.05x (``tensorhub bench cluster --readers 3``, docs/history/cluster.md).
REPORT_PERIOD_S = 0.02
REFRESH_IDLE_S = 0.05
PATIENCE_S = 1.0  # waiting for peers' chunks this long without progress: read from anyone
# A reader with nothing to read but peers' chunks still to come asks the server
# to answer once the version's holders change (a long poll), at most this long,
# and at most once per WAIT_FOR_PEERS_S: 16 relaying readers report chunks
# hundreds of times a second, and a waiter woken by each would only replan.
WAIT_FOR_CHANGE_S = 0.25
WAIT_FOR_PEERS_S = 0.01
# Once its peers' chunk news flows (``peernews``), a pull asks the server who
# holds the version this often, at most: the news says which chunks the
# holders it reads from landed (it subscribed to each), the server who joined
# or left. 2 s with subscriptions cut 16 relays' messages 60 -> 25 a reader
# and version, but slowed 8 relays' later versions (9.4 -> 11.7 s), found
# later to be named pulls reading a share from the trainer (fixed: the
# schedule's ``Wave.wave_readers``); 2 s not measured again since: kept at
# 0.5 s. A named (steady) pull takes the server's pace where longer.
# It waits for news in NEWS_POLL_S steps (a notification is in NIXL's queue when it arrives).
ASK_WITH_NEWS_S = 0.5
NEWS_POLL_S = 0.001
# The server's pace for a version's pulls whose news flows (``ResolveResponse.pace_s``),
# by the relays pulling it or about to (``State.relays_pulling``): each asks and
# reports once per pace, at about a millisecond of
# the server's one core each; keeping them to a tenth of that core takes
# 2 x 1 ms x relays / pace <= 0.1, a pace of 0.02 s per filling relay. At 16
# relays 0.32 s (the client's own ASK_WITH_NEWS_S rules), at 1,024 about 20 s:
# a pull of a few seconds then asks and reports at its start and its end only,
# and its readers learn its chunks from its news (subscriptions, ``peernews``).
PACE_PER_RELAY_S = 0.02
# A round polls its READs this often: at once again after one landed, twice
# as long after each poll that found none, up to POLL_MAX_S.
POLL_MIN_S = 20e-6
POLL_MAX_S = 2e-3


def server_pace_s(relays: int) -> float:
    """The pace the server gives a version's pulls (``ResolveResponse.pace_s``):
    ``PACE_PER_RELAY_S`` per relay pulling it or about to."""
    return PACE_PER_RELAY_S * max(0, relays)


def patience_out(now: float, progress_at: float) -> bool:
    """Whether a reader that last landed a chunk at ``progress_at`` stops
    waiting for its peers' chunks and reads from anyone (after ``PATIENCE_S``)."""
    return now - progress_at > PATIENCE_S


def asking_due(now: float, asked_at: float, *, news_flowing: bool, quiet_s: float, server_pace_s: float = 0.0) -> bool:
    """Whether to ask the server who holds what now: while no news came (it
    is how the pull learns of its peers), after ``quiet_s`` (every round until
    its answers stop changing, then less and less often:
    ``ServerAnswers.quiet_s``); once news comes, every ``ASK_WITH_NEWS_S``
    or the server's pace, whichever is longer (joiners, leavers)."""
    return now - asked_at >= (news_pace(server_pace_s) if news_flowing else quiet_s)


def news_pace(server_pace_s: float) -> float:
    """How often a pull whose news flows asks the server: ``ASK_WITH_NEWS_S``,
    or the server's pace for the version where that is longer."""
    return max(ASK_WITH_NEWS_S, server_pace_s)


def news_until(asked_at: float, progress_at: float, deadline: float, server_pace_s: float = 0.0) -> float:
    """Until when a reader with nothing to read but its peers' chunks waits for
    their news: until the server is due to be asked (``news_pace`` after it
    last was), its patience runs out, or the pull's deadline."""
    return min(asked_at + news_pace(server_pace_s), progress_at + PATIENCE_S, deadline)


def peer_wait(now: float, asked_at: float, progress_at: float, deadline: float) -> tuple[float, float]:
    """``(pause, wait_s)`` for a reader waiting for its peers' chunks through
    the server's long poll: it pauses first while it asked within
    ``WAIT_FOR_PEERS_S``, then lets the server hold its question ``wait_s``:
    until its patience runs out (it then reads from anyone),
    ``WAIT_FOR_CHANGE_S`` at most, never past the deadline; 0 once past
    ``PATIENCE_S``."""
    pause = max(0.0, asked_at + WAIT_FOR_PEERS_S - now)
    now += pause
    return pause, max(0.0, min(PATIENCE_S - (now - progress_at), WAIT_FOR_CHANGE_S, deadline - now))


def report_due(now: float, last_report: float, *, flying: bool) -> bool:
    """Whether a serving pull hands the chunks landed since ``last_report`` to
    its reports now: every ``REPORT_PERIOD_S``, and when no READ flies."""
    return not flying or now - last_report >= REPORT_PERIOD_S


def poll_backoff(pause: float) -> float:
    """The pause after an empty poll that followed a ``pause``: twice as long, ``POLL_MAX_S`` at most."""
    return min(pause * 2, POLL_MAX_S)
