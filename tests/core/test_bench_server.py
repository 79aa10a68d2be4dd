"""``tensorhub bench server`` end to end, small: a real server process, real
load generator processes, every figure present in the JSON."""

from __future__ import annotations

import json

import pytest

from tensorhub.bench.server import ServerBenchConfig, run
from tensorhub.cli import main as cli_main


def test_bench_server_reports_latency_and_memory(tmp_path):
    out = tmp_path / "server.json"
    report = run(ServerBenchConfig(sweep=(12,), holders=3, tensors=8, seconds=2.0, generators=1, agents=12),
                 json_path=str(out))
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    [step] = report["steps"]
    assert step["agents"] == 12 and step["errors"] == 0, step["extra"]["first_errors"]
    assert step["resolves"] > 0 and step["heartbeats"] > 0
    assert step["holders_per_answer"] == 3  # every holder, the reader never among them
    assert 0 < step["resolve_ms"]["p50"] <= step["resolve_ms"]["p99"] <= step["resolve_ms"]["max"]
    assert step["server_rss_mb"] > 0 and step["bytes_per_replica"] >= 0
    # Where the CPU went: the server, and the load generators that share the machine with it.
    assert step["server_cpu"] > 0 and step["generator_cpu"] > 0 and step["server_us_per_call"] > 0
    assert "p99_passes_goal_at_agents" in report


def test_bench_server_refuses_bad_settings(capsys):
    assert cli_main(["bench", "server", "--seconds", "0.5"]) == 2
    assert "warm-up" in capsys.readouterr().err
    assert cli_main(["bench", "server", "--heartbeat-interval", "0"]) == 2
    assert "intervals positive" in capsys.readouterr().err
    with pytest.raises(ValueError, match="holders"):
        ServerBenchConfig(holders=0)
