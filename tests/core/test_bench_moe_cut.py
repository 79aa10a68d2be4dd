"""``tensorhub bench pull --layout moe --reader-slice tp8 --trainer-cut`` at a
tiny size (4 experts): its rows exist, the reader read exactly its slice's
bytes from the trainer ranks' cut, and the raw row read the same bytes."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_pull_moe_trainer_cut_reads_exactly_the_slice_beside_a_raw_contiguous_read(tmp_path):
    out = tmp_path / "cut.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tensorhub.cli", "bench", "pull", "--layout", "moe", "--reader-slice", "tp8",
         "--trainer-cut", "--experts", "4", "--reps", "1", "--chunk-size", "4MiB", "--json", str(out)],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    rows = {r["method"]: r for r in data["results"]}
    assert set(rows) == {"tensorhub-cut", "nixl-raw-cut"} and data["trainer_cut"] is True
    wanted = 4 * (2 * 96 * 2048 + 2048 * 96) * 2  # rows of gate and up, columns of down, bf16
    assert all(r["bytes"] == r["requested_bytes"] == r["read_bytes"] == wanted for r in rows.values())
    # The reader read the cut: exactly its bytes, from the two ranks, a few descriptors (not a run per row).
    th = rows["tensorhub-cut"]
    assert set(th["sources"]) == {"rank-0", "rank-1"} and sum(th["sources"].values()) == wanted
    assert th["descriptors"] < 100
    assert rows["nixl-raw-cut"]["descriptors"] == 2
    # The cut holds the slice once, half on each rank, from version 1's relay.
    assert sum(data["cut_bytes"]) == wanted and min(data["cut_bytes"]) > 0 and data["cut_from_version"] == 1
    assert data["cut_seconds"] > 0 and all(0 < b <= 1 << 30 for b in data["cut_peak_gather_bytes"])
    assert data["raw_vs_tensorhub"] > 0
    assert "tensorhub-cut vs a raw contiguous READ" in proc.stdout and "trainer rank 1: cut" in proc.stdout
