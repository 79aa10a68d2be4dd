"""What a pull makes of the server's answers when it asks again mid-pull
(client/refresh.py), against a fake server.

The pulls in test_server_restart_mid_pull.py and test_reconnect.py go through
a real server that restarts; here each rule is pinned on its own: a long poll
starts from the last change seen, a new instance opens the resettle window,
an outage opens it once per silence, and an answer ends the silence.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tensorhub.client.refresh import ServerAnswers
from tensorhub.client.rpc import RemoteReplica, Resolved
from tensorhub.errors import ServerUnavailable
from tensorhub.planner import Source
from tensorhub.topology import Labels
from tensorhub.transport.memory import MemoryKind


def _answer(instance: str, change: int, replicas: tuple = ()) -> Resolved:
    return Resolved(model="m", version=3, manifest=None, replicas=replicas, instance_id=instance,  # type: ignore[arg-type]
                    change=change)


class FakeServer:
    def __init__(self, instance: str = "s1") -> None:
        self.instance = instance
        self.change = 1
        self.down = False
        self.asked: list[tuple] = []
        self.replicas: tuple = ()

    def resolve(self, agent_id: str, model: str, version: int | None, **kw: float) -> Resolved:
        self.asked.append((agent_id, model, version, kw))
        if self.down:
            raise ServerUnavailable("no answer")
        return _answer(self.instance, self.change, self.replicas)


def _answers(server: FakeServer, resettle_s: float = 60.0) -> ServerAnswers:
    return ServerAnswers(server, "reader", _answer("s1", 1), resettle_s=resettle_s)


def test_a_long_poll_starts_from_the_last_change_seen_and_a_plain_ask_is_plain():
    server = FakeServer()
    answers = _answers(server)
    server.change = 7
    answers.ask()
    answers.ask(wait_s=0.25)
    assert server.asked == [("reader", "m", 3, {}), ("reader", "m", 3, {"wait_change_s": 0.25, "seen_change": 7})]
    assert not answers.resettling()  # the same instance: its holders are as listed


def test_a_new_instance_gives_the_holders_the_resettle_window():
    server = FakeServer(instance="s2")
    answers = _answers(server, resettle_s=0.2)
    answers.ask()
    assert answers.resettling()
    answers.ask()  # the same new instance again: the window does not move on
    time.sleep(0.25)
    assert not answers.resettling()


def test_an_answer_without_an_instance_id_never_opens_the_window():
    server = FakeServer(instance="")
    answers = _answers(server)
    answers.ask()
    assert not answers.resettling()


def test_an_outage_opens_the_window_once_per_silence():
    server = FakeServer()
    answers = _answers(server, resettle_s=0.2)
    server.down = True
    with pytest.raises(ServerUnavailable):
        answers.ask()
    assert answers.unanswered()
    time.sleep(0.25)
    assert not answers.unanswered(), "a server silent past the window still counted as restarting"
    server.down = False
    answers.ask()  # it answered: the next silence is a new one
    server.down = True
    assert answers.unanswered()


def test_the_first_instance_heard_of_is_not_a_restart():
    server = FakeServer(instance="s1")
    answers = ServerAnswers(server, "reader", _answer("", 1), resettle_s=60.0)  # the first answer named none
    answers.ask()
    assert not answers.resettling()
    server.instance = "s2"
    answers.ask()
    assert answers.resettling()


def _holder(replica_id: str, complete: bool = True, bitmap: bytes = b"") -> RemoteReplica:
    return RemoteReplica(source=Source(replica_id, replica_id, Labels(), complete=complete), agent_id=replica_id,
                         kind=MemoryKind.DRAM, held=(), regions=np.zeros((0, 3), np.int64), metadata=b"",
                         chunk_size=1, bitmap=bitmap)


def test_asking_again_backs_off_while_the_answers_repeat_and_a_change_ends_it():
    from tensorhub.client.refresh import QUIET_FIRST_S, QUIET_MAX_S

    server = FakeServer()
    answers = _answers(server)
    assert answers.quiet_s == 0.0  # nothing heard since the first answer: ask after every round
    quiet = []
    for _ in range(8):
        server.change += 1  # the pull's own chunk reports move the counter: not news to it
        answers.ask()  # the same holders every time, as complete as before
        quiet.append(answers.quiet_s)
    assert quiet == [min(QUIET_MAX_S, QUIET_FIRST_S * 2 ** k) for k in range(8)]
    assert quiet[-1] == QUIET_MAX_S
    server.replicas = (_holder("peer.1", complete=False, bitmap=b"\x01"),)  # a relay joined: ask every round again
    answers.ask()
    assert answers.quiet_s == 0.0
    answers.ask()
    assert answers.quiet_s == QUIET_FIRST_S
    server.replicas = (_holder("peer.1", complete=False, bitmap=b"\x03"),)  # it landed a chunk
    answers.ask()
    assert answers.quiet_s == 0.0
    server.replicas = (_holder("peer.1"),)  # complete now
    answers.ask()
    assert answers.quiet_s == 0.0
    answers.ask()
    server.instance = "s2"  # a restart is news too, with the same holders
    answers.ask()
    assert answers.quiet_s == 0.0
    server.down = True  # no answer says nothing about change: the quiet time stands
    with pytest.raises(ServerUnavailable):
        answers.ask()
    assert answers.quiet_s == 0.0
