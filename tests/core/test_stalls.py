"""What a pull makes of a holder it hears nothing from (client/stalls.py), rule by rule."""

from __future__ import annotations

import time

from tensorhub.client.stalls import Stalls
from tensorhub.errors import TensorHubError


class Server:
    """Answers a stalled report: ``alive`` (kept listed), or raises."""

    def __init__(self, alive: bool = True, fails: bool = False) -> None:
        self.alive, self.fails, self.asked = alive, fails, []

    def __call__(self, replica_id: str) -> bool:
        self.asked.append(replica_id)
        if self.fails:
            raise TensorHubError("server out of reach")
        return self.alive


def test_a_replaceable_read_is_given_up_without_asking():
    server = Server()
    assert not Stalls(server, chunk_timeout_s=10).worth_waiting("a.1", replaceable=True)
    assert server.asked == []


def test_the_servers_word_is_asked_once_a_chunk_timeout_per_holder():
    server = Server()
    stalls = Stalls(server, chunk_timeout_s=0.05)
    assert stalls.worth_waiting("a.1", replaceable=False) and stalls.worth_waiting("a.1", replaceable=False)
    assert stalls.worth_waiting("b.1", replaceable=False)
    assert server.asked == ["a.1", "b.1"]
    time.sleep(0.06)
    server.alive = False  # it stopped heartbeating since
    assert not stalls.worth_waiting("a.1", replaceable=False) and server.asked == ["a.1", "b.1", "a.1"]


def test_a_silent_holder_or_an_unanswered_question_gives_the_read_up():
    assert not Stalls(Server(alive=False), chunk_timeout_s=10).worth_waiting("a.1", replaceable=False)
    assert not Stalls(Server(fails=True), chunk_timeout_s=10).worth_waiting("a.1", replaceable=False)


def test_only_holders_given_up_as_stalled_are_read_again_and_only_once_listed():
    stalls = Stalls(Server(), chunk_timeout_s=10)
    assert not stalls.lost("slow.1", stalled=True)  # its connection stays: it may be read again
    assert stalls.lost("dead.1", stalled=False)  # failed outright: closed now
    assert not stalls.lost("flaky.1", stalled=True) and stalls.lost("flaky.1", stalled=False)  # then failed
    excluded = {"slow.1", "dead.1", "flaky.1", "corrupt.1"}
    assert stalls.suspects() == {"slow.1"}
    assert stalls.read_again(["dead.1", "flaky.1"], excluded) == []  # not listed: still out
    assert stalls.read_again(["slow.1", "dead.1", "flaky.1", "corrupt.1"], excluded) == ["slow.1"]
    assert excluded == {"dead.1", "flaky.1", "corrupt.1"} and stalls.suspects() == set()
    assert stalls.read_again(["slow.1"], excluded) == []  # once: it is in use again
