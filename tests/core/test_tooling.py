"""The committed gRPC stubs, the command line, and the benchmark's output."""

from __future__ import annotations

import json
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
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["results"]
    methods = {(r["method"], r["bytes"]) for r in rows}
    assert methods == {("nixl-raw", 16 << 20), ("tensorhub", 16 << 20), ("tensorhub", 4096)}
    for row in rows:
        assert set(row) >= {"method", "readers", "bytes", "seconds", "gbps"} and row["seconds"] > 0
    assert "tensorhub / nixl-raw throughput" in proc.stdout
