"""Kill a random side of a transfer mid-flight, again and again: the other side
lives and exits 0, and every pull that completed is byte-exact (issue 51).

Over TCP, a READ is emulated by UCX and a reader killed mid-READ could abort
the process serving it; pull by push (the holder WRITEs) leaves it alive.
Real processes, real NIXL over UCX's TCP transport (tensorhub.chaos.killtransfer)."""

from __future__ import annotations

from tensorhub.chaos.killtransfer import run_rounds

# 40 rounds (the count) take ~45 s here, each two fresh processes and
# agents: within the minute this test may add to `make test`.
ROUNDS = 40


def test_a_side_killed_mid_transfer_never_takes_the_other_down():
    tally = run_rounds(ROUNDS, "push", seed=51)
    assert tally.rounds == ROUNDS
    assert tally.survivors_lost == [], tally
    assert tally.exact == tally.completed, tally  # no completed pull with a wrong byte
    # Both sides were killed, and both kinds of survivor were checked.
    assert tally.killed["holder"] >= ROUNDS // 4 and tally.killed["reader"] >= ROUNDS // 4, tally
    assert tally.failed_over + tally.completed == tally.killed["holder"], tally
