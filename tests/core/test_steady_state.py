"""The steady state (``client/replay.py``): a reader that pulled version v
into its buffers pulls v+1 from the same holders' same buffers without
holder tables sent or decoded, by plans it made for v, reading only replicas
of v+1, byte-exact; and every change in the layout falls back to planning,
byte-exact too. Real NIXL between real processes, a real gRPC server (in a
subprocess where it restarts)."""

from __future__ import annotations

import time
from dataclasses import asdict

import grpc
import pytest

from tensorhub.client.replay import PLANNED, REPLAYED, path_of
from tensorhub.client.rpc import ReferenceClient
from tensorhub.manifest import Manifest, TensorSpec
from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc
from tensorhub.proto import wire
from tensorhub.regions import Region
from tensorhub.server import EmbeddedServer
from tensorhub.server.config import ServerConfig
from tensorhub.server.state import State
from tensorhub.testing import HubProcess, ServerProcess
from tensorhub.topology import Labels, Reliability

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


def _group_step(leader: HubProcess, workers: list[HubProcess], version: int, seed: int) -> list[dict]:
    """One engine's update: the leader resolves for the group, every worker
    pulls its slice with that answer, then the leader lets the lease go."""
    answer = leader.call("resolve_for_group", model="m", version=version, group="engine0",
                         members=[w.agent_id for w in workers])
    got = [w.call("pull", model="m", version=version, specs=SPECS, expect_seed=seed, read=("tp", rank, 2),
                  keep="dest", answer=answer) for rank, w in enumerate(workers)]
    leader.call("release_group_answer", answer=answer)
    for g in got:
        assert g["mismatched"] == [], g["mismatched"]
    return got


def _refreshes(pulls: list[dict]) -> int:
    return sum(p["refreshes"] for p in pulls)


def test_one_resolve_per_engine_serves_every_worker_and_its_lease_goes_with_the_leader(server, hubs):
    ranks = [hubs("rank0"), hubs("rank1")]
    workers = [hubs("w0"), hubs("w1")]
    _publish(ranks, 1, seed=1)
    before = _control(server.address)
    got = _group_step(workers[0], workers, 1, 1)
    for g in got:
        assert g["path"] == PLANNED and set(g["sources"]) == {"rank0", "rank1"}
    after = _control(server.address)
    # One message for the engine, not one per worker; a pull slower than a
    # refresh interval (a loaded machine) asks again mid-pull, and says so.
    assert after["resolves"] - before["resolves"] == 1 + _refreshes(got)
    assert after["answers_shared"] - before["answers_shared"] == 1
    for v in (2, 3):
        _step(ranks, v - 1, v, seed=v)  # the step's unpublish returns: the group's lease on v-1 was released
        before = _control(server.address)
        got = _group_step(workers[0], workers, v, v)
        for g in got:
            assert g["path"] == REPLAYED, g["not_replayed"]  # the answer decoded as the member's own: lean
        after = _control(server.address)
        assert after["resolves"] - before["resolves"] == 1 + _refreshes(got)
        assert after["holders_full"] == before["holders_full"]
    # A worker whose history differs (it never saw the holders' layouts the
    # answer names) cannot use it: it resolves on its own, and is exact.
    late = hubs("w2")
    _step(ranks, 3, 4, seed=4)
    before = _control(server.address)
    got = _group_step(workers[0], [*workers, late][1:], 4, 4)  # w1 (knows them) and w2 (never pulled)
    assert got[0]["path"] == REPLAYED and got[1]["path"] == PLANNED
    assert _control(server.address)["resolves"] - before["resolves"] == 2 + _refreshes(got)  # the leader's, w2's own


def test_a_group_answer_is_refused_for_strangers_and_without_a_lease(server, hubs):
    ranks = [hubs("rank0")]
    _publish(ranks, 1, seed=1)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ReferenceServiceStub(channel)
        agent = ranks[0].agent_id
        for kw, code, says in (
                ({"group": "g", "lease": True, "members": ["nobody"]}, grpc.StatusCode.FAILED_PRECONDITION,
                 "not registered"),
                ({"group": "g", "members": [agent]}, grpc.StatusCode.INVALID_ARGUMENT, "need a group and a lease"),
                ({"lease": True, "members": [agent]}, grpc.StatusCode.INVALID_ARGUMENT, "need a group and a lease"),
                ({"group": "g", "lease": True, "members": [f"a{i}" for i in range(65)]},
                 grpc.StatusCode.INVALID_ARGUMENT, "more than 64")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Resolve(pb.ResolveRequest(agent_id=agent, model="m", version=1, **kw), timeout=10)
            assert err.value.code() == code and says in err.value.details(), err.value.details()


def test_a_steady_reader_names_its_holders_and_is_ranked_again_when_one_is_laid_out_anew(server, hubs):
    """From the third version on (the second was steady), the reader's answer
    is the holders it read before, named, with no ranking; a rank that
    publishes from fresh buffers is not waited for (another layout will not
    come), and the answer is ranked again, byte-exact."""
    ranks = [hubs("rank0"), hubs("rank1")]
    reader = hubs("reader", named_wait_s=5.0)
    _publish(ranks, 1, seed=1)
    assert not _pull(reader, 1, 1)["named"]
    _step(ranks, 1, 2, seed=2)
    assert not _pull(reader, 2, 2)["named"]  # its pull of version 1 was the first into these buffers
    before = _control(server.address)
    _step(ranks, 2, 3, seed=3)
    got = _pull(reader, 3, 3)
    assert got["named"] and got["path"] == REPLAYED and set(got["sources"]) == {"rank0", "rank1"}
    after = _control(server.address)
    assert (after["answers_named"] - before["answers_named"], after["named_missed"]) == (1, before["named_missed"])
    _step(ranks, 3, 4, seed=4)
    got = _pull(reader, 4, 4, pace_s=0.03)  # slower than a refresh interval: several rounds
    # The holders named give it all: no "who else holds it" after its rounds (a plan may be made
    # afresh on a loaded machine, where the holders' loads rank a chunk's holders otherwise)
    assert got["named"] and got["refreshes"] == 0, {k: got[k] for k in ("path", "not_replayed", "refreshes")}
    for hub in ranks:
        hub.call("unpublish", model="m", version=4)
    ranks[0].call("overwrite", model="m", version=4, seed=5)
    ranks[0].call("republish", model="m", version=5, of=4, how="rows", rank=0, world=2, chunk_size=CHUNK)
    ranks[1].call("publish_shard", model="m", version=5, specs=SPECS, seed=5, how="rows", rank=1, world=2,
                  chunk_size=CHUNK)  # fresh buffers
    got = _pull(reader, 5, 5)
    assert not got["named"] and got["path"] == PLANNED and got["seconds"] < 4.0  # not the 5 s wait
    assert _control(server.address)["named_missed"] == before["named_missed"] + 1


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
            for rank, hub in enumerate(ranks):  # each holder re-registers with the new instance (heartbeats)
                while True:  # retry this rank alone: one that got through must not publish twice
                    try:
                        hub.call("republish", model="m", version=2, of=1, how="rows", rank=rank, world=2,
                                 chunk_size=CHUNK)
                        break
                    except Exception:  # noqa: BLE001  refused until the agent is known again
                        assert time.monotonic() < deadline, f"rank{rank} never got back to the restarted server"
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


# ---------------------------------------------------------------- the server alone


def _publish_request(agent: str, version: int, addr: int = 1 << 32) -> pb.PublishRequest:
    return pb.PublishRequest(
        agent_id=agent, replica_id=f"{agent}.{version}", model="m", version=version, chunk_size=1 << 20,
        state=pb.REPLICA_STATE_COMPLETE, origin=True,
        manifest=pb.Manifest(tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[256, 256], nbytes=1 << 18)]),
        memory=pb.ReplicaMemory(kind=pb.MEMORY_KIND_DRAM, nixl_metadata=b"meta",
                                regions=[pb.MemoryRegion(addr=addr, size=1 << 18)]))


def test_a_publish_by_layout_is_taken_only_from_the_agent_that_sent_it_whole():
    with EmbeddedServer(retain=0) as srv, grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.ReferenceServiceStub(channel)
        for agent in ("a", "b"):
            stub.RegisterAgent(pb.RegisterAgentRequest(agent_id=agent, name=agent))
        first = _publish_request("a", 1)
        stub.Publish(first)
        layout = wire.publish_layout(first)

        def lean(agent: str, version: int) -> pb.PublishRequest:
            req = _publish_request(agent, version)
            for name in ("held", "held_table", "memory"):
                req.ClearField(name)
            req.layout = layout
            return req

        stub.Publish(lean("a", 2))  # the same buffers, by digest
        with pytest.raises(grpc.RpcError) as other:  # another agent cannot claim a's memory
            stub.Publish(lean("b", 2))
        assert other.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "layout unknown" in other.value.details()
        both = lean("a", 3)
        both.memory.CopyFrom(first.memory)
        with pytest.raises(grpc.RpcError) as mixed:
            stub.Publish(both)
        assert mixed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        control = stub.Describe(pb.DescribeRequest()).control
        assert (control.publishes_full, control.publishes_lean) == (1, 1)
        # Every message that arrived, refused or not, by method (the Describe itself too).
        assert dict(control.calls) == {"RegisterAgent": 2, "Publish": 4, "Describe": 1}
        # Version 2, by layout, is read from a's memory as version 1 was: the reader's holder comes lean.
        v1 = stub.Resolve(pb.ResolveRequest(agent_id="b", model="m", version=1))
        v2 = stub.Resolve(pb.ResolveRequest(agent_id="b", model="m", version=2, known_layouts=[v1.replicas[0].layout]))
        assert v2.replicas[0].layout == v1.replicas[0].layout and not v2.replicas[0].agent_id
        assert v2.replicas[0].replica_id == "a.2" and not v2.replicas[0].HasField("memory")
        # With the server's numbering, by number: no digest, the replica id as its suffix (13 bytes a holder).
        assert v1.replicas[0].layout_id and v2.layout_ids == v1.layout_ids
        by_number = stub.Resolve(pb.ResolveRequest(agent_id="b", model="m", version=2, layout_ids=v1.layout_ids,
                                                   known_layouts=[v1.replicas[0].layout])).replicas[0]
        assert (by_number.layout, by_number.layout_id, by_number.replica_id, by_number.replica_suffix) == (
            b"", v1.replicas[0].layout_id, "", "2")
        assert by_number.ByteSize() <= 13
        stale = stub.Resolve(pb.ResolveRequest(agent_id="b", model="m", version=2, layout_ids="another/0",
                                               known_layouts=[v1.replicas[0].layout])).replicas[0]
        assert stale.layout == v1.replicas[0].layout  # another numbering (a restart): by digest
        with pytest.raises(grpc.RpcError) as many:
            stub.Resolve(pb.ResolveRequest(agent_id="b", model="m", version=2, known_layouts=[b"x" * 16] * 4097))
        assert many.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_groups_members_share_one_list_that_leaves_them_out():
    manifest = Manifest((TensorSpec("w", "float32", (8, 4), 128),))
    state = State(ServerConfig(max_sources=3))
    for i in range(12):
        state.register_agent(f"h{i}", f"h{i}", Labels(host=f"h{i}"), Reliability.RELIABLE)
        state.publish(agent_id=f"h{i}", replica_id=f"h{i}.1", model="m", version=1, manifest=manifest,
                      held=[(0, Region())], chunk_size=4096, memory=None, complete=True, bitmap=b"", origin=False)
    entry = state.models["m"][1]
    first = state.group_sources("m", entry, "h0", "engine")  # h0 and h1 are members: never each other's sources
    second = state.group_sources("m", entry, "h1", "engine")
    assert {r.agent_id for r in second}.isdisjoint({"h0", "h1"})
    again = state.group_sources("m", entry, "h0", "engine")
    assert again is second  # one list for the group while nothing changes
    assert [r.agent_id for r in first if r.agent_id != "h1"][:2] == [r.agent_id for r in second][:2]  # ranked alike


def test_fresh_buffers_at_freed_addresses_replay_exactly(hubs):
    """A trainer that frees each step's buffers and allocates the next: the
    allocator hands back the same addresses, NIXL registers them anew, and the
    holder's layout may repeat an earlier one. The replay must read the new
    registration's bytes, exactly."""
    holder, reader = hubs("holder"), hubs("reader")
    for v in range(1, 9):
        holder.call("publish", model="m", version=v, specs=SPECS, seed=v, chunk_size=CHUNK)
        got = reader.call("pull", model="m", version=v, specs=SPECS, expect_seed=v, keep="dest")
        assert got["mismatched"] == [] and not got["lost"], (v, got)
        holder.call("unpublish", model="m", version=v)
        holder.call("free", model="m", version=v)
