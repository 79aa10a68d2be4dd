"""``tensorhub.pacing``: when a pull asks the server again, waits for its peers,
reports and polls; checked at the boundaries and over generated times."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub.pacing import (
    ASK_WITH_NEWS_S,
    PACE_PER_RELAY_S,
    PATIENCE_S,
    POLL_MAX_S,
    POLL_MIN_S,
    REPORT_PERIOD_S,
    WAIT_FOR_CHANGE_S,
    WAIT_FOR_PEERS_S,
    asking_due,
    news_until,
    patience_out,
    peer_wait,
    poll_backoff,
    report_due,
    server_pace_s,
)

times = st.floats(0, 10, allow_nan=False)


def test_patience_runs_out_only_after_patience_s_without_a_chunk():
    assert not patience_out(100.0, 100.0)
    assert not patience_out(100.0 + PATIENCE_S, 100.0)
    assert patience_out(100.0 + PATIENCE_S + 1e-6, 100.0)


def test_the_server_is_asked_after_quiet_s_until_news_flows_then_every_ask_with_news_s():
    for since, quiet_s, news in itertools.product((0.0, 0.01, 0.1, 0.49, 0.5, 0.51, 2.0), (0.0, 0.05, 1.0), (False, True)):
        due = asking_due(50.0 + since, 50.0, news_flowing=news, quiet_s=quiet_s)
        assert due == (since >= (ASK_WITH_NEWS_S if news else quiet_s)), (since, quiet_s, news)


def test_the_servers_pace_grows_with_the_filling_relays_and_only_ever_slows_a_pull_down():
    assert server_pace_s(0) == 0.0 and server_pace_s(-3) == 0.0
    assert server_pace_s(1024) == 1024 * PACE_PER_RELAY_S  # ~20 s: a pull asks at its start and end only
    # Within the client's own pace the server's changes nothing; beyond it, it rules
    for since in (0.5, ASK_WITH_NEWS_S, ASK_WITH_NEWS_S + 1, 19.9, 20.5):
        for relays in (0, 16, 1024):
            pace = server_pace_s(relays)
            due = asking_due(50.0 + since, 50.0, news_flowing=True, quiet_s=0.0, server_pace_s=pace)
            assert due == (since >= max(ASK_WITH_NEWS_S, pace)), (since, relays)
            # no news yet: the quiet time alone (how the pull learns of its peers)
            assert asking_due(50.0 + since, 50.0, news_flowing=False, quiet_s=0.1, server_pace_s=pace)


@given(times, times, times, st.floats(0, 30, allow_nan=False))
def test_news_is_waited_for_until_the_server_is_due_patience_runs_out_or_the_deadline(asked_at, progress_at, deadline,
                                                                                     pace):
    until = news_until(asked_at, progress_at, deadline, pace)
    ends = (asked_at + max(ASK_WITH_NEWS_S, pace), progress_at + PATIENCE_S, deadline)
    assert until in ends and until <= min(ends)


@settings(max_examples=500)
@given(times, st.floats(-1, 1), st.floats(-3, 3), st.floats(-1, 2))
def test_a_reader_waiting_for_peers_pauses_between_questions_and_is_held_within_its_patience_and_deadline(
        now, asked_ago, progress_ago, deadline_in):
    asked_at, progress_at, deadline = now - asked_ago, now - progress_ago, now + deadline_in
    pause, wait_s = peer_wait(now, asked_at, progress_at, deadline)
    assert pause >= 0 and (pause > 0) == (asked_ago < WAIT_FOR_PEERS_S)
    assert abs(now + pause - max(now, asked_at + WAIT_FOR_PEERS_S)) < 1e-9  # asks WAIT_FOR_PEERS_S after the last, at the soonest
    asks = now + pause
    assert 0 <= wait_s <= WAIT_FOR_CHANGE_S
    assert asks + wait_s <= max(asks, deadline) + 1e-9  # never held past the deadline
    assert asks + wait_s <= max(asks, progress_at + PATIENCE_S) + 1e-9  # nor past its patience
    # as long as those let it: one of them ends the wait
    ends = (asks + WAIT_FOR_CHANGE_S, deadline, progress_at + PATIENCE_S)
    assert wait_s == 0 or min(abs(asks + wait_s - end) for end in ends) < 1e-9


def test_landed_chunks_are_reported_every_report_period_and_when_nothing_flies():
    assert report_due(0.0, 0.0, flying=False)
    assert not report_due(REPORT_PERIOD_S / 2, 0.0, flying=True)
    assert report_due(REPORT_PERIOD_S, 0.0, flying=True)


def test_empty_polls_back_off_twice_as_long_each_up_to_poll_max_s():
    pauses = [POLL_MIN_S]
    for _ in range(20):
        pauses.append(poll_backoff(pauses[-1]))
    assert all(b == min(2 * a, POLL_MAX_S) for a, b in itertools.pairwise(pauses))
    assert pauses[-1] == POLL_MAX_S and pauses[1] == 2 * POLL_MIN_S

