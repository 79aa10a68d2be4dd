"""`tensorhub bench vllm --tp N` runs end to end on a small model and writes its JSON:
one row per worker (bytes pulled against the checkpoint, pull and apply seconds)
and vLLM's own reload from the local file, measured in the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_vllm_writes_json(tmp_path):
    out = tmp_path / "vllm.json"
    tp = 2 if len(os.sched_getaffinity(0)) >= 2 else 1
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    subprocess.run([sys.executable, "-m", "tensorhub.cli", "bench", "vllm", "--hidden", "128", "--layers", "2",
                    "--vocab", "512", "--reps", "2", "--tp", str(tp), "--json", str(out)], check=True, env=env,
                   timeout=300, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())["results"]
    workers = [r for r in rows if r["method"] == "tensorhub"]
    assert [r["rank"] for r in workers] == list(range(tp))
    for r in workers:
        assert r["seconds"] > 0 and r["pull_seconds"] > 0 and r["apply_seconds"] > 0
        assert 0 < r["pulled_bytes"] <= (0.6 if tp == 2 else 1.0) * r["checkpoint_bytes"]
        # The third update from the same trainer memory is answered with the holders named (a worker that
        # read its sibling's replicated tensors named it too: left out, not waited for); ranked here means
        # the server waited named_wait_s first.
        assert len(r["named"]) == 2 and r["named"][-1], (r["named"], r["bytes_by_source"])
    assert {r["method"] for r in rows} == {"tensorhub", "tensorhub-update", "disk-reload"}
    assert all(r["seconds"] > 0 for r in rows)
