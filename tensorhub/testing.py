"""Helpers for tests of TensorHub and of code built on it: a fake control
plane's leases, waits on a transfer and on a pull's progress, and (from
``tensorhub.local``, where the benchmarks and the demo take them) deterministic
state dicts, a Hub in a separate OS process driven over a pipe, and a reference
server in a separate process that can be killed and restarted.

Everything here runs real processes, real NIXL and a real gRPC server.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tensorhub.local.hubprocess import HubProcess, RemoteError
from tensorhub.local.ports import free_port, rendezvous
from tensorhub.local.seeded import (
    Spec,
    cuts,
    empty_like_specs,
    make_tensors,
    mixed_specs,
    read_region,
    shard_region,
    stepped_tensors,
    take,
)
from tensorhub.local.serverprocess import ServerProcess

__all__ = ["GrantingLeases", "HubProcess", "RemoteError", "ServerProcess", "Spec", "ask_ranks", "cuts",
           "empty_like_specs", "finish_transfer", "free_port", "join_group", "make_tensors", "mixed_specs", "rank_result",
           "read_region", "rendezvous", "shard_region", "stepped_tensors", "take", "wait_for_progress"]


class GrantingLeases:
    """The lease side of a fake control plane for ``PullJob`` tests: every
    lease is granted, for a minute, and nothing may be reported lost (in
    those tests nothing fails). A fake adds its own ``resolve``."""

    def acquire_lease(self, agent_id: str, replica_ids: list[str]) -> tuple[str, list[str], float]:
        return "lease", list(replica_ids), 60.0

    def renew_lease(self, agent_id: str, lease_id: str) -> float:
        return 60.0

    def release_lease_async(self, agent_id: str, lease_id: str) -> None:
        pass  # nothing to hold: every lease was granted

    def report_lost(self, agent_id: str, replica_id: str, reason: str, *, stalled: bool = False) -> bool:
        raise AssertionError(f"nothing failed, yet {replica_id} was reported lost: {reason}")


def finish_transfer(agent: Any, pending: Any, timeout_s: float = 10.0) -> None:
    """Poll a posted transfer (NixlAgent.post) until it ends, then release it;
    TransferFailed as poll raises it, AssertionError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    try:
        while not agent.poll(pending):
            assert time.monotonic() < deadline, f"transfer did not finish in {timeout_s} s"
            time.sleep(0.001)
    finally:
        agent.release(pending)


def rank_result(proc: Any) -> str:
    """The next ``result <text>`` line of a trainer-rank script driven over its
    stdin and stdout (``subprocess.Popen(..., text=True)``); AssertionError
    with its exit code if it ends first."""
    for line in proc.stdout:
        if line.startswith("result "):
            return line.removeprefix("result ").strip()
    raise AssertionError(f"trainer rank exited with {proc.wait(timeout=30)}")


def ask_ranks(ranks: Sequence[Any], line: str) -> list[Any]:
    """Send ``line`` to every rank script (all of them first: the ranks meet in
    collectives), then read each one's result as JSON, in rank order."""
    for proc in ranks:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    return [json.loads(rank_result(proc)) for proc in ranks]


def join_group(procs: Sequence[HubProcess]) -> list[HubProcess]:
    """Put the hub processes ``procs`` in one gloo process group (rank = their
    order), as a trainer's ranks or an engine's workers are; returns them."""
    with rendezvous(len(procs)) as env:
        for rank, proc in enumerate(procs):
            proc.send("init_group", rank=rank, world=len(procs), env=env)
        for proc in procs:
            proc.result()
    return list(procs)


def wait_for_progress(path: str, *, at_least: int = 1, timeout: float = 60.0) -> int:
    """Wait until a pull started with ``progress_file=path`` has landed bytes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done = int(Path(path).read_text() or 0)
        except (FileNotFoundError, ValueError):
            done = 0
        if done >= at_least:
            return done
        time.sleep(0.01)
    raise TimeoutError(f"the pull reported no progress within {timeout} s")


def peft_fsdp2_model(model_dir: str, world: int, rank: int = 8):  # type: ignore[no-untyped-def]
    """A Hugging Face causal LM from ``model_dir`` (bf16) wrapped by PEFT with
    an all-linear LoRA of ``rank`` (alpha 16), each decoder layer and the whole
    under FSDP2 over a CPU mesh of ``world``: a trainer's LoRA model as verl and
    vLLM's FSDP trainers build it. Needs the process group initialized."""
    import torch
    from peft import LoraConfig, TaskType, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(task_type=TaskType.CAUSAL_LM, r=rank, lora_alpha=16,
                                            target_modules="all-linear", bias="none"))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
