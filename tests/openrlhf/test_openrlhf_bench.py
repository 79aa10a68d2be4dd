"""The benchmark runs end to end on a small model (its figures are in
integrations/openrlhf/README.md): real ZeRO-3 ranks, each sending its half."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_runs_and_each_rank_sends_its_partition(tmp_path):
    out = tmp_path / "openrlhf.json"
    done = subprocess.run([sys.executable, "-m", "tensorhub_openrlhf.bench", "--ranks", "2", "--hidden", "64",
                           "--layers", "1", "--vocab", "256", "--reps", "1", "--json", str(out)],
                          check=False, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    methods = {r["method"] for r in result["results"]}
    assert methods == {"tensorhub sync (publish + pull)", "tensorhub publish (slowest rank)",
                       "openrlhf gather (trainer side only)"}
    model_bytes = result["results"][0]["bytes"]
    sent = result["bytes_sent_by_rank"]
    assert len(sent) == 2 and sum(sent) == model_bytes and max(sent) - min(sent) < 0.02 * model_bytes
