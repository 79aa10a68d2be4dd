"""verl's own weight-update flow on CPU with the ``tensorhub`` backend.

A trainer worker group (FSDP2, 2 ranks) and rollout worker groups (1 rank per
replica) run as Ray actors; ``CheckpointEngineManager.update_weights(step)``
moves the weights through real NIXL. ``address: auto``: the first worker to
start runs the reference server as a named Ray actor, the others find it.
Between steps the trainer's weights change, and every rollout must hold
exactly the trainer's bytes. Each trainer rank registers about half the model
(no buffer the size of the model on any rank). After step 3 the trainer group
is killed and a new one started: same server, version 3 still there (the
rollouts hold it). Replica B leaves for step 4 and comes back; replica C starts
at step 5. Run by tests/verl/test_verl_manager_flow.py in its own process
(Ray, the platform and the process groups are process-wide):

    python tests/verl/verl_ray_flow.py MODEL_DIR REPORT_JSON [STEPS]

STEPS (default 5) stops the flow early: 2 runs two plain updates (each rollout
byte-identical, each rank about half), without the restart and the late replica.

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

from tensorhub import Hub
from tensorhub.server.ray_actor import DEFAULT_NAME, DEFAULT_NAMESPACE, resolve_address

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


def check_registered(step: int, registered: list[dict]) -> list[float]:
    """Each rank holds about 1/n of the model, and no single tensor as large as it."""
    shares = []
    for rank, got in enumerate(registered):
        assert got["version"] == step, f"trainer rank {rank} publishes version {got['version']} at step {step}"
        share = got["nbytes"] / got["model"]
        assert share <= 1 / NUM_TRAINERS + 0.05, f"trainer rank {rank} registered {share:.3f} of the model"
        assert got["largest"] < got["model"] / 2, f"trainer rank {rank} registered a {got['largest']} B buffer"
        shares.append(round(share, 4))
    assert abs(sum(shares) - 1) < 1e-3, f"the trainer ranks' shares {shares} do not add up to one model"
    return shares


def server_identity() -> dict:
    actor = ray.get_actor(DEFAULT_NAME, namespace=DEFAULT_NAMESPACE)
    return ray.get(actor.describe.remote(), timeout=30)


async def main(model_path: str, steps: int = 5) -> dict:
    engine = CheckpointEngineConfig(
        backend="tensorhub", update_weights_bucket_megabytes=16, custom_backend_module="tensorhub_verl.engine",
        # address: auto (the default); port 0: a free port, not 50051, on this shared machine
        engine_kwargs={"tensorhub": {"model": "tiny/policy", "wait_timeout_s": 60.0,
                                     "hub": {"chunk_size": 1 << 16}, "server": {"port": 0}}},
    )
    model = HFModelConfig(path=model_path, override_config={"attn_implementation": "sdpa"})
    rollout = RolloutConfig(name="vllm", tensor_model_parallel_size=1, checkpoint_engine=engine)  # default TP is 2

    pool = RayResourcePool(process_on_nodes=[NUM_TRAINERS + 2], use_gpu=False, max_colocate_count=1)
    trainer_pool, rollout_pool = split_resource_pool(pool, [NUM_TRAINERS, 2])
    trainer = trainer_group(trainer_pool, model, engine)
    trainer.reset()
    group_ab, (replica_a, replica_b) = await rollout_group(rollout_pool, model, rollout)
    manager = CheckpointEngineManager(config=engine, actor_wg=trainer, replicas=[replica_a, replica_b])
    server = server_identity()

    report: dict = {"steps": {}, "server": server["address"]}
    late = None
    for step in range(1, steps + 1):
        if step == 4:
            # The trainer group dies (as a crashed trainer job would) and a new one starts.
            for worker in trainer.workers:
                ray.kill(worker)
            assert server_identity() == server, "the reference server did not outlive the trainer group"
            with Hub.connect(resolve_address("auto"), name="flow-driver") as hub:
                assert hub.versions("tiny/policy") == [3], "the rollouts' copies of step 3 should keep it"
            trainer = trainer_group(trainer_pool, model, engine)
            trainer.reset()
            manager = CheckpointEngineManager(config=engine, actor_wg=trainer, replicas=[replica_a])  # B leaves
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
        if step == 4:
            check_received("A", taken[:1], step, expected)
            assert taken[1] == (3, {}), f"replica B was removed but received version {taken[1][0]}"
        else:
            check_received("AB", taken, step, expected)
        if late is not None:
            check_received("C", late[0].take_received(), step, expected)
        shares = check_registered(step, trainer.registered())
        ranks = range(NUM_TRAINERS)
        report["steps"][step] = {
            "seconds": round(seconds, 3), "shares": shares,
            "published_bytes": [round(metrics[f"tensorhub/rank{r}/published_mb"] * 2**20) for r in ranks],
            "stall_s": [round(metrics[f"tensorhub/rank{r}/stall_s"], 4) for r in ranks],
            "allocations": [metrics[f"tensorhub/rank{r}/buffer_allocations"] for r in ranks],
            "model_bytes": round(metrics["checkpoint_engine/payload_mbytes"] * 2**20),
            "pulls": {k.removeprefix("tensorhub/pull/"): v for k, v in metrics.items()
                      if k.startswith("tensorhub/pull/")},
        }
    assert server_identity() == server
    report["tensors"] = len(expected)
    report["ok"] = True
    return report


if __name__ == "__main__":
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=True)
    try:
        report = asyncio.run(main(sys.argv[1], *(int(a) for a in sys.argv[3:4])))
        with open(sys.argv[2], "w") as f:
            json.dump(report, f)
    finally:
        ray.shutdown()
