"""verl's own weight-update flow on CPU with the ``tensorhub`` backend.

A trainer worker group (FSDP2, 2 ranks) and rollout worker groups (1 rank per
replica) run as Ray actors; ``CheckpointEngineManager.update_weights(step)``
moves the weights, through a real reference server and real NIXL. Between
steps the trainer's weights change, and every rollout must hold exactly the
trainer's bytes. Replica B leaves for steps 3-4 and comes back; replica C
starts at step 5. Run by tests/verl/test_verl_manager_flow.py in its own
process (Ray, the platform and the process groups are process-wide):

    python tests/verl/verl_ray_flow.py MODEL_DIR REPORT_JSON

Writes a JSON report; exits non-zero if a check failed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import ray
import torch
from tests.checkpoint_engine.test_utils import MockReplica
from verl.checkpoint_engine import CheckpointEngineManager
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import split_resource_pool
from verl.workers.config import (
    CheckpointEngineConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
    RolloutConfig,
)
from verl.workers.engine_workers import TrainingWorkerConfig
from verl_flow_workers import RolloutWorker, TrainerWorker

from tensorhub.server import EmbeddedServer

NUM_TRAINERS = 2


def trainer_group(pool: RayResourcePool, model: HFModelConfig, engine: CheckpointEngineConfig) -> RayWorkerGroup:
    config = TrainingWorkerConfig(
        model_type="language_model", model_config=model,
        # Not forward_only: verl then offloads with pinned memory, which needs an accelerator.
        engine_config=FSDPEngineConfig(forward_only=False, fsdp_size=pool.world_size, strategy="fsdp2"),
        optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=10),
    )
    cls = RayClassWithInitArgs(cls=ray.remote(TrainerWorker), config=config, checkpoint_engine_config=engine)
    return RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cpu")


async def rollout_group(pool: RayResourcePool, model: HFModelConfig,
                        rollout: RolloutConfig) -> tuple[RayWorkerGroup, list[MockReplica]]:
    cls = RayClassWithInitArgs(cls=ray.remote(RolloutWorker), model_config=model, rollout_config=rollout,
                               check_allclose=True)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cpu")
    replicas = [MockReplica(replica_rank=i, config=rollout, model_config=model) for i in range(group.world_size)]
    await asyncio.gather(*[replica.init_hybrid(group) for replica in replicas])
    group.take_received()  # waits until the actors are up, so step timings show the transfer only
    return group, replicas


def check_received(label: str, taken: list[tuple[int | None, dict]], step: int,
                   expected: dict[str, torch.Tensor]) -> None:
    """``taken``: each rollout worker's (version, tensors) received since the last look."""
    for rank, (version, received) in enumerate(taken):
        where = f"rollout {label}{rank} at step {step}"
        assert version == step, f"{where}: received version {version}"
        assert list(received) == list(expected), f"{where}: names {sorted(set(received) ^ set(expected))} differ"
        for name, want in expected.items():
            got = received[name]
            assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{where}: {name} {got.dtype}{tuple(got.shape)}"
            same = torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
            assert same, f"{where}: {name} bytes differ"


async def main(model_path: str) -> dict:
    server = EmbeddedServer()
    engine = CheckpointEngineConfig(
        backend="tensorhub", update_weights_bucket_megabytes=16, custom_backend_module="tensorhub_verl.engine",
        engine_kwargs={"tensorhub": {"address": server.address, "model": "tiny/policy", "wait_timeout_s": 60.0,
                                     "hub": {"chunk_size": 1 << 16}}},
    )
    model = HFModelConfig(path=model_path, override_config={"attn_implementation": "sdpa"})
    rollout = RolloutConfig(name="vllm", tensor_model_parallel_size=1, checkpoint_engine=engine)  # default TP is 2

    pool = RayResourcePool(process_on_nodes=[NUM_TRAINERS + 2], use_gpu=False, max_colocate_count=1)
    trainer_pool, rollout_pool = split_resource_pool(pool, [NUM_TRAINERS, 2])
    trainer = trainer_group(trainer_pool, model, engine)
    trainer.reset()
    group_ab, (replica_a, replica_b) = await rollout_group(rollout_pool, model, rollout)
    manager = CheckpointEngineManager(config=engine, actor_wg=trainer, replicas=[replica_a, replica_b])

    report: dict = {"steps": {}}
    late = None
    for step in range(1, 6):
        if step == 3:
            manager.remove_replicas([replica_b])  # B misses steps 3 and 4
        if step == 5:
            late = await rollout_group(RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1),
                                       model, rollout)
            manager.add_replicas([replica_b, *late[1]])  # B comes back, C starts late: no group to rebuild
        trainer.perturb(step)
        expected = trainer.full_state()[0]
        start = time.perf_counter()
        metrics = await manager.update_weights(global_steps=step)
        seconds = time.perf_counter() - start
        assert metrics.get("tensorhub/version") == step, f"step {step}: manager returned metrics {metrics}"
        taken = group_ab.take_received()
        if step in (3, 4):
            check_received("A", taken[:1], step, expected)
            assert taken[1] == (2, {}), f"replica B was removed but received version {taken[1][0]}"
        else:
            check_received("AB", taken, step, expected)
        if late is not None:
            check_received("C", late[0].take_received(), step, expected)
        report["steps"][step] = {"seconds": round(seconds, 3),
                                 "blocked_s": round(metrics["tensorhub/unpublish_blocked_s"], 4),
                                 "mb": round(metrics["tensorhub/published_mb"], 3),
                                 "allocations": metrics["tensorhub/buffer_allocations"]}
    report["tensors"] = len(expected)
    report["ok"] = True
    return report


if __name__ == "__main__":
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=True)
    try:
        report = asyncio.run(main(sys.argv[1]))
        with open(sys.argv[2], "w") as f:
            json.dump(report, f)
    finally:
        ray.shutdown()
