"""Seeing the hub: ``tensorhub status`` (the Describe RPC) against a real server
with real publisher and reader processes, behind the token; and the Prometheus
endpoint scraped over HTTP while the counters move."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from tensorhub import PermissionDenied
from tensorhub.cli import main as cli_main
from tensorhub.client.rpc import ReferenceClient
from tensorhub.errors import InvalidRequest
from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc
from tensorhub.proto import wire
from tensorhub.server import EmbeddedServer
from tensorhub.testing import HubProcess, free_port, wait_for_progress

TOKEN = "status-token-0123456789abcdef"
SPECS = [(f"layer{i}.weight", "float32", [64, 256]) for i in range(8)]  # 64 KiB each
CHUNK = 64 << 10  # one chunk a tensor, so a paced pull stays in flight for a while


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(tensorhub_[a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _status_json(address: str, token_file, capsys, *extra: str) -> dict:
    capsys.readouterr()
    assert cli_main(["status", "--address", address, "--token-file", str(token_file), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def server(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with EmbeddedServer(retain=0, token=TOKEN, metrics_port=0) as srv:
        yield srv, token_file


def test_status_shows_versions_holders_and_a_reader_in_flight(server, tmp_path, capsys, monkeypatch):
    srv, token_file = server
    monkeypatch.setenv("TENSORHUB_TOKEN", TOKEN)  # the hub processes' token
    before = _scrape(srv.metrics_url)
    assert before["tensorhub_agents"] == 0
    trainer = HubProcess(srv.address, name="trainer", labels={"zone": "z0", "rack": "r0", "host": "h0"})
    shard = HubProcess(srv.address, name="rank0", labels={"zone": "z0", "rack": "r0", "host": "h1"})
    reader = HubProcess(srv.address, name="rollout", labels={"zone": "z1", "host": "h2"}, reliability="spot")
    with trainer, shard, reader:
        trainer.call("publish", model="policy", version=1, specs=SPECS, seed=1, chunk_size=CHUNK)
        # Version 2: one rank of two has published its rows; the version is filling.
        shard.call("publish_shard", model="policy", version=2, specs=SPECS, seed=2, how="rows", rank=0, world=2)
        progress = str(tmp_path / "progress")
        reader.send("pull", model="policy", version=1, specs=SPECS, serve=True, pace_s=0.5, progress_file=progress)
        wait_for_progress(progress)
        # Landed chunks reach the server in batches: ask until some have.
        deadline = time.monotonic() + 3
        while True:
            status = _status_json(srv.address, token_file, capsys)
            mine = [r for v in status["models"][0]["versions"] for r in v["replicas"] if r["agent_id"] == reader.agent_id]
            if time.monotonic() > deadline or (mine and mine[0]["chunks_present"] > 0):
                break
            time.sleep(0.1)
        agents = {a["name"]: a for a in status["agents"]}
        assert set(agents) == {"trainer", "rank0", "rollout"}  # status itself registers no agent
        assert agents["trainer"]["labels"] == {"zone": "z0", "rack": "r0", "host": "h0"}
        assert agents["rollout"]["reliability"] == "spot" and agents["rollout"]["expires_in_s"] > 0
        [model] = status["models"]
        assert model["model"] == "policy"
        v1, v2 = model["versions"]
        assert (v1["version"], v1["visible"], v1["missing"]) == (1, True, "")
        assert v1["tensors"] == len(SPECS) and v1["total_bytes"] == 8 * (64 << 10)
        holders = {r["agent_id"]: r for r in v1["replicas"]}
        origin, filling = holders[trainer.agent_id], holders[reader.agent_id]
        assert origin["complete"] and origin["origin"] and origin["num_chunks"] == 8 and origin["held_regions"] == 0
        assert not filling["complete"] and not filling["origin"] and 0 < filling["chunks_present"] < 8
        assert origin["active_reads"] >= 1
        assert not v2["visible"] and "rows" in v2["missing"]
        [part] = v2["replicas"]
        assert part["agent_id"] == shard.agent_id and part["held_regions"] == len(SPECS)
        assert 0 < part["held_bytes"] < v2["total_bytes"]  # rank 0's rows (an uneven split)
        [lease] = [x for x in status["leases"] if x["agent_id"] == reader.agent_id]
        assert origin["replica_id"] in lease["replica_ids"] and lease["expires_in_s"] > 0

        # The same, as tables (on a terminal wide enough that no cell folds).
        monkeypatch.setenv("COLUMNS", "200")
        assert cli_main(["status", "--address", srv.address, "--token-file", str(token_file)]) == 0
        tables = capsys.readouterr().out
        for word in ("versions", "holders", "readers in flight", "complete", "filling", "rollout", "z1"):
            assert word in tables
        # One model only; an unknown one is simply absent.
        assert _status_json(srv.address, token_file, capsys, "--model", "nothing")["models"] == []

        assert reader.result(timeout=60)["version"] == 1
        trainer.call("unpublish", model="policy", version=1)
    # Bytes by source tier: the reader (zone z1) read the whole version from the
    # trainer (zone z0), and reported it with its lease release, just after the pull.
    key = 'tensorhub_pulled_bytes_total{source="origin",tier="other_zone"}'
    deadline = time.monotonic() + 5
    while (after := _scrape(srv.metrics_url))[key] < before[key] + v1["total_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert after[key] == before[key] + v1["total_bytes"]
    assert after['tensorhub_pulled_bytes_total{source="relay",tier="same_host"}'] == 0
    assert after["tensorhub_pulls_total"] >= before["tensorhub_pulls_total"] + 1
    assert after["tensorhub_pulls_served_total"] >= 1  # the reader's replica completed
    assert after["tensorhub_resolve_seconds_count"] > before["tensorhub_resolve_seconds_count"]
    assert after['tensorhub_resolves_total{outcome="ok"}'] >= 1
    assert after["tensorhub_unpublish_wait_seconds_count"] >= 1
    # The control plane's counters: the reader's first answer sent the trainer whole; one publish, in full.
    assert after['tensorhub_resolve_holders_total{form="full"}'] > before['tensorhub_resolve_holders_total{form="full"}']
    assert after['tensorhub_publishes_total{form="full"}'] >= before['tensorhub_publishes_total{form="full"}'] + 1
    assert after["tensorhub_resolve_answer_bytes_total"] > before["tensorhub_resolve_answer_bytes_total"]
    assert 'tensorhub_pull_paths_total{path="replayed"}' in after
    assert after['tensorhub_resolve_answers_total{how="own"}'] >= 1  # the reader's own Resolve
    assert 'tensorhub_resolve_answers_total{how="shared"}' in after
    # Every message by method, as the server counted it (the trainer's Publish, the reader's Resolve).
    for method in ("Publish", "Resolve", "RegisterAgent"):
        key = f'tensorhub_messages_total{{method="{method}"}}'
        assert after[key] >= before.get(key, 0) + 1, key


def test_status_needs_the_token_and_checks_its_input(server, capsys, monkeypatch):
    srv, token_file = server
    monkeypatch.delenv("TENSORHUB_TOKEN", raising=False)
    rpc = ReferenceClient(srv.address, timeout_s=10)
    try:
        with pytest.raises(PermissionDenied):
            rpc.describe()
    finally:
        rpc.close()
    assert cli_main(["status", "--address", srv.address]) == 1
    assert "token" in capsys.readouterr().err
    rpc = ReferenceClient(srv.address, timeout_s=10, token=TOKEN)
    try:
        with pytest.raises(InvalidRequest, match="model key"):
            rpc.describe("x" * 600)
    finally:
        rpc.close()
    assert cli_main(["status", "--address", srv.address, "--token-file", str(token_file.parent / "absent")]) == 2


def test_metrics_count_lost_sources_and_agents(server):
    """A reader that holds a read lease reports its source lost: the failover counter moves."""
    srv, _ = server
    before = _scrape(srv.metrics_url)
    auth = wire.auth_metadata(TOKEN)
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.ReferenceServiceStub(channel)
        for agent in ("holder", "reader"):
            stub.RegisterAgent(pb.RegisterAgentRequest(agent_id=agent), timeout=10, metadata=auth)
        stub.Publish(pb.PublishRequest(
            agent_id="holder", replica_id="holder.0", model="m", version=1, chunk_size=4096,
            manifest=pb.Manifest(tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[1024], nbytes=4096)]),
            state=pb.REPLICA_STATE_COMPLETE, origin=True,
            memory=pb.ReplicaMemory(kind=pb.MEMORY_KIND_DRAM, nixl_metadata=b"x",
                                    regions=[pb.MemoryRegion(addr=1 << 20, size=4096)])), timeout=10, metadata=auth)
        instance = stub.RegisterAgent(pb.RegisterAgentRequest(agent_id="reader"), timeout=10,
                                      metadata=auth).instance_id
        resolved = stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", latest=True, lease=True), timeout=10,
                                metadata=auth)
        assert [r.replica_id for r in resolved.replicas] == ["holder.0"]
        assert resolved.instance_id == instance  # a client notices a restarted server from a resolve too
        # Pulled bytes ride on a lease release, or come alone; a bad report changes nothing.
        stub.ReleaseReadLease(pb.ReleaseReadLeaseRequest(agent_id="reader", pulled=[
            pb.PulledBytes(tier=pb.SOURCE_TIER_SAME_RACK, origin=False, nbytes=1000)]), timeout=10, metadata=auth)
        for bad in (pb.PulledBytes(tier=9, nbytes=1), pb.PulledBytes(tier=1, nbytes=1 << 63)):
            with pytest.raises(grpc.RpcError) as e:
                stub.ReleaseReadLease(pb.ReleaseReadLeaseRequest(agent_id="reader", lease_id=resolved.lease_id,
                                                                 pulled=[bad]), timeout=10, metadata=auth)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        mid = _scrape(srv.metrics_url)
        assert mid["tensorhub_agents"] == 2 and mid["tensorhub_read_leases"] == 1
        assert mid['tensorhub_replicas{state="complete"}'] == 1 and mid['tensorhub_versions{visible="true"}'] == 1
        with pytest.raises(grpc.RpcError):  # a version nobody holds: counted as not_found
            stub.Resolve(pb.ResolveRequest(agent_id="reader", model="m", version=9), timeout=10, metadata=auth)
        stub.ReportLost(pb.ReportLostRequest(agent_id="reader", replica_id="holder.0", reason="test"), timeout=10,
                        metadata=auth)
    after = _scrape(srv.metrics_url)
    assert after["tensorhub_sources_lost_total"] == before["tensorhub_sources_lost_total"] + 1
    rack_relay = 'tensorhub_pulled_bytes_total{source="relay",tier="same_rack"}'
    assert after[rack_relay] == before[rack_relay] + 1000
    assert after['tensorhub_resolves_total{outcome="not_found"}'] == 1
    assert after['tensorhub_replicas{state="complete"}'] == 0


def test_server_command_serves_metrics(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensorhub.cli", "server", "--port", str(port), "--metrics-port",
                             "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        url = re.search(r"metrics on (http://\S+/metrics)", line)
        assert url, line
        assert _scrape(url.group(1))["tensorhub_agents"] == 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
