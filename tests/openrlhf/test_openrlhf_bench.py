"""The benchmark runs end to end on a small model (its figures are in
docs/integrations/openrlhf.md): real ZeRO-3 ranks, each sending its half."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_runs_and_each_rank_sends_its_partition(tmp_path):
    out = tmp_path / "openrlhf.json"
    command = [sys.executable, "-m", "tensorhub_openrlhf.bench", "--ranks", "2", "--hidden", "64", "--layers", "1",
               "--vocab", "256", "--reps", "1", "--json", str(out)]
    try:  # the bench gives up on a silent rank after 120 s a step, well within this
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=420)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the bench hung; its stderr ended: {(e.stderr or b'')[-3000:]!r}") from None
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    methods = {r["method"] for r in result["results"]}
    assert methods == {"tensorhub sync (publish + pull)", "tensorhub publish (slowest rank)",
                       "openrlhf gather (trainer side only)"}
    model_bytes = result["results"][0]["bytes"]
    sent = result["bytes_sent_by_rank"]
    assert len(sent) == 2 and sum(sent) == model_bytes and max(sent) - min(sent) < 0.02 * model_bytes
