"""verl's ``CheckpointEngineManager.update_weights()`` on CPU with the
``tensorhub`` backend: Ray actors for a 2-rank FSDP2 trainer and rollout
replicas, the reference server started by ``address: auto`` as a Ray actor,
real NIXL. See verl_ray_flow.py for the steps and the checks (byte-identical
every step; each trainer rank registers half the model; the trainer group
killed and restarted keeps the server and its versions; a replica that leaves
and comes back, and one that starts late, get the newest version), on a tiny
dense model and on a tiny Mixture-of-Experts model."""

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


def tiny_moe_model(path: str) -> str:
    """The vLLM suite's tiny Qwen3-MoE (8 experts): verl's FSDP2 engine holds its
    experts fused (transformers 5) and unfuses them into per-expert names in
    the stream it hands the checkpoint engine (``unfuse_moe_params``). Two steps
    of the flow: the restart and the late replica do not depend on the model."""
    sys.path.insert(0, str(HERE.parent / "vllm"))
    from vllm_tiny_model import build_moe

    return str(build_moe(Path(path)))


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("build", "n_steps"), [(save_tiny_model, 5), (tiny_moe_model, 2)], ids=["dense", "moe"])
def test_manager_flow_on_cpu(tmp_path, build, n_steps):
    model = build(str(tmp_path / "tiny-model"))
    pythonpath = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **CPU_ENV, "PYTHONPATH": pythonpath}
    report_path = tmp_path / "report.json"
    for _ in range(2):
        returncode, stdout, stderr = run_in_own_session(
            [sys.executable, str(HERE / "verl_ray_flow.py"), model, str(report_path), str(n_steps)], env=env,
            cwd=tmp_path)
        # verl picks the trainer group's rendezvous port before torch binds it; on a
        # busy machine another process can take it in between. Only that is retried.
        if "EADDRINUSE" not in stderr:
            break
    assert returncode == 0, f"verl flow failed:\n{stdout[-6000:]}\n{stderr[-6000:]}"
    report = json.loads(report_path.read_text())
    assert report["ok"] and sorted(report["steps"]) == [str(s) for s in range(1, n_steps + 1)]
    if build is tiny_moe_model:  # the checkpoint's per-expert tensors: 2 layers x 8 experts x 3, and 21 others
        assert report["tensors"] == 2 * 8 * 3 + 21, report["tensors"]
    steps = report["steps"]
    print(json.dumps(report, indent=1))  # the figures of the verl row of docs/benchmarks.md (pytest -s)
    # every rank keeps a part of every tensor: its slots are allocated at a trainer's first step ...
    assert all(steps[s]["allocations"] == [report["tensors"]] * 2 for s in "14" if s in steps)
    assert all(steps[s]["allocations"] == [0, 0] for s in "235" if s in steps)  # ... and reused
    for s, step in steps.items():
        assert all(abs(share - 0.5) < 0.05 for share in step["shares"]), (s, step["shares"])
        assert sum(step["published_bytes"]) == step["model_bytes"]  # one copy of the model, split
    # the rollouts' pulls of the step before, in the trainer's metrics
    assert steps["1"]["pulls"] == {}
    for s, workers in (("2", 2), ("3", 2), ("4", 2), ("5", 1))[:n_steps - 1]:
        pulls = steps[s]["pulls"]
        assert (pulls["workers"], pulls["version"]) == (workers, int(s) - 1), (s, pulls)
        assert pulls["mb_mean"] * 2**20 == pytest.approx(steps[s]["model_bytes"]) and pulls["seconds_max"] > 0
