"""verl's ``CheckpointEngineManager.update_weights()`` on CPU with the
``tensorhub`` backend: Ray actors for a 2-rank FSDP2 trainer and rollout
replicas, a real reference server, real NIXL. See verl_ray_flow.py for the
steps and the checks (byte-identical every step; a replica that leaves and
comes back, and one that starts late, get the newest version)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from verl_testlib import save_tiny_model

HERE = Path(__file__).resolve().parent

# What verl 0.9.1 needs to run on a machine without an accelerator.
CPU_ENV = {
    "VERL_USE_EXTERNAL_MODULES": "verl_cpu_platform",  # registers the "cpu" platform in every process
    "VERL_PLATFORM": "cpu",
    "VERL_ENGINE_DEVICE": "cuda",  # verl's FSDP engine registers for cuda/npu only; this is verl's own override
    "OMP_NUM_THREADS": "1",
    "RAY_DEDUP_LOGS": "0",
    # Ray starts one idle Python worker per CPU slot; the placement needs 8 slots
    # but this machine has 2 cores, and the actors start their own workers anyway.
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
}


def run_in_own_session(cmd: list[str], timeout: float = 420, **kwargs) -> tuple[int, str, str]:
    """Run ``cmd`` in its own session; on timeout, end it and everything it
    started (Ray's processes) and fail."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"verl flow still running after {timeout:.0f}s:\n{stdout[-4000:]}\n{stderr[-4000:]}")
    return proc.returncode, stdout, stderr


@pytest.mark.timeout(900)
def test_manager_flow_on_cpu(tmp_path):
    model = save_tiny_model(str(tmp_path / "tiny-qwen2"))
    pythonpath = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **CPU_ENV, "PYTHONPATH": pythonpath}
    report_path = tmp_path / "report.json"
    for _ in range(2):
        returncode, stdout, stderr = run_in_own_session(
            [sys.executable, str(HERE / "verl_ray_flow.py"), model, str(report_path)], env=env, cwd=tmp_path)
        # verl picks the trainer group's rendezvous port before torch binds it; on a
        # busy machine another process can take it in between. Only that is retried.
        if "EADDRINUSE" not in stderr:
            break
    assert returncode == 0, f"verl flow failed:\n{stdout[-6000:]}\n{stderr[-6000:]}"
    report = json.loads(report_path.read_text())
    assert report["ok"] and sorted(report["steps"]) == ["1", "2", "3", "4", "5"]
    steps = report["steps"]
    assert steps["1"]["allocations"] == report["tensors"]  # the buffer is allocated once ...
    assert all(steps[s]["allocations"] == 0 for s in "2345")  # ... and reused
