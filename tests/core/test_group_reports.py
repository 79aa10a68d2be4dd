"""The end of an engine's update in one message (``Hub.send_group_reports``):
each worker's serving pull holds its last report (``pull(defer_complete=True)``),
the member that resolved sends them all, the workers' pulled bytes and the
answer's lease release in one Batch; a report the server does not take goes
with its worker's heartbeat. Real NIXL between real processes, a real gRPC
server on 127.0.0.1."""

from __future__ import annotations

import time

import grpc
import pytest

from tensorhub.client.rpc import ReferenceClient
from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc
from tensorhub.proto import wire
from tensorhub.testing import HubProcess, RemoteError, join_group

SPECS = [("a", "bfloat16", (1024, 256)), ("b", "bfloat16", (1024, 256))]
CHUNK = 128 << 10


def _status(address: str):
    client = ReferenceClient(address)
    try:
        return client.describe("m")
    finally:
        client.close()


def _relays(address: str, version: int) -> dict[str, bool]:
    """Per relay agent of ``version``: whether the server lists its replica complete."""
    (model,) = _status(address).models
    (view,) = [v for v in model.versions if v.version == version]
    return {r.agent_id: r.complete for r in view.replicas if not r.origin}


def _calls(address: str) -> dict[str, int]:
    return dict(_status(address).control.calls)


def _sent_since(address: str, before: dict[str, int]) -> dict[str, int]:
    """The messages the server received since ``_calls`` gave ``before``, by method."""
    return {k: n - before.get(k, 0) for k, n in _calls(address).items() if n > before.get(k, 0)}


def _trainer_step(ranks, version: int, chunk_size: int = CHUNK) -> None:
    """The trainer's ranks take ``version`` in the buffers of ``version - 1``
    (withdrawn, overwritten with its seed, published again by rows); version 1 published fresh."""
    if version == 1:
        for rank, hub in enumerate(ranks):
            hub.call("publish_shard", model="m", version=1, specs=SPECS, seed=1, how="rows", rank=rank,
                     world=len(ranks), chunk_size=chunk_size)
        return
    for hub in ranks:
        hub.call("unpublish", model="m", version=version - 1)
        hub.call("overwrite", model="m", version=version - 1, seed=version)
    for rank, hub in enumerate(ranks):
        hub.call("republish", model="m", version=version, of=version - 1, how="rows", rank=rank, world=len(ranks),
                 chunk_size=chunk_size)


def _engine_update(ranks, workers, version: int) -> tuple[object, list[dict]]:
    """The trainer's ranks publish ``version``; the engine's first worker
    resolves for all, every worker pulls its TP slice serving, its last
    report held."""
    for rank, hub in enumerate(ranks):
        hub.call("publish_shard", model="m", version=version, specs=SPECS, seed=version, how="rows", rank=rank,
                 world=len(ranks), chunk_size=CHUNK)
    answer = workers[0].call("resolve_for_group", model="m", version=version, group="engine0",
                             members=[w.agent_id for w in workers])
    got = [w.call("pull", model="m", version=version, specs=SPECS, expect_seed=version, read=("tp", i, len(workers)),
                  serve=True, answer=answer, defer_complete=True) for i, w in enumerate(workers)]
    for g in got:
        assert g["mismatched"] == [], g["mismatched"]
    return answer, got


def test_an_engines_last_reports_pulled_bytes_and_lease_go_in_one_message(server, hubs):
    ranks = [hubs("rank0"), hubs("rank1")]
    workers = [hubs("w0"), hubs("w1"), hubs("w2")]
    before = _calls(server.address)
    answer, _ = _engine_update(ranks, workers, 1)
    # Held: the server still lists the relays filling (with what they reported before).
    assert _relays(server.address, 1) == {w.agent_id: False for w in workers}
    reports = [w.call("member_report", model="m", version=1) for w in workers]
    assert all(r.report and r.pulled for r in reports)
    assert workers[0].call("send_group_reports", answer=answer, reports=reports) == ["", "", ""]
    assert _relays(server.address, 1) == {w.agent_id: True for w in workers}
    calls = _calls(server.address)
    sent = {k: n - before.get(k, 0) for k, n in calls.items() if n > before.get(k, 0)}
    assert sent.get("Batch") == 1
    # No worker released a lease or reported its pulled bytes on its own: they rode the Batch.
    assert "ReleaseReadLease" not in sent, sent
    (lease_view,) = [v for v in _status(server.address).leases if v.lease_id == answer.lease_id] or [None]
    assert lease_view is None  # the answer's lease went with it


def test_a_report_the_group_could_not_deliver_goes_with_the_workers_heartbeat(server, hubs):
    ranks = [hubs("rank0")]
    workers = [hubs("w0"), hubs("w1")]
    answer, _ = _engine_update(ranks, workers, 1)
    # The gather lost w1's report (its worker is slow to the barrier, or the channel failed):
    # the first worker sends its own, w1 hands its to the heartbeat.
    mine = workers[0].call("member_report", model="m", version=1)
    assert workers[0].call("send_group_reports", answer=answer, reports=[mine]) == [""]
    w0, w1 = (w.agent_id for w in workers)
    assert _relays(server.address, 1) == {w0: True, w1: False}
    workers[1].call("report_later", model="m", version=1)
    deadline = time.monotonic() + 10
    while not _relays(server.address, 1)[w1]:
        assert time.monotonic() < deadline, "the heartbeat never completed w1's replica"
        time.sleep(0.2)


def test_each_message_of_a_batch_is_answered_as_it_would_be_alone(server, hubs):
    ranks = [hubs("rank0")]
    workers = [hubs("w0"), hubs("w1")]
    answer, _ = _engine_update(ranks, workers, 1)
    good = workers[1].call("member_report", model="m", version=1)
    w1 = workers[1].agent_id
    stranger = type(good)(agent_id=w1, report=ReferenceClient.complete_report(w1, "no-such-replica", [0]))
    why = workers[0].call("send_group_reports", answer=None, reports=[stranger, good])
    assert why[1] == "" and "no-such-replica" in why[0], why
    assert _relays(server.address, 1)[w1] is True
    # Raw: a report of too many chunks is refused alone, the release beside it taken.
    channel = grpc.insecure_channel(server.address)
    try:
        stub = pb_grpc.ReferenceServiceStub(channel)
        metadata = wire.auth_metadata("")
        (replica,) = [r.replica_id for v in _status(server.address).models[0].versions for r in v.replicas
                      if r.agent_id == w1]
        got = stub.Batch(pb.BatchRequest(
            reports=[pb.ReportChunksRequest(agent_id=w1, replica_id=replica, chunks=range(10**6), complete=True)],
            releases=[pb.ReleaseReadLeaseRequest(agent_id=workers[0].agent_id, lease_id=answer.lease_id)]),
            timeout=10, metadata=metadata)
        assert got.reports[0].code == "INVALID_ARGUMENT" and "chunks reported" in got.reports[0].detail
        assert got.releases[0].code == ""
        assert answer.lease_id not in {v.lease_id for v in _status(server.address).leases}
        with pytest.raises(grpc.RpcError) as e:
            stub.Batch(pb.BatchRequest(releases=[pb.ReleaseReadLeaseRequest(agent_id="w0")] * 1000), timeout=10,
                       metadata=metadata)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than" in e.value.details()
    finally:
        channel.close()


@pytest.mark.parametrize("carrier", ["Batch", "Resolve"])
def test_withdrawals_sent_together_are_each_answered_as_unpublish_would(server, hubs, carrier):
    """A group's withdrawals go with its Resolve (``EngineShare.exchange``), or
    in a Batch where that failed: each is checked and answered as an
    Unpublish alone, and their drains are waited for together, each up to its
    own deadline."""
    ranks = [hubs("rank0")]
    workers = [hubs("w0"), hubs("w1")]
    answer, _ = _engine_update(ranks, workers, 1)  # its lease (not released here) covers rank 0's replica
    w0, w1 = (w.agent_id for w in workers)
    replica = {r.agent_id: r.replica_id for v in _status(server.address).models[0].versions for r in v.replicas}
    channel = grpc.insecure_channel(server.address)
    try:
        stub = pb_grpc.ReferenceServiceStub(channel)
        withdrawals = [
            pb.UnpublishRequest(agent_id=ranks[0].agent_id, replica_id=replica[ranks[0].agent_id],
                                drain_timeout_s=1.0, force=True),  # leased: not drained by its deadline
            pb.UnpublishRequest(agent_id=w1, replica_id="no-such-replica", drain_timeout_s=1.0),
            pb.UnpublishRequest(agent_id=w1, replica_id=replica[w0], drain_timeout_s=1.0),  # another's
            pb.UnpublishRequest(agent_id=w1, replica_id=replica[w1], drain_timeout_s=-1.0),
            pb.UnpublishRequest(agent_id=w1, replica_id=replica[w1], drain_timeout_s=1.0),  # drains at once
        ]
        if carrier == "Resolve":  # a resolve that fails handles none of them
            with pytest.raises(grpc.RpcError) as err:
                stub.Resolve(pb.ResolveRequest(agent_id=w1, model="m", version=7, withdrawals=withdrawals),
                             timeout=30, metadata=wire.auth_metadata(""))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert not any(r.withdrawn for v in _status(server.address).models[0].versions for r in v.replicas)
        start = time.monotonic()
        if carrier == "Batch":
            got = stub.Batch(pb.BatchRequest(withdrawals=withdrawals), timeout=30, metadata=wire.auth_metadata(""))
        else:
            got = stub.Resolve(pb.ResolveRequest(agent_id=w1, model="m", version=1, withdrawals=withdrawals),
                               timeout=30, metadata=wire.auth_metadata(""))
            assert got.version == 1 and got.replicas  # the answer, as without them
        took = time.monotonic() - start
    finally:
        channel.close()
    codes = [o.code for o in got.withdrawals]
    assert codes == ["", "NOT_FOUND", "PERMISSION_DENIED", "INVALID_ARGUMENT", ""], [o.detail for o in got.withdrawals]
    leased, *_, drained = got.withdrawals
    assert not leased.unpublished.drained and leased.unpublished.leases_outstanding == 1, leased
    assert drained.unpublished.drained and drained.unpublished.leases_outstanding == 0, drained
    assert 1.0 <= took < 10.0, took  # the drains ran together: one deadline, not one after another
    held = {r.agent_id: r.withdrawn for v in _status(server.address).models[0].versions for r in v.replicas}
    # Rank 0's withdrawn, still leased; w0's untouched. (w1's went; its process, which did not send that
    # withdrawal, announces it again with its heartbeat.)
    assert held[ranks[0].agent_id] is True and held[w0] is False, held
    workers[0].call("release_group_answer", answer=answer)


def _engine(hubs, world: int) -> list[HubProcess]:
    """``world`` workers of one engine in a gloo group, as vLLM's TP workers are."""
    return join_group([hubs(f"w{r}") for r in range(world)])


def _update(workers: list[HubProcess], version: int) -> list[dict]:
    for r, hub in enumerate(workers):
        hub.send("engine_update", model="m", version=version, specs=SPECS, rank=r, world=len(workers), seed=version,
                 unpublish_first=version - 1 if version > 1 else None)
    got = [hub.result() for hub in workers]
    for g in got:
        assert g["mismatched"] == [], g["mismatched"]
    return got


def test_an_engines_step_costs_the_server_three_messages_then_two_in_the_steady_state(server, hubs):
    ranks = [hubs("rank0"), hubs("rank1")]
    workers = _engine(hubs, 3)
    for version in (1, 2, 3):  # the first announces go whole (their manifest by fingerprint), then lean
        _trainer_step(ranks, version)
        before, ahead_before = _calls(server.address), _status(server.address).control.announces_ahead
        got = _update(workers, version)
        sent = _sent_since(server.address, before)
        sent.pop("Describe", None)
        sent.pop("Heartbeat", None)  # on their clock, not per step
        refreshes = sum(g["refreshes"] for g in got)
        # The engine's Resolve, with its workers' withdrawals of their previous version; their announces
        # in a Batch, and their last reports, pulled bytes and the lease in another. In the steady state
        # (their previous pulls named their holders) the announces go ahead with the Resolve.
        steady = version > 2
        assert sent.pop("Resolve") == 1 + refreshes
        assert sent.pop("Batch") == (1 if steady else 2)
        assert _status(server.address).control.announces_ahead - ahead_before == (len(workers) if steady else 0)
        assert "Unpublish" not in sent, sent
        # Reports on the way are the pull's own (none on a quick pull); nothing else per worker.
        sent.pop("ReportChunks", None)
        assert sent == {}, sent
        assert set(_relays(server.address, version).values()) == {True}
        if version > 1:
            assert all(g["path"] == "replayed" for g in got), [g["not_replayed"] for g in got]
        # From the step after a steady one, the engine's Resolve names what its workers read before
        # (EngineShare gathers them): the answer is those holders alone, no ranking.
        assert [g["named"] for g in got] == [version > 2] * len(workers)


def test_announces_sent_ahead_fall_back_when_a_pull_fails_or_its_replica_differs(server, hubs):
    """The steady state's announces go with the engine's Resolve
    (``tensorhub.client.ahead``); whatever does not fit goes as before, byte-exact:
    a worker whose pull fails after the server took its announce leaves no
    replica listed; a step where one worker announced ahead and the other could
    not uses the announces' round for that one alone; a trainer that changes
    its chunk size makes every announce sent ahead differ from the pull's
    replica, which announces itself (the same replica id: one per worker)."""
    rank = hubs("rank0")
    workers = _engine(hubs, 2)

    def step(version: int, specs: list | None = None, chunk_size: int = CHUNK) -> tuple[dict, dict, int]:
        _trainer_step([rank], version, chunk_size)
        before, ahead0 = _calls(server.address), _status(server.address).control.announces_ahead
        for r, hub in enumerate(workers):
            hub.send("engine_update", model="m", version=version, specs=specs if specs and r == 1 else SPECS,
                     rank=r, world=2, seed=version, unpublish_first=version - 1 if version > 1 else None,
                     fresh=bool(specs) and r == 1)
        got = {}
        for r, hub in enumerate(workers):
            if specs and r == 1:
                with pytest.raises(RemoteError, match="ManifestMismatch"):
                    hub.result(timeout=60)
            else:
                got[r] = hub.result(timeout=60)
                assert got[r]["mismatched"] == [], got[r]["mismatched"]
        sent = _sent_since(server.address, before)
        return got, sent, _status(server.address).control.announces_ahead - ahead0

    for version in (1, 2, 3):
        step(version)
    _, sent, ahead = step(4, specs=[("a", "float32", (1024, 256)), SPECS[1]])
    assert ahead == 2 and sent["Batch"] == 1, (ahead, sent)  # both went ahead, no announces' round
    # Worker 1's pull failed before it wrote: the replica announced for it is withdrawn (at its next heartbeat).
    deadline = time.monotonic() + 15
    while workers[1].agent_id in _relays(server.address, 4) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _relays(server.address, 4) == {workers[0].agent_id: True}
    # Worker 1 has no replica to fill again: it announces in the round, worker 0 went ahead.
    _, sent, ahead = step(5)
    assert ahead == 1 and sent["Batch"] == 2, (ahead, sent)
    assert _relays(server.address, 5) == {w.agent_id: True for w in workers}
    for version in (6, 7):  # both ahead again, then a new chunk size: both differ and announce alone
        _, sent, ahead = step(version, chunk_size=CHUNK if version == 6 else CHUNK // 2)
        assert ahead == 2 and sent["Batch"] == 1, (ahead, sent)
        assert sent.get("Publish", 0) == (2 if version == 7 else 0), sent
    (model,) = _status(server.address).models
    (view,) = [v for v in model.versions if v.version == 7]
    relays = [r for r in view.replicas if not r.origin]
    assert sorted(r.agent_id for r in relays) == sorted(w.agent_id for w in workers)
    assert all(r.complete and r.num_chunks == -(-r.held_bytes // (CHUNK // 2)) for r in relays), relays


def test_a_hub_told_not_to_announce_ahead_keeps_the_announces_round(server, hubs):
    """``HubConfig.announce_ahead=False``: the steady step stays three messages
    (the announces in a Batch of their own), byte-exact and named as before."""
    rank = hubs("rank0")
    workers = join_group([hubs(f"w{r}", announce_ahead=False) for r in range(2)])
    for version in (1, 2, 3):
        _trainer_step([rank], version)
        before = _calls(server.address)
        got = _update(workers, version)
    sent = _sent_since(server.address, before)
    assert all(g["named"] for g in got) and sent["Batch"] == 2, sent
    assert _status(server.address).control.announces_ahead == 0


def test_announces_sent_with_a_resolve_are_each_answered_as_a_publish_would(server, hubs):
    """``ResolveRequest.announces``, raw: each handled after the answer as a
    Publish alone; one that takes its checksums from the complete holder cut
    alike (``checksums_from_alike``: a relay of a whole trainer) gets that
    holder's; refused alone where it is not a FILLING replica of the resolved
    version by a member of the group, or no such holder has checksums; with
    ``latest`` the whole call is refused."""
    rank, worker = hubs("rank0"), hubs("w0")
    rank.call("publish_shard", model="m", version=1, specs=SPECS, seed=1, how="whole", rank=0, world=1,
              chunk_size=CHUNK)
    got = worker.call("pull", model="m", version=1, specs=SPECS, expect_seed=1, serve=True)
    assert got["mismatched"] == []
    rank.call("unpublish", model="m", version=1)
    rank.call("overwrite", model="m", version=1, seed=2)
    rank.call("republish", model="m", version=2, of=1, chunk_size=CHUNK)
    ahead = pb.PublishRequest.FromString(worker.call("announce_ahead", model="m", of=1, version=2))
    assert ahead.checksums_from_alike and ahead.layout and not ahead.chunk_crc32, ahead
    channel = grpc.insecure_channel(server.address)
    try:
        stub = pb_grpc.ReferenceServiceStub(channel)
        metadata = wire.auth_metadata("")

        def variant(**changes) -> pb.PublishRequest:
            out = pb.PublishRequest()
            out.CopyFrom(ahead)
            for name, value in changes.items():
                if isinstance(value, list):
                    getattr(out, name).extend(value)
                else:
                    setattr(out, name, value)
            return out

        # Another version, or COMPLETE: refused alone, the good one beside them taken.
        answer = stub.Resolve(pb.ResolveRequest(agent_id=worker.agent_id, model="m", version=2, announces=[
            variant(version=3), variant(state=pb.REPLICA_STATE_COMPLETE), ahead]), timeout=10, metadata=metadata)
        assert [o.code for o in answer.announces] == ["INVALID_ARGUMENT", "INVALID_ARGUMENT", ""], answer.announces
        assert len(answer.replicas) == 1 and answer.version == 2
        # The relay announced ahead lists the trainer's checksums of version 2 (it will hold the same bytes).
        stub.RegisterAgent(pb.RegisterAgentRequest(agent_id="probe", name="probe"), timeout=10, metadata=metadata)
        listed = stub.Resolve(pb.ResolveRequest(agent_id="probe", model="m", version=2), timeout=10,
                              metadata=metadata).replicas
        crcs = {r.replica_id.split(".")[0] == worker.agent_id: list(r.chunk_crc32) for r in listed}
        assert crcs[True] == crcs[False] and len(crcs[True]) == 8, crcs
        # Another agent's announce with this agent's resolve: refused alone.
        answer = stub.Resolve(pb.ResolveRequest(agent_id=rank.agent_id, model="m", version=2, announces=[ahead]),
                              timeout=10, metadata=metadata)
        assert answer.announces[0].code == "PERMISSION_DENIED", answer.announces
        # No complete holder of version 3 to take checksums from; checksums sent with the flag.
        refused = stub.Batch(pb.BatchRequest(publishes=[
            variant(version=3), variant(chunk_crc32=[1] * 8)]), timeout=10, metadata=metadata).publishes
        assert [o.code for o in refused] == ["FAILED_PRECONDITION", "INVALID_ARGUMENT"], refused
        assert "checksums" in refused[0].detail, refused[0].detail
        with pytest.raises(grpc.RpcError) as e:
            stub.Resolve(pb.ResolveRequest(agent_id=worker.agent_id, model="m", latest=True, announces=[ahead]),
                         timeout=10, metadata=metadata)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "latest" in e.value.details()
    finally:
        channel.close()


def test_a_worker_that_fails_keeps_the_engines_rounds_in_step(server, hubs):
    """Every worker takes part in every round of the engine whatever fails on
    its side: one worker whose destination does not match (its pull fails
    before it announces) while the others pull byte-exact, then a version
    nobody has (the first worker's Resolve fails). No worker waits forever."""
    ranks = [hubs("rank0")]
    workers = _engine(hubs, 3)
    ranks[0].call("publish_shard", model="m", version=1, specs=SPECS, seed=1, how="rows", rank=0, world=1,
                  chunk_size=CHUNK)
    wrong = [("a", "bfloat16", (1024, 255)), SPECS[1]]
    for r, hub in enumerate(workers):
        hub.send("engine_update", model="m", version=1, specs=wrong if r == 1 else SPECS, rank=r, world=3, seed=1)
    for r, hub in enumerate(workers):
        if r == 1:
            with pytest.raises(RemoteError, match="ManifestMismatch"):
                hub.result(timeout=60)
        else:
            assert hub.result(timeout=60)["mismatched"] == []
    relays = _relays(server.address, 1)
    assert [relays.get(workers[r].agent_id) for r in (0, 2)] == [True, True]
    for r, hub in enumerate(workers):
        hub.send("engine_update", model="m", version=7, specs=SPECS, rank=r, world=3, seed=7)
    for hub in workers:
        with pytest.raises(RemoteError, match="VersionNotFound"):
            hub.result(timeout=60)


def test_a_withdrawal_the_group_did_not_finish_goes_alone(server):
    """``Hub.withdrawal`` / ``Hub.withdrawn`` (``EngineShare.exchange``): a
    withdrawal the group's Batch drained closes the publication without
    another message; one the Batch never sent (its channel failed) is
    unpublished alone; a closed publication has nothing to withdraw."""
    import torch

    from tensorhub import Hub
    from tensorhub.client.publication import PubState

    t = torch.arange(4096, dtype=torch.float32)
    with Hub.connect(server.address, name="relay") as hub:
        drained = hub.publish("m", 1, {"a": t})
        before = _calls(server.address)
        [outcome] = hub.send_group_withdrawals([hub.withdrawal(drained, 10.0)])
        assert outcome == (True, 0, False), outcome
        hub.withdrawn(drained, outcome, 10.0)
        assert drained.state is PubState.CLOSED
        assert hub.withdrawal(drained, 10.0) == b""  # closed: nothing more to send
        alone = hub.publish("m", 2, {"a": t})
        assert hub.withdrawal(alone, 10.0)
        hub.withdrawn(alone, None, 10.0)  # the group's Batch did not go: withdrawn on its own
        assert alone.state is PubState.CLOSED
        sent = {k: n - before.get(k, 0) for k, n in _calls(server.address).items() if n > before.get(k, 0)}
        assert sent.get("Batch") == 1 and sent.get("Unpublish") == 1, sent
        assert not [v for m in _status(server.address).models for v in m.versions], "a replica is still listed"
