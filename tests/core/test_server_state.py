"""The reference server's state on its own (no gRPC): visibility of sharded
versions, retention per shard, the WaitForVersion long poll."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tensorhub.manifest import Manifest, TensorSpec
from tensorhub.regions import Region
from tensorhub.server.config import ServerConfig
from tensorhub.server.state import State, StateError, check_held
from tensorhub.topology import Labels, Reliability

# layers.0.w: 1000 rows of 8 float32; b: 10 float32.
MANIFEST = Manifest((TensorSpec("layers.0.w", "float32", (1000, 8), 1000 * 8 * 4),
                     TensorSpec("b", "float32", (10,), 40)))
W, B = 0, 1
CHUNK = 4096


def rows(a, b):
    return (W, Region.of((1000, 8), rows=(a, b)))


def state(retain=1):
    s = State(ServerConfig(retain=retain))
    for i in range(8):
        s.register_agent(f"a{i}", f"rank{i}", Labels(), Reliability.RELIABLE)
    s.register_agent("spot", "spot", Labels(), Reliability.SPOT)
    return s


def publish(s, agent, held, *, version=1, complete=True, retained=False, replica=None):
    return s.publish(agent_id=agent, replica_id=replica or f"{agent}.{version}{'r' if retained else ''}", model="m",
                     version=version, manifest=MANIFEST, held=check_held(MANIFEST, held), chunk_size=CHUNK,
                     memory=None, complete=complete, bitmap=b"", origin=True, retained=retained)


def four_shards(s, version=1, upto=4):
    """Rank i holds rows [250 i, 250 (i+1)); rank 0 also holds b."""
    for i in range(upto):
        publish(s, f"a{i}", [rows(250 * i, 250 * (i + 1))] + ([(B, Region())] if i == 0 else []), version=version)


def not_found(s, version):
    with pytest.raises(StateError) as err:
        s.resolve("m", version)
    assert err.value.code == "NOT_FOUND"
    return str(err.value)


def test_row_shards_become_visible_only_when_all_are_in():
    s = state()
    four_shards(s, upto=3)
    assert s.visible_versions("m") == [] and s.latest_visible("m") is None
    msg = not_found(s, 1)
    assert "'m' version 1 is not complete: no complete holder has layers.0.w rows 750:1000" in msg, msg
    assert "pullable versions: none" in msg
    not_found(s, None)  # latest: nothing visible yet
    four_shards(s, upto=4)  # re-publishing ranks 0-2 is idempotent
    assert s.visible_versions("m") == [1]
    assert s.resolve("m", None)[0] == 1


def test_missing_list_is_capped_and_names_both_tensors():
    s = state()
    publish(s, "a0", [rows(0, 100)])
    publish(s, "a1", [rows(200, 300)])
    msg = not_found(s, 1)
    assert "layers.0.w rows 100:200, layers.0.w rows 300:1000, b elements 0:10" in msg, msg
    s2 = state()
    publish(s2, "a0", [(W, Region.of((1000, 8), cols=(0, 4))), (B, Region())])
    msg = not_found(s2, 1)  # a column slice leaves one box out, not 1000 element ranges
    assert "layers.0.w [0:1000, 4:8]; " in msg and "more" not in msg, msg
    s3 = state()
    publish(s3, "a0", [(W, Region.of((1000, 8), rows=(k, k + 1))) for k in range(0, 1000, 2)] + [(B, Region())])
    msg = not_found(s3, 1)  # every other row: 500 holes, 8 named
    assert "layers.0.w rows 1:2, layers.0.w rows 3:4" in msg and "(and 492 more)" in msg, msg


def test_overlapping_regions_cover():
    s = state()
    publish(s, "a0", [rows(0, 600), (B, Region.of((10,), flat=(0, 6)))])
    publish(s, "a1", [rows(400, 1000), (B, Region.of((10,), flat=(3, 10)))])
    assert s.visible_versions("m") == [1]


def test_flat_ranges_and_column_boxes_cover():
    s = state()
    publish(s, "a0", [(W, Region.of((1000, 8), flat=(0, 4000))), (B, Region.of((10,), flat=(0, 5)))])
    publish(s, "a1", [(W, Region.of((1000, 8), box=((500, 1000), (0, 3))))])
    assert not s.visible_versions("m")
    publish(s, "a2", [(W, Region.of((1000, 8), box=((500, 1000), (3, 8)))), (B, Region.of((10,), flat=(5, 10)))])
    assert s.visible_versions("m") == [1]


def test_filling_replicas_count_only_once_complete():
    s = state()
    four_shards(s, upto=3)
    r = publish(s, "a3", [rows(750, 1000)], complete=False)
    assert r.num_chunks == -(-250 * 8 * 4 // CHUNK)
    assert not s.visible_versions("m")
    s.report_chunks("a3", r.replica_id, list(range(r.num_chunks)), complete=False)
    assert not s.visible_versions("m")
    s.report_chunks("a3", r.replica_id, [], complete=True)
    assert s.visible_versions("m") == [1]


def test_a_replica_reported_lost_stays_hidden_under_its_leases_until_they_end():
    """A live holder reported lost by one reader: no reader is sent to it, but
    its unpublish still waits for the leases out on it (a READ given up on can
    still be served); once they end it is gone. A dead holder's goes at once."""
    s = state(retain=0)
    four_shards(s)
    reader = s.acquire_lease("spot", ["a1.1"])
    other = s.acquire_lease("a0", ["a1.1"])
    s.report_lost("a1.1")
    replica = s.replicas["a1.1"]
    assert replica.lost and "rows 250:500" in not_found(s, 1)
    assert not replica.drained.is_set() and replica.leases == {reader.lease_id, other.lease_id}
    assert s.acquire_lease("a2", ["a1.1"]).replica_ids == []  # hidden: no new lease
    s.withdraw("a1", "a1.1")  # its holder's unpublish waits for the two readers
    assert not replica.drained.is_set()
    s.release_lease(reader.lease_id)
    assert "a1.1" in s.replicas and not replica.drained.is_set()
    s.release_lease(other.lease_id)
    assert replica.drained.is_set() and "a1.1" not in s.replicas
    # Its agent gone (expired): dropped at once, leases or not.
    s.acquire_lease("spot", ["a2.1"])
    del s.agents["a2"]
    s.report_lost("a2.1")
    assert "a2.1" not in s.replicas


def test_chunk_reports_fill_in_checksums_only_where_a_table_was_announced():
    s = state()
    r = publish(s, "a3", [rows(750, 1000)], complete=False)
    with pytest.raises(StateError, match="announced no checksums") as err:
        s.report_chunks("a3", r.replica_id, [0], complete=False, chunk_crc32=[7])
    assert err.value.code == "FAILED_PRECONDITION" and r.chunk_crc32 is None
    r.chunk_crc32 = [0] * r.num_chunks  # what the service stores from the publish
    r.wire_info = "cached"
    with pytest.raises(StateError, match="outside"):  # nothing changes: not the checksum, not the bitmap
        s.report_chunks("a3", r.replica_id, [1, r.num_chunks], complete=False, chunk_crc32=[5, 6])
    assert r.chunk_crc32[1] == 0 and r.wire_info == "cached" and not any(r.bitmap)
    s.report_chunks("a3", r.replica_id, [1, 0], complete=False, chunk_crc32=[5, 6])
    assert r.chunk_crc32[:2] == [6, 5] and r.wire_info is None  # the cached wire form is rebuilt


def test_withdraw_or_loss_of_a_shard_hides_the_version_again():
    s = state(retain=0)
    four_shards(s)
    s.withdraw("a2", "a2.1")
    assert not s.visible_versions("m")
    assert "no complete holder has layers.0.w rows 500:750;" in not_found(s, 1)
    publish(s, "a2", [rows(500, 750)], replica="a2.again")
    assert s.visible_versions("m") == [1]
    s.report_lost("a1.1")
    assert "rows 250:500" in not_found(s, 1)
    s.expire(now=float("inf"))  # every agent is gone
    assert "m" not in s.models


def test_whole_model_replica_and_num_chunks():
    s = state()
    r = publish(s, "a0", [])
    assert r.whole and r.num_chunks == -(-MANIFEST.total_bytes // CHUNK)
    assert s.visible_versions("m") == [1]
    # A held list naming every tensor whole is the same thing.
    r2 = publish(s, "a1", [(W, Region.of((1000, 8), rows=(0, 1000))), (B, Region.of((10,), flat=(0, 10)))])
    assert r2.whole
    # Whole tensors in another memory order are not the wire's "every tensor whole".
    r3 = publish(s, "a2", [(B, Region()), (W, Region())])
    assert not r3.whole and r3.held_list() == [(B, Region()), (W, Region())]


def test_manifest_disagreement_and_one_replica_per_agent():
    s = state()
    publish(s, "a0", [rows(0, 500)])
    other = Manifest((TensorSpec("layers.0.w", "float32", (1000, 4), 1000 * 4 * 4),))
    with pytest.raises(StateError) as err:
        s.publish(agent_id="a1", replica_id="x", model="m", version=1, manifest=other,
                  held=check_held(other, []), chunk_size=CHUNK, memory=None, complete=True, bitmap=b"", origin=True)
    assert err.value.code == "ALREADY_EXISTS"
    assert MANIFEST.fingerprint[:12] in str(err.value) and other.fingerprint[:12] in str(err.value)
    with pytest.raises(StateError, match="already publishes"):
        publish(s, "a0", [rows(500, 1000)], replica="a0.second")
    publish(s, "a0", [rows(0, 500)], retained=True)  # a retained copy may sit beside it


def test_check_held_refuses_what_does_not_fit():
    for held, needle in [
        ([(5, Region())], "tensor #5"),
        ([(W, Region(box=((0, 1001), (0, 8))))], "outside [0:1000)"),
        ([(W, Region(box=((0, 10),)))], "dimension"),
        ([(B, Region(flat=(3, 2)))], "inverted"),
        ([rows(0, 10), (W, Region.of((1000, 8), box=((5, 20), (2, 4))))], "overlaps"),
    ]:
        with pytest.raises(StateError) as err:
            check_held(MANIFEST, held)
        assert err.value.code == "INVALID_ARGUMENT" and needle in str(err.value), (held, str(err.value))
    check_held(MANIFEST, [rows(0, 10), rows(10, 20)])  # touching is fine


def test_retention_per_shard():
    s = state(retain=1)
    four_shards(s)
    assert all(s.needs_retention(f"a{i}", f"a{i}.1") for i in range(4))
    # A spot replica holding rank 1's rows never counts.
    publish(s, "spot", [rows(250, 500)])
    assert s.needs_retention("a1", "a1.1")
    assert not s.needs_retention("spot", "spot.1")
    # A reliable complete replica of the same rows does; a filling one does not.
    r = publish(s, "a5", [rows(200, 600)], complete=False)
    assert s.needs_retention("a1", "a1.1")
    s.report_chunks("a5", r.replica_id, list(range(r.num_chunks)), complete=True)
    assert not s.needs_retention("a1", "a1.1")
    assert s.needs_retention("a0", "a0.1") and s.needs_retention("a2", "a2.1")  # rows 600:750 are a2's alone
    # Rank 2 keeps its region in a retained copy, then unpublishes its original.
    publish(s, "a2", [rows(500, 750)], retained=True)
    assert not s.needs_retention("a2", "a2.1")
    s.withdraw("a2", "a2.1")
    assert s.visible_versions("m") == [1]
    assert s.needs_retention("a2", "a2.1r")
    # Not retained: versions that are not among the latest K visible.
    four_shards(s, version=2, upto=3)
    assert s.needs_retention("a0", "a0.1") and s.releasable("a2") == []  # v2 is not visible yet
    four_shards(s, version=2)
    assert not s.needs_retention("a0", "a0.1")
    assert s.needs_retention("a0", "a0.2")
    assert s.releasable("a2") == ["a2.1r"]


def test_retain_zero_and_invisible_versions_need_no_retention():
    s = state(retain=0)
    four_shards(s)
    assert not any(s.needs_retention(f"a{i}", f"a{i}.1") for i in range(4))
    s = state(retain=1)
    four_shards(s, upto=3)
    assert not s.needs_retention("a0", "a0.1")


def test_group_round_keeps_its_version():
    s = state()
    four_shards(s)
    assert s.resolve("m", None, "g", 1)[0] == 1
    four_shards(s, version=2)
    assert s.resolve("m", None, "g", 1)[0] == 1
    assert s.resolve("m", None, "g", 2)[0] == 2


def test_wait_for_version():
    async def go():
        s = state()
        assert await s.wait_for_version("m", 1, 0.01) is None
        waiter = asyncio.create_task(s.wait_for_version("m", 2, 5.0))
        four_shards(s, version=1)
        await asyncio.sleep(0.01)
        assert not waiter.done()  # version 1 is below at_least
        four_shards(s, version=2, upto=3)
        await asyncio.sleep(0.01)
        assert not waiter.done()  # version 2 is not visible yet
        four_shards(s, version=2)
        assert await asyncio.wait_for(waiter, 1.0) == 2
        assert await s.wait_for_version("m", 0, 0) == 2

    asyncio.run(go())


def test_resolve_returns_the_best_k_holders_and_whatever_covers_the_version():
    """Four origin shards and 20 reader copies (whole, on other hosts and zones):
    a reader is told of its k best, plus shards only if no whole copy is among them."""
    s = State(ServerConfig(max_sources=3))
    for i in range(4):
        s.register_agent(f"a{i}", f"rank{i}", Labels("trainer", "r0", "z0"), Reliability.RELIABLE)
    four_shards(s)
    for i in range(20):
        zone = "z0" if i < 10 else "z1"
        s.register_agent(f"r{i}", f"reader{i}", Labels(f"h{i}", f"rack{zone}", zone), Reliability.RELIABLE)
        s.publish(agent_id=f"r{i}", replica_id=f"r{i}.1", model="m", version=1, manifest=MANIFEST, held=check_held(MANIFEST, []),
                  chunk_size=CHUNK, memory=None, complete=i % 2 == 0, bitmap=b"", origin=False)
    s.register_agent("me", "me", Labels("hx", "rackz1", "z1"), Reliability.RELIABLE)
    _, entry = s.resolve("m", 1)
    chosen = s.sources(entry, "me")
    names = [s.replicas[r.replica_id].agent_id for r in chosen]
    assert len(chosen) == 3 and all(n.startswith("r") and int(n[1:]) >= 10 for n in names), names  # same rack first
    assert any(r.complete for r in chosen)
    # Only filling peers nearby: the k best, then a complete holder to cover the version.
    s2 = State(ServerConfig(max_sources=2))
    for i in range(4):
        s2.register_agent(f"a{i}", f"rank{i}", Labels("trainer", "r0", "z0"), Reliability.RELIABLE)
    four_shards(s2)
    for i in range(5):
        s2.register_agent(f"p{i}", f"peer{i}", Labels(f"h{i}", "r1", "z1"), Reliability.RELIABLE)
        s2.publish(agent_id=f"p{i}", replica_id=f"p{i}.1", model="m", version=1, manifest=MANIFEST, held=check_held(MANIFEST, []),
                   chunk_size=CHUNK, memory=None, complete=False, bitmap=b"", origin=False)
    s2.register_agent("me", "me", Labels("hx", "r1", "z1"), Reliability.RELIABLE)
    _, entry = s2.resolve("m", 1)
    agents = [s2.replicas[r.replica_id].agent_id for r in s2.sources(entry, "me")]
    assert agents[:2] and all(a.startswith("p") for a in agents[:2])
    assert sorted(agents[2:]) == ["a0", "a1", "a2", "a3"]  # all four shards: none alone covers
    assert len(s2.sources(entry, "me", k=100)) == 2 + 4  # a request cannot raise the server's cap


def test_expiry_waits_for_the_earliest_deadline_and_misses_none():
    """expire() skips its sweep until the earliest agent or lease deadline, and a
    lease or agent added later with a shorter TTL is still expired on time."""
    s = State(ServerConfig(agent_ttl_s=100.0, lease_ttl_s=100.0))
    s.register_agent("a", "a", Labels(), Reliability.RELIABLE)
    publish(s, "a", [])
    s.register_agent("r", "r", Labels(), Reliability.RELIABLE)
    lease = s.acquire_lease("r", ["a.1"])
    s.expire()
    assert lease.lease_id in s.leases and "a" in s.agents
    s.lease_ttl_s = 0.0  # a shorter TTL from now on: the next lease is due before the others
    short = s.acquire_lease("r", ["a.1"])
    s.expire()
    assert short.lease_id not in s.leases and lease.lease_id in s.leases
    s.heartbeat("r")  # renewals only push deadlines later
    s.expire(now=lease.expires_at)
    assert lease.lease_id not in s.leases
    assert "a" not in s.agents and not s.replicas and "r" in s.agents  # due by then (r heartbeat later)


def test_a_reader_mid_pull_is_still_told_the_holders_of_a_version_no_longer_visible():
    """Found by ``tensorhub bench rl`` (elastic): joiners pulling version v, whose
    last complete holder (the trainer's retained copy) was let go once v+1 came,
    got NOT_FOUND on every mid-pull resolve and lost sight of each other's chunks."""
    s = state(retain=0)
    trainer = publish(s, "a0", [])
    filling = publish(s, "a1", [], complete=False)  # a joiner serving what landed so far
    lease = s.acquire_lease("a2", [trainer.replica_id])  # another joiner, reading the trainer
    s.withdraw("a0", trainer.replica_id)  # let go: readable only under the leases it has
    assert not s.visible_versions("m")
    assert "has no complete replica" in not_found(s, 1)  # to anyone not pulling it
    with pytest.raises(StateError):
        s.resolve("m", 1, reader="a3")
    for reader in ("a1", "a2"):  # filling a replica of it, or holding a lease on one
        version, entry = s.resolve("m", 1, reader=reader)
        assert version == 1 and [r.replica_id for r in s.sources(entry, reader)] == \
            ([] if reader == "a1" else [filling.replica_id])
    s.release_lease(lease.lease_id)
    with pytest.raises(StateError):
        s.resolve("m", 1, reader="a2")
    with pytest.raises(StateError):  # the latest is never a version that is not visible
        s.resolve("m", None, reader="a1")


def test_rankings_kept_across_versions_follow_a_holder_that_registers_again_with_new_labels():
    """The agent part of a reader's ranking is kept from one version to the next
    (the same holders, the steady state) and dropped when an agent registers
    again: a holder that moved racks ranks by its new place in the next version."""
    s = State(ServerConfig(max_sources=1))
    s.register_agent("me", "me", Labels("h0", "r0", "z0"), Reliability.RELIABLE)
    s.register_agent("near", "near", Labels("h1", "r0", "z0"), Reliability.RELIABLE)
    s.register_agent("far", "far", Labels("h2", "r9", "z9"), Reliability.RELIABLE)

    def best(version):
        for agent in ("near", "far"):
            s.publish(agent_id=agent, replica_id=f"{agent}.{version}", model="m", version=version, manifest=MANIFEST,
                      held=check_held(MANIFEST, []), chunk_size=CHUNK, memory=None, complete=True, bitmap=b"",
                      origin=False)
        _, entry = s.resolve("m", version)
        return [r.agent_id for r in s.sources(entry, "me")]

    assert best(1) == ["near"] and best(2) == ["near"]
    s.register_agent("near", "near", Labels("h1", "r8", "z8"), Reliability.RELIABLE)  # moved: now as far as "far"
    s.register_agent("far", "far", Labels("h2", "r0", "z0"), Reliability.RELIABLE)  # and "far" moved next to "me"
    assert best(3) == ["far"]


def test_one_replica_per_agent_and_version_is_checked_after_a_replica_is_removed():
    s = state()
    publish(s, "a0", [rows(0, 500)])
    publish(s, "a1", [rows(500, 1000)])
    s.remove_replica("a0.1")
    publish(s, "a0", [rows(0, 500)], replica="a0.again")  # its earlier replica is gone: allowed
    with pytest.raises(StateError, match="already publishes"):
        publish(s, "a0", [rows(0, 500)], replica="a0.third")
    publish(s, "a0", [rows(0, 500)], replica="a0.again")  # the same id again: an idempotent re-publish
    assert sorted(s.models["m"][1].by_agent) == ["a0", "a1"] and s.models["m"][1].by_agent["a0"] == ["a0.again"]


def test_a_withdrawal_recomputes_coverage_only_when_no_holder_alike_still_counts(monkeypatch):
    """Relays of one cut share one region table (the service interns it). One of
    them withdrawn while another still counts leaves the distinct regions held,
    and so the version's visibility, as they were: no coverage is recomputed
    (1,280 withdrawals a step at paper scale). The last of a table withdrawn
    is recomputed, and hides the version when nothing else covers it."""
    import tensorhub.server.state as state_module
    s = state()
    halves = [check_held(MANIFEST, [rows(0, 500), (B, Region())]), check_held(MANIFEST, [rows(500, 1000)])]
    for i in range(4):  # a0, a1 hold the first half alike; a2, a3 the second
        s.publish(agent_id=f"a{i}", replica_id=f"relay{i}", model="m", version=1, manifest=MANIFEST,
                  held=halves[i // 2], chunk_size=CHUNK, memory=None, complete=True, bitmap=b"", origin=False)
    assert s.visible_versions("m") == [1]
    computed = []
    real = state_module._coverage
    monkeypatch.setattr(state_module, "_coverage", lambda entry, holders: computed.append(len(holders)) or real(
        entry, holders))
    s.withdraw("a0", "relay0")  # a1 still holds the first half
    s.report_lost("relay2")  # a3 the second (no leases: removed)
    assert s.visible_versions("m") == [1] and computed == []
    s.withdraw("a1", "relay1")  # the last of the first half
    assert computed == [1] and s.visible_versions("m") == []
    assert "layers.0.w rows 0:500" in not_found(s, 1)


def test_withdrawals_made_together_leave_every_version_as_one_by_one_would():
    """A Batch's withdrawals recompute each version's visibility once, at the
    end (``withdrawals_together``); inside, retention still sees each version
    as the withdrawals before left it."""
    alone, together = state(retain=1), state(retain=1)
    for s in (alone, together):
        four_shards(s, version=1)
        publish(s, "a5", [rows(0, 1000), (B, Region())], version=1)  # a whole copy
        four_shards(s, version=2)
        publish(s, "a6", [rows(0, 1000), (B, Region())], version=2)
    order = [("a0", "a0.1"), ("a5", "a5.1"), ("a1", "a1.1"), ("a6", "a6.2"), ("a0", "a0.2"), ("a1", "a1.2")]

    def run(s, wrap):
        kept = []
        with wrap():
            for agent, replica in order:
                if s.needs_retention(agent, replica):
                    kept.append(replica)  # must be retained first: not withdrawn
                else:
                    s.withdraw(agent, replica)
        return kept, s.visible_versions("m"), s.describe().models[0].versions

    got_alone = run(alone, contextlib.nullcontext)
    got_together = run(together, together.withdrawals_together)
    assert got_alone[:2] == got_together[:2]
    # Version 1 lost its whole copy and two shards: not visible; version 2, the retained one, keeps
    # ranks 0 and 1's shards (no other copy of their rows once the whole one went).
    assert got_together[:2] == (["a0.2", "a1.2"], [2])
    assert [v.visible for v in got_alone[2]] == [v.visible for v in got_together[2]]
