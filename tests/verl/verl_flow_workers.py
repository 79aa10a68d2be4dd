"""Trainer and rollout worker classes for driving verl's own
``CheckpointEngineManager`` on CPU. They extend the classes verl ships for its
checkpoint-engine correctness test (``tests.checkpoint_engine.test_utils``)
with what the test needs to compare bytes: the trainer's full state, what each
rollout received, and a way to change the weights between steps."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from tests.checkpoint_engine.test_utils import CheckpointEngineWorkerTest, TrainingWorkerTest
from verl.single_controller.base.decorator import Dispatch, register


class TrainerWorker(TrainingWorkerTest):
    def __init__(self, *args, **kwargs) -> None:
        # verl would build "cpu:gloo,cpu:gloo", which torch rejects; a plain
        # gloo group first makes verl's own initialisation a no-op.
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        super().__init__(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        # As verl's ActorRolloutRefWorker does: the engine's metrics go back to the manager.
        per_tensor_param, _ = self.engine.get_per_tensor_param()
        return await self.checkpoint_engine.send_weights(per_tensor_param, global_steps=global_steps) or {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def perturb(self, step: int) -> None:
        """Stand-in for an optimizer step: every parameter changes."""
        with torch.no_grad():
            for param in self.engine.module.parameters():
                param.add_(0.25 * step)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def registered(self) -> dict[str, int]:
        """What this rank's engine registered with NIXL for its last step: bytes in
        all, its largest single tensor, and the whole model's bytes."""
        publication = self.checkpoint_engine.publication
        return {"nbytes": publication.nbytes, "largest": max(p.nbytes for p in publication.parts),
                "model": publication.manifest.total_bytes, "version": publication.version}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_state(self) -> dict[str, torch.Tensor]:
        """The full tensors the trainer streams (a collective: every rank calls it)."""
        per_tensor_param, _ = self.engine.get_per_tensor_param()
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in per_tensor_param}


class RolloutWorker(CheckpointEngineWorkerTest):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def take_received(self) -> tuple[int | None, dict[str, torch.Tensor]]:
        """(version received, tensors received) since the last call."""
        received = dict(self.server_adapter.received_weights)
        self.server_adapter.received_weights.clear()
        return self.checkpoint_engine.received_version, received
