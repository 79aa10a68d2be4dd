"""``tensorhub bench server`` end to end, small: a real server process, real
load generator processes, every figure present in the JSON."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from tensorhub import Hub
from tensorhub.bench.server import ServerBenchConfig, run
from tensorhub.cli import main as cli_main
from tensorhub.server import EmbeddedServer


def test_bench_server_reports_latency_and_memory(tmp_path):
    out = tmp_path / "server.json"
    report = run(ServerBenchConfig(sweep=(12,), holders=3, tensors=8, seconds=2.0, generators=1, agents=12),
                 json_path=str(out))
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    [step] = report["steps"]
    assert step["agents"] == 12 and step["errors"] == 0, step["extra"]["first_errors"]
    assert step["resolves"] > 0 and step["heartbeats"] > 0  # the holders' heartbeats
    assert step["heartbeats_skipped"] > 0  # readers skip theirs while they resolve, as the client does
    assert step["holders_per_answer"] == 3  # every holder, the reader never among them
    assert 0 < step["resolve_ms"]["p50"] <= step["resolve_ms"]["p99"] <= step["resolve_ms"]["max"]
    assert step["server_rss_mb"] > 0 and step["bytes_per_replica"] >= 0
    # Where the CPU went: the server, and the load generators that share the machine with it.
    assert step["server_cpu"] > 0 and step["generator_cpu"] > 0 and step["server_us_per_call"] > 0
    assert step["other_cpu"] >= 0 and report["server_alone_agents_per_core"] > 0
    assert "p99_passes_goal_at_agents" in report
    # The server has a core of its own, so a late load generator does not count as server latency.
    if len(os.sched_getaffinity(0)) >= 2:
        placement = report["placement"]
        assert len(placement["server"]) == 1 and placement["server"][0] not in placement["generators"]


def test_bench_server_refuses_bad_settings(capsys):
    assert cli_main(["bench", "server", "--seconds", "0.5"]) == 2
    assert "warm-up" in capsys.readouterr().err
    assert cli_main(["bench", "server", "--heartbeat-interval", "0"]) == 2
    assert "intervals positive" in capsys.readouterr().err
    with pytest.raises(ValueError, match="holders"):
        ServerBenchConfig(holders=0)


def test_a_reader_that_keeps_resolving_skips_its_heartbeats():
    """A Resolve keeps its agent alive on the server and carries the server's
    instance id, so a reader that holds nothing and resolves more often than it
    heartbeats sends no heartbeats (half the calls on a busy server); idle, it
    heartbeats again."""
    with EmbeddedServer(retain=0) as server, \
            Hub.connect(server.address, name="trainer", heartbeat_interval_s=0.2) as trainer, \
            Hub.connect(server.address, name="reader", heartbeat_interval_s=0.2) as reader:
        trainer.publish("m", 1, {"w": torch.arange(1024, dtype=torch.float32)})
        sent = []
        real = reader._rpc.heartbeat
        reader._rpc.heartbeat = lambda *a, **k: sent.append(time.monotonic()) or real(*a, **k)
        into = {"w": torch.zeros(1024)}
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # about 5 heartbeat periods, each with several resolves
            assert reader.pull("m", into=into).version == 1
            time.sleep(0.03)
        resolving = len(sent)
        time.sleep(1.0)
        assert resolving <= 1, sent  # one at most, should a pull take a whole period on a busy machine
        assert len(sent) >= resolving + 2  # idle: heartbeats again
        assert server.state.agents[reader.agent_id].expires_at > time.monotonic()
        assert torch.equal(into["w"], torch.arange(1024, dtype=torch.float32))


def test_the_servers_holder_ranking_is_the_planners():
    """``State.sources`` ranks holders without the planner's per-holder key (a
    resolve's hot path); it must choose exactly what ``planner.best_holders`` does."""
    import random

    from tensorhub.manifest import Manifest, TensorSpec
    from tensorhub.planner import Source, best_holders
    from tensorhub.regions import Region
    from tensorhub.server.config import ServerConfig
    from tensorhub.server.state import State
    from tensorhub.topology import Labels, Reliability

    rng = random.Random(7)
    manifest = Manifest((TensorSpec("w", "float32", (8, 4), 128),))
    state = State(ServerConfig(max_sources=5))
    labels = [Labels(host=f"h{rng.randrange(6)}", rack=f"r{rng.randrange(3)}", zone=f"z{rng.randrange(2)}")
              for _ in range(60)]
    for i, lab in enumerate(labels):
        state.register_agent(f"agent-{i}", f"n{i}", lab, rng.choice(list(Reliability)))
    for i in range(40):  # whole holders and row halves, some filling, some origins, ids of several lengths
        held = [(0, Region())] if i % 3 else [(0, Region(box=((4 * (i % 2), 4 * (i % 2) + 4), (0, 4))))]
        state.publish(agent_id=f"agent-{i}", replica_id=f"agent-{i}.{'x' * (i % 4)}", model="m", version=1,
                      manifest=manifest, held=held, chunk_size=4096, memory=None, complete=i % 5 != 0,
                      bitmap=b"", origin=i % 7 == 0)
    entry = state.models["m"][1]

    def check() -> None:
        for i in range(40, 60):
            reader = f"agent-{i}"
            live = [r for r in entry.replicas.values()
                    if r.agent_id != reader and not r.withdrawn and r.agent_id in state.agents]
            sources = [Source(r.replica_id, r.agent_id, state.agents[r.agent_id].labels,
                              state.agents[r.agent_id].reliability, r.complete, r.origin, len(r.leases), r.agent_id)
                       for r in live]
            by_id = {r.replica_id: r for r in live}

            def covers(complete: list[Source], by_id: dict = by_id) -> bool:
                return bool(complete) and state._covers(entry, [by_id[s.replica_id] for s in complete])

            me = state.agents[reader].labels
            want = best_holders(sources, me, 5, salt=reader, covers=covers)
            assert [r.replica_id for r in state.sources(entry, reader)] == [s.replica_id for s in want]

    for i in range(40, 60):  # readers, each with a lease on a few holders
        state.acquire_lease(f"agent-{i}", rng.sample(list(entry.replicas), 3))
    check()
    # Each reader's ranking is kept between resolves: what changes must show.
    for i in range(40, 60):  # reads in flight
        state.acquire_lease(f"agent-{i}", rng.sample(list(entry.replicas), 5))
    check()
    state.withdraw("agent-1", "agent-1.x")  # a holder withdrawn
    state.register_agent("agent-2", "n2", Labels(host="elsewhere"), Reliability.SPOT)  # new labels
    state.register_agent("agent-41", "n41", labels[3], Reliability.RELIABLE)  # a reader moved
    check()
    state.expire(now=time.monotonic() + 1e6)  # everybody gone: nothing left to rank
    assert state.sources(entry, "agent-50") == []


def test_the_steady_bench_sends_one_resolve_per_engine_and_no_holder_twice():
    from tensorhub.bench import server_steady

    out = server_steady.run(server_steady.SteadyConfig(readers=16, group=8, holders=4, tensors=8, versions=3,
                                                       pin=False))
    assert out["shared"] and out["resolves_per_version"] == 2
    assert [v["holders_full"] for v in out["versions"]] == [4 * 2, 0, 0]  # every holder whole once per engine
    assert out["steady_answer_bytes_max"] < 4096
