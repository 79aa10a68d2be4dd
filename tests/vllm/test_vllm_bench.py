"""`tensorhub bench vllm` runs end to end on a small model and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_vllm_writes_json(tmp_path):
    out = tmp_path / "vllm.json"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    subprocess.run([sys.executable, "-m", "tensorhub.cli", "bench", "vllm", "--hidden", "128", "--layers", "2",
                    "--vocab", "512", "--reps", "1", "--json", str(out)], check=True, env=env, timeout=300,
                   stdout=subprocess.DEVNULL)
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"tensorhub update", "tensorhub pull", "tensorhub apply", "vllm reload from safetensors"}
    assert all(r["seconds"] > 0 and r["bytes"] > 0 for r in rows.values())
