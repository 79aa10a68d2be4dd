"""``tensorhub bench rl``: the recipes compose, the draws are the same for every
method, the metrics are what the docs say, and a short real run (real
processes, gloo, NIXL, a reference server; one host, no link caps) writes the
documented JSON, table and plot. Timings are the benchmark's business, not
asserted here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tensorhub.bench.rl import metrics
from tensorhub.bench.rl.config import RLBenchConfig, compose
from tensorhub.bench.rl.schedule import draw

ROW_KEYS = {"scenario", "method", "total_stall_s", "rollout_stall_s", "trainer_stall_s", "stall_per_step_s",
            "rollout_stall_per_step_s", "steps_s", "batches", "mean_staleness", "bytes_received",
            "bytes_from_trainer", "bytes_from_rollouts", "retries", "trainer_egress_bytes", "zone_link_bytes",
            "timeline", "params"}


def test_recipes_compose_with_command_line_overrides():
    cfg = compose(["scenario=crossdc", "rollouts=8", "size=32MiB"])
    assert (cfg.scenario, cfg.rollouts, cfg.size, cfg.zone_link) == ("crossdc", 8, 32 << 20, "100mbit")
    assert cfg.methods == ["broadcast", "tensorhub"] and cfg.metric == "rollout_stall_s"
    elastic = compose(["scenario=elastic"])
    assert elastic.methods == ["p2p", "tensorhub"] and elastic.spot >= elastic.wave >= 1
    assert compose([]).scenario == "standalone"


@pytest.mark.parametrize("overrides, message", [
    (["scenario=elastic", "methods=[broadcast]"], "runs methods"),
    (["scenario=crossdc", "hosts=local"], "needs emulated hosts"),
    (["rollouts=0"], "rollouts"),
    (["scenario=elastic", "spot=1", "wave=2"], "spot"),
])
def test_bad_settings_are_refused_with_the_reason(overrides, message):
    with pytest.raises(ValueError, match=message):
        compose(overrides)


def test_overrides_may_sit_anywhere_among_the_flags():
    from tensorhub.cli import parse_args

    args = parse_args(["bench", "rl", "scenario=elastic", "--no-live", "rollouts=3", "--out", "/tmp/x", "size=8MiB"])
    assert args.overrides == ["scenario=elastic", "rollouts=3", "size=8MiB"] and args.out == "/tmp/x"
    for wrong in (["bench", "rl", "--bogus"], ["bench", "pull", "rollouts=3"], ["bench", "rl", "-x=1"]):
        with pytest.raises(SystemExit):
            parse_args(wrong)


def test_unknown_keys_name_the_known_ones():
    with pytest.raises(ValueError, match="known: .*rollouts"):
        RLBenchConfig.from_dict({"rolouts": 4})


def test_every_method_gets_the_same_draws_and_preemptions_land_within_the_run():
    cfg = compose(["scenario=elastic", "seed=7"])
    a, b = draw(cfg), draw(cfg)
    assert a == b and draw(compose(["scenario=elastic", "seed=8"])) != a
    gens = [g for slot in a.gen_s for g in slot[:50]]
    assert max(gens) > 3 * cfg.gen_median_s > min(gens)  # a heavy tail: stragglers
    assert len(a.preemptions) == cfg.waves
    for p in a.preemptions:
        assert len(p.slots) == cfg.wave and all(s < cfg.spot for s in p.slots)
        assert 0 < p.at_s < cfg.steps * cfg.step_s
    assert draw(compose([])).preemptions == ()


def _ev(who, kind, start, end=None, **kw):
    return {"who": who, "kind": kind, "start": start, "end": start if end is None else end, **kw}


def test_metrics_attribute_stalls_to_steps_and_take_the_median():
    events = [_ev("driver", "go", 0.0),
              _ev("trainer", "compute", 0.0, 2.0, version=1), _ev("trainer", "stall", 2.0, 3.0, version=1),
              _ev("trainer", "publish", 3.0, version=1),
              _ev("trainer", "compute", 3.0, 5.0, version=2), _ev("trainer", "stall", 5.0, 5.5, version=2),
              _ev("trainer", "publish", 5.5, version=2),
              _ev("trainer", "compute", 5.5, 7.5, version=3), _ev("trainer", "stall", 7.5, 7.6, version=3),
              _ev("r0", "generate", 0.0, 1.0, version=0), _ev("r0", "stall", 1.0, 3.0, what="update", version=1,
                                                              bytes=10, sources={"trainer": 10}),
              _ev("r0", "generate", 3.0, 6.0, version=1),
              _ev("r0", "stall", 6.0, 6.5, what="update", version=2, bytes=10, sources={"r1": 10}),
              _ev("r1", "stall", 3.5, 4.5, what="join", version=1, bytes=10, sources={"trainer": 10}),
              _ev("r1", "hold", 4.5, version=1), _ev("r1", "generate", 5.6, 6.0, version=1)]
    row = metrics.summarize("elastic", "tensorhub", events, {"k": 1})
    assert set(row) >= ROW_KEYS | {"update_s", "joins", "join_update_s", "join_versions_behind"}
    assert row["stall_per_step_s"] == [3.0, 1.5, 0.6]  # step 1: 1 + 2; step 2: 0.5 + 1; step 3: 0.1 + 0.5
    assert row["rollout_stall_per_step_s"] == [2.0, 1.0, 0.5]
    assert row["total_stall_s"] == 1.5 and row["rollout_stall_s"] == 1.0 and row["trainer_stall_s"] == 0.5
    assert row["update_s"] == 1.0 and row["joins"] == 1 and row["update_s_running"] == 1.25
    assert row["join_versions_behind"] == [0]  # r1 held version 1 at 4.5; version 2 came at 5.5
    assert (row["bytes_from_trainer"], row["bytes_from_rollouts"]) == (20, 10)
    # r1's batch at 5.6 ran on version 1 while version 2 was out: one of three batches one version behind
    assert row["batches"] == 3 and row["mean_staleness"] == 0.33
    assert row["timeline"]["r1"] == [(4.5, 1)]
    other = dict(row, method="p2p", update_s=4.0)
    assert metrics.ratio([other, row], "update_s", "p2p") == 4.0
    assert metrics.ratio([row], "update_s", "p2p") is None


@pytest.mark.timeout(240)
def test_a_short_standalone_run_writes_the_documented_json_table_and_plot(tmp_path):
    out = tmp_path / "rl"
    json_copy = tmp_path / "copy.json"
    proc = subprocess.run([sys.executable, "-m", "tensorhub.cli", "bench", "rl", "--no-live", "--hosts", "local",
                           "--readers", "2", "--size", "4MiB", "--json", str(json_copy), "steps=2", "step_s=0.3",
                           "gen_median_s=0.3", f"out={out}"],
                          capture_output=True, text=True, timeout=220, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "rl-standalone.json").read_text())
    assert json.loads(json_copy.read_text()) == doc
    assert doc["metric"] == "total_stall_s" and doc["baseline"] == "broadcast"
    rows = {r["method"]: r for r in doc["results"]}
    assert set(rows) == {"broadcast", "tensorhub"}
    for method, row in rows.items():
        assert set(row) >= ROW_KEYS, method
        assert row["scenario"] == "standalone" and row["params"]["rollouts"] == 2
        assert len(row["stall_per_step_s"]) == 2 and row["total_stall_s"] > 0
        assert row["batches"] >= 2 and set(row["timeline"]) == {"trainer", "r0", "r1"}
        assert max(v for _, v in row["timeline"]["trainer"]) == 2  # both versions published
    assert rows["broadcast"]["batches"] == 4  # one batch per rollout per step: the group moves together
    assert rows["tensorhub"]["bytes_from_trainer"] + rows["tensorhub"]["bytes_from_rollouts"] > 0
    assert "| `tensorhub` |" in (out / "rl-standalone.md").read_text()
    assert (out / "rl-standalone.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "less total_stall_s than broadcast" in proc.stdout
