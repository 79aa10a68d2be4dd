"""The steady state (``client/replay.py``): a reader that pulled version v
into its buffers pulls v+1 from the same holders' same buffers without
holder tables sent or decoded, by plans it made for v, reading only replicas
of v+1, byte-exact; and every change in the layout falls back to planning,
byte-exact too. Real NIXL between real processes, a real gRPC server (in a
subprocess where it restarts)."""

from __future__ import annotations

import time
from dataclasses import asdict

import pytest

from tensorhub.client.replay import PLANNED, REPLAYED, path_of
from tensorhub.client.rpc import ReferenceClient
from tensorhub.testing import HubProcess, ServerProcess

SPECS = [("a", "bfloat16", (1024, 256)), ("b", "bfloat16", (1024, 256))]
CHUNK = 128 << 10
TP = ("tp", 0, 2)  # rows of one tensor, columns of the other


def _control(address: str) -> dict:
    client = ReferenceClient(address)
    try:
        return asdict(client.describe().control)
    finally:
        client.close()


def _step(ranks: list[HubProcess], old: int, new: int, seed: int, world: int | None = None) -> None:
    """The trainer's step: every rank withdraws ``old``, writes the new bytes in
    place and publishes them as ``new`` from the same buffers."""
    for hub in ranks:
        hub.call("unpublish", model="m", version=old)
        hub.call("overwrite", model="m", version=old, seed=seed)
    for rank, hub in enumerate(ranks):
        hub.call("republish", model="m", version=new, of=old, how="rows", rank=rank, world=world or len(ranks),
                 chunk_size=CHUNK)


def _publish(ranks: list[HubProcess], version: int, seed: int) -> None:
    for rank, hub in enumerate(ranks):
        hub.call("publish_shard", model="m", version=version, specs=SPECS, seed=seed, how="rows", rank=rank,
                 world=len(ranks), chunk_size=CHUNK)


def _pull(reader: HubProcess, version: int, seed: int, **kw) -> dict:
    got = reader.call("pull", model="m", version=version, specs=SPECS, expect_seed=seed, read=TP, keep="dest", **kw)
    assert got["mismatched"] == [], got["mismatched"]
    return got


def test_a_groups_next_version_is_replayed_with_lean_answers_one_ranking_per_group(server, hubs):
    ranks = [hubs("rank0"), hubs("rank1")]
    workers = [hubs("w0"), hubs("w1")]
    _publish(ranks, 1, seed=1)
    for w in workers:
        first = _pull(w, 1, 1, group="engine0", group_round=1)
        assert first["path"] == PLANNED
    before = _control(server.address)
    _step(ranks, 1, 2, seed=2)
    for w in workers:
        step = _pull(w, 2, 2, group="engine0", group_round=2)
        assert step["path"] == REPLAYED, step["not_replayed"]
        assert set(step["sources"]) == {"rank0", "rank1"}
    after = _control(server.address)
    assert after["holders_full"] == before["holders_full"]  # no regions, memory or NIXL metadata sent again
    assert after["holders_lean"] > before["holders_lean"]
    assert after["publishes_lean"] - before["publishes_lean"] == 2
    assert after["publishes_full"] == before["publishes_full"]
    # The next resolve carries the readers' reports: both replayed.
    _step(ranks, 2, 3, seed=3)
    for w in workers:
        _pull(w, 3, 3, group="engine0", group_round=3)
    assert _control(server.address)["pulls_replayed"] >= 2


def test_a_new_trainer_world_size_is_planned_and_exact(hubs):
    ranks = [hubs("rank0"), hubs("rank1")]
    reader = hubs("reader")
    _publish(ranks, 1, seed=1)
    _pull(reader, 1, 1)
    third = hubs("rank2")
    for hub in ranks:
        hub.call("unpublish", model="m", version=1)
    _publish([*ranks, third], 2, seed=2)  # resharded: every rank holds other rows
    got = _pull(reader, 2, 2)
    assert got["path"] == PLANNED and "had not seen" in got["not_replayed"]
    _step([*ranks, third], 2, 3, seed=3)  # and the step after is steady again
    assert _pull(reader, 3, 3)["path"] == REPLAYED


def test_a_holder_that_died_before_the_replay_is_planned_around_and_exact(hubs):
    ranks = [hubs("rank0"), hubs("rank1")]
    spare = hubs("spare")  # a whole copy: the version stays covered without it
    reader = hubs("reader")
    _publish(ranks, 1, seed=1)
    spare.call("publish", model="m", version=1, specs=SPECS, seed=1, chunk_size=CHUNK)
    _pull(reader, 1, 1)
    _step(ranks, 1, 2, seed=2)
    spare.call("unpublish", model="m", version=1)
    spare.call("overwrite", model="m", version=1, seed=2)
    spare.call("republish", model="m", version=2, of=1, chunk_size=CHUNK)
    spare.kill()  # its replica of version 2 is still listed until its agent expires
    got = _pull(reader, 2, 2, timeout=60)
    assert "spare" not in got["sources"]
    # The whole copy ranks first for every chunk (whole chunks before parts): tried, lost, planned around.
    assert got["path"] == PLANNED and "lost mid-pull: spare" in got["not_replayed"]


def test_a_replay_never_reads_a_holder_that_has_not_published_the_new_version(hubs):
    """rank1 still holds version 1 (its layout known to the reader) while a
    whole copy of version 2 covers it: the reader reads version 2 only."""
    ranks = [hubs("rank0"), hubs("rank1")]
    whole = hubs("whole")
    reader = hubs("reader")
    _publish(ranks, 1, seed=1)
    _pull(reader, 1, 1)
    ranks[0].call("unpublish", model="m", version=1)
    ranks[0].call("overwrite", model="m", version=1, seed=2)
    ranks[0].call("republish", model="m", version=2, of=1, how="rows", rank=0, world=2, chunk_size=CHUNK)
    whole.call("publish", model="m", version=2, specs=SPECS, seed=2, chunk_size=CHUNK)
    got = _pull(reader, 2, 2)  # rank1's memory holds version 1's bytes: reading it would mismatch
    assert "rank1" not in got["sources"]


def test_a_server_restart_between_versions_keeps_the_replay_exact():
    with ServerProcess(agent_ttl_s=5.0, lease_ttl_s=5.0, retain=0) as server:
        procs = [HubProcess(server.address, name=n) for n in ("rank0", "rank1", "reader")]
        try:
            ranks, reader = procs[:2], procs[2]
            _publish(ranks, 1, seed=1)
            _pull(reader, 1, 1)
            for hub in ranks:
                hub.call("unpublish", model="m", version=1)
                hub.call("overwrite", model="m", version=1, seed=2)
            server.kill()
            server.start()
            deadline = time.monotonic() + 30
            while True:  # the holders re-register with the new instance (heartbeats)
                try:
                    for rank, hub in enumerate(ranks):
                        hub.call("republish", model="m", version=2, of=1, how="rows", rank=rank, world=2,
                                 chunk_size=CHUNK)
                    break
                except Exception:  # noqa: BLE001  refused until the agent is known again
                    assert time.monotonic() < deadline, "the holders never got back to the restarted server"
                    time.sleep(0.5)
            got = _pull(reader, 2, 2, timeout=60)
            # Same holders, same memory: the layouts are the same on the new instance (digests of contents),
            # so the reader's holders come lean and the replay is exact.
            assert got["path"] == REPLAYED, got["not_replayed"]
            assert set(got["sources"]) == {"rank0", "rank1"}
            assert _control(server.address)["publishes_full"] == 2  # the new instance learnt each layout once
        finally:
            for proc in reversed(procs):
                proc.close(timeout=15)


@pytest.mark.parametrize("earlier, read, lost, made, want", [
    (0, [("a", True)], [], 0, "first pull"),
    (1, [("a", True)], ["a"], 0, "lost"),
    (1, [("a", True), ("b", False)], [], 0, "had not seen"),
    (1, [("a", True)], [], 3, "3 chunk plan"),
    (1, [("a", True), ("b", True)], [], 0, ""),
])
def test_path_of_names_the_first_reason(earlier, read, lost, made, want):
    got = path_of(earlier_pulls=earlier, holders_read=read, lost=lost, plans_made=made)
    assert got.replayed == (want == "")
    assert want in got.why
