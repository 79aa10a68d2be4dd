"""The committed gRPC stubs, the command line, the demo and the benchmark's output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import grpc

from tensorhub.proto import tensorhub_pb2 as pb
from tensorhub.proto import tensorhub_pb2_grpc as pb_grpc
from tensorhub.testing import ServerProcess

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_up_to_date(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "tensorhub/proto/regenerate.py"), str(tmp_path)], check=True,
                   capture_output=True)
    for generated in sorted((tmp_path / "tensorhub/proto").iterdir()):
        committed = ROOT / "tensorhub/proto" / generated.name
        assert committed.read_text() == generated.read_text(), (
            f"{committed.name} is stale: run `python tensorhub/proto/regenerate.py` and commit the result")


def test_server_command_serves_on_the_given_port():
    with ServerProcess() as server, grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.ReferenceServiceStub(channel)
        reply = stub.RegisterAgent(pb.RegisterAgentRequest(agent_id="probe", name="probe"), timeout=10)
        assert len(reply.instance_id) == 32 and reply.lease_ttl_s == 10.0


def test_bench_pull_writes_rows_for_both_methods(tmp_path):
    out = tmp_path / "pull.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tensorhub.cli", "bench", "pull", "--size", "16MiB", "--reps", "1",
         "--chunk-size", "4MiB", "--json", str(out)],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["results"]
    methods = {(r["method"], r["bytes"]) for r in rows}
    assert methods == {("nixl-raw", 16 << 20), ("tensorhub", 16 << 20), ("tensorhub-unchecked", 16 << 20),
                       ("nixl-raw-pieces", 16 << 20), ("nixl-raw-pieces-crc", 16 << 20), ("tensorhub", 4096)}
    for row in rows:
        assert set(row) >= {"method", "readers", "bytes", "seconds", "gbps"} and row["seconds"] > 0
        if row["bytes"] != 4096:  # read, not just requested: nothing was read twice
            assert row["most_read_bytes"] == 16 << 20, row
    assert "tensorhub / nixl-raw throughput" in proc.stdout
    assert "chunk checksums cost" in proc.stdout  # the tensorhub-unchecked row's purpose
    assert "whoever does it" in proc.stdout  # and the raw-pieces rows': the floor under that cost


def test_bench_pull_fp8_reads_half_the_bytes_of_the_bf16_pull(tmp_path):
    out = tmp_path / "fp8.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tensorhub.cli", "bench", "pull", "--fp8", "--size", "16MiB", "--reps", "1",
         "--chunk-size", "4MiB", "--json", str(out)],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    read = {r["method"]: r["read_bytes_per_reader"] for r in report["results"]}
    assert read["bf16"] == 16 << 20 and 0.49 < read["fp8"] / read["bf16"] <= 0.55, read  # both checked bit for bit
    assert report["quantize_s"] > 0 and report["companion_bytes"] == read["fp8"]
    assert "goal <= 0.55" in proc.stdout and "the trainer's quantization" in proc.stdout


def test_bench_pull_from_shard_holders_reads_only_the_tp_slice(tmp_path):
    out = tmp_path / "pull.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tensorhub.cli", "bench", "pull", "--size", "16MiB", "--reps", "1", "--publishers", "2",
         "--reader-slice", "tp2", "--chunk-size", "4MiB", "--json", str(out)],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["publishers"] == 2 and data["reader_slice"] == "tp2"
    big = [r for r in data["results"] if r["bytes"] != 4096]
    assert {r["method"] for r in big} == {"nixl-raw", "tensorhub", "tensorhub-unchecked", "nixl-raw-pieces",
                                          "nixl-raw-pieces-crc"}
    for row in big:
        assert row["publishers"] == 2 and row["requested_bytes"] == row["bytes"]
        assert 0.4 * (16 << 20) < row["requested_bytes"] <= 0.55 * (16 << 20)
        if row["method"].startswith("nixl-raw"):
            assert row["most_read_bytes"] == row["requested_bytes"]
        else:  # short column runs may go as whole rows (HubConfig.read_cost), never more than the model
            assert row["requested_bytes"] <= row["most_read_bytes"] <= 16 << 20
    assert "bytes read / model bytes" in proc.stdout and "bytes asked / model bytes" in proc.stdout


def test_bench_pull_moe_rows_read_the_tp8_slice_wide_beside_raw_nixl(tmp_path):
    out = tmp_path / "moe.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tensorhub.cli", "bench", "pull", "--layout", "moe", "--reader-slice", "tp8",
         "--experts", "4", "--reps", "1", "--chunk-size", "4MiB", "--versions", "3", "--json", str(out)],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    rows = {r["method"]: r for r in data["results"]}
    versions = {m: rows.pop(m) for m in ("tensorhub-first-version", "tensorhub-replayed")}
    assert set(rows) == {"tensorhub", "tensorhub-exact", "nixl-raw-exact", "nixl-raw-rows", "memcpy"}
    # Versions 3 and 4 replayed (the bench refuses otherwise); the 4th answered with the holders the 3rd
    # read from, named, and it asks nobody else mid-pull.
    assert versions["tensorhub-replayed"]["named"] == [False, True], versions
    assert versions["tensorhub-replayed"]["refreshes"][-1] == 0, versions
    wanted = 4 * (2 * 96 * 2048 + 2048 * 96) * 2  # rows of gate and up, columns of down, bf16
    runs = 4 * (2 + 2048)
    assert all(r["bytes"] == r["requested_bytes"] == wanted and r["runs"] == runs for r in rows.values())
    assert rows["nixl-raw-exact"]["descriptors"] == runs
    assert rows["tensorhub-exact"]["read_bytes"] == wanted and rows["tensorhub-exact"]["descriptors"] >= runs
    assert rows["tensorhub"]["read_bytes"] > 2 * wanted and rows["tensorhub"]["descriptors"] < runs // 100
    assert rows["nixl-raw-rows"]["read_bytes"] > 2 * wanted
    assert {"vs_cheaper_raw", "memcpy_fraction", "measured_per_descriptor_s"} <= set(data)
    assert "tensorhub / the cheaper raw row" in proc.stdout and "link cost measured here" in proc.stdout


def test_demo_trainer_ranks_publish_shards_and_every_pull_is_verified():
    proc = subprocess.run(
        [sys.executable, "-m", "tensorhub.cli", "demo", "--size", "8MiB", "--versions", "2"],
        check=False, capture_output=True, text=True, timeout=400,
        env={**os.environ, "COLUMNS": "200"},  # wide enough that no table row wraps
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for version in (1, 2):
        for rank in (0, 1):
            assert re.search(rf"trainer-{rank} published its [0-9.]+ MiB of version {version}", out), out
    # The final table: version, reader, MiB requested, seconds, GB/s, MiB per source.
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    assert [(r[0], r[1]) for r in rows] == [(v, reader) for v in ("1", "2")
                                            for reader in ("rollout-1 (TP 0/2)", "rollout-0 (whole)")]
    for row in rows:
        mib = float(row[2])
        assert 3.9 < mib < 4.1 if "TP" in row[1] else mib == 8.0
        sources = set(re.findall(r"(trainer-\d|rollout-\d) ", row[5]))
        # The TP slice: rows from one trainer rank, columns from both; the
        # whole-tensor rollout: the slice from rollout-1, the rest from both ranks.
        assert sources == ({"trainer-0", "trainer-1"} if "TP" in row[1] else {"trainer-0", "trainer-1", "rollout-1"})
    assert "all 2 versions verified: every byte of 4 pulls matched" in out
