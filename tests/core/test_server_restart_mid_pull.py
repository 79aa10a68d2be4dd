"""A pull whose server restarts under it waits for the holders to announce
themselves again instead of failing.

Found by CI (``test_chaos.py::test_a_serving_pull_survives_a_server_restart``,
once): after the restart the reader's read lease on the trainer was unknown to
the new server instance, so the pull let the trainer go; the new instance did
not list the trainer yet (a holder announces its replicas again at its next
heartbeat, once its channel is back), and four rounds in a few milliseconds
without a holder made the pull raise ``SourceLost``. A pull now gives a
restarted (or unreachable) server ``puller._RESETTLE_S`` to learn its holders
again before running out of them counts; a holder that never comes back still
fails the pull, within that window.

The control plane is a fake (what the server does across a restart, in that
order); the bytes move for real, with memmove, and are checked."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from test_lost_holder import CHUNK, SlowMemcpy, _job, _replica

from tensorhub.client import puller
from tensorhub.client.rpc import RemoteReplica, Resolved
from tensorhub.errors import ServerUnavailable, SourceLost, TensorHubError, VersionNotFound
from tensorhub.manifest import Manifest


class RestartingServer:
    """Instance "A" lists the trainer and grants short leases. After
    ``restart_after`` resolves it goes down for ``down_s`` (every call:
    ServerUnavailable); then instance "B" knows none of A's leases and does not
    list the trainer until ``reannounce_s`` after it came up (its heartbeat).
    ``unknown_version``: meanwhile B answers NOT_FOUND (nobody announced the
    version yet) instead of a listing without the trainer (the reader's own
    replica made the version known)."""

    def __init__(self, manifest: Manifest, trainer: RemoteReplica, *, restart_after: int, down_s: float,
                 reannounce_s: float, unknown_version: bool = False) -> None:
        self.manifest, self.trainer = manifest, trainer
        self.restart_after, self.down_s, self.reannounce_s = restart_after, down_s, reannounce_s
        self.unknown_version = unknown_version
        self.resolves = 0
        self.restarted_at: float | None = None
        self.leases: dict[str, str] = {}  # lease id -> the instance that granted it
        self.leased_after_restart = False  # B granted a lease on the trainer
        self._ids = itertools.count()

    def _instance(self) -> str:
        if self.restarted_at is None:
            return "A"
        since = time.monotonic() - self.restarted_at
        if since < self.down_s:
            raise ServerUnavailable("127.0.0.1:1", "restarting")
        return "B" if since >= self.down_s + self.reannounce_s else "B, trainer not announced yet"

    def _listed(self, instance: str) -> tuple[RemoteReplica, ...]:
        return () if instance.startswith("B,") else (self.trainer,)

    def resolve(self, agent_id, model, version, *, group="", group_round=0, lease=False, **_wait):
        self.resolves += 1
        if self.restarted_at is None and self.resolves > self.restart_after:
            self.restarted_at = time.monotonic()
        instance = self._instance()
        listed = self._listed(instance)
        if not listed and self.unknown_version:
            raise VersionNotFound(model, version)
        return Resolved(model, 1, self.manifest, listed, instance_id=instance[0])

    def acquire_lease(self, agent_id, replica_ids):
        instance = self._instance()
        live = {r.source.replica_id for r in self._listed(instance)}
        lease_id = f"lease{next(self._ids)}"
        self.leases[lease_id] = instance[0]
        granted = [rid for rid in replica_ids if rid in live]
        self.leased_after_restart |= instance == "B" and bool(granted)
        return lease_id, granted, 0.2

    def renew_lease(self, agent_id, lease_id):
        if self.leases.get(lease_id) != self._instance()[0]:
            raise TensorHubError(f"read lease {lease_id} is unknown")  # granted by the instance before
        return 0.2

    def release_lease_async(self, agent_id, lease_id):
        self.leases.pop(lease_id, None)

    def report_lost(self, agent_id, replica_id, reason, stalled=False):
        raise AssertionError(f"nothing failed, yet {replica_id} was reported lost: {reason}")


def _setup(**server):
    weights = torch.arange(256 * CHUNK // 4, dtype=torch.int32)  # 256 chunks, posted in 2.6 s
    manifest = Manifest.of({"w": weights})
    plane = RestartingServer(manifest, _replica("trainer", manifest, weights), **server)
    return weights, manifest, plane


@pytest.mark.parametrize(("down_s", "unknown_version"), [(0.0, False), (0.3, False), (0.3, True)],
                         ids=["back-at-once", "down-a-while", "down-then-not-found"])
def test_a_pull_waits_for_a_restarted_server_to_learn_its_holders_again(down_s, unknown_version):
    weights, manifest, plane = _setup(restart_after=3, down_s=down_s, reannounce_s=1.0,
                                      unknown_version=unknown_version)
    dest = torch.zeros_like(weights)
    transport = SlowMemcpy()
    stats = _job(plane, transport, manifest, dest).run()
    assert plane.leased_after_restart, "the pull ended before the restart, or never read from the new instance's lease"
    assert torch.equal(dest, weights)
    assert stats.lost_sources == []


def test_a_holder_that_never_comes_back_after_a_restart_still_fails_the_pull_in_time():
    weights, manifest, plane = _setup(restart_after=3, down_s=0.3, reannounce_s=3600)
    dest = torch.zeros_like(weights)  # kept alive: the READs write into it
    t0 = time.monotonic()
    with pytest.raises(SourceLost, match="no remaining holder"):
        _job(plane, SlowMemcpy(), manifest, dest).run()
    assert time.monotonic() - t0 < puller._RESETTLE_S + 3.0
