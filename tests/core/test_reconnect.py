"""A client reaches a restarted server soon after it is back, however long it
was down: its holders announce themselves again and pulls find them within
the puller's window for a restart (``puller._RESETTLE_S``).

Found by measuring it: with gRPC's default reconnect backoff (1 s, x1.6 per
failed attempt, up to 120 s) a client that kept calling a server down for
8 s got through only 5.9-7.2 s after the server was back; with the channel's
backoff capped at 1 s (``client/rpc.py``), 0.06-0.68 s."""

from __future__ import annotations

import contextlib
import time

from tensorhub.client.rpc import ReferenceClient
from tensorhub.errors import TensorHubError
from tensorhub.testing import ServerProcess
from tensorhub.topology import Labels, Reliability

DOWN_S = 8.0


def _register(client: ReferenceClient) -> None:
    client.register_agent("a", "a", Labels("a"), Reliability.RELIABLE)


def test_a_client_gets_through_to_a_restarted_server_within_seconds():
    with ServerProcess() as server:
        client = ReferenceClient(server.address, timeout_s=2.0)
        _register(client)
        server.kill()
        killed = time.monotonic()
        while time.monotonic() - killed < DOWN_S:  # calls go on while it is down, as heartbeats do
            with contextlib.suppress(TensorHubError):  # refused while it is down: expected
                _register(client)
            time.sleep(0.25)
        server.start()
        back = time.monotonic()
        while True:
            try:
                _register(client)
                break
            except TensorHubError:
                assert time.monotonic() - back < 3.0, "the client stayed away from the restarted server"
                time.sleep(0.05)
