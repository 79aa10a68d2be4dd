"""OpenRLHF's trainer classes with TensorHub in place of the NCCL weight sync.

``TensorHubActorPPOTrainer`` (a subclass of OpenRLHF's ``ActorPPOTrainer``):
* builds no weight-sync group (``_init_vllm_sync_group`` does nothing), so an
  engine that dies or joins breaks nothing;
* ``broadcast_to_vllm``, at the same point of the PPO loop: every DeepSpeed
  rank publishes its partition of each parameter in place (ZeRO-3: its
  ``ds_tensor``; ZeRO-0/1/2: a ``1/world`` flat slice of its replica), then
  rank 0 asks the engines to pull the step. No gather, no copy.
  ``TENSORHUB_LORA=1`` (OpenRLHF's ``--ds.lora.rank > 0``): only the PEFT
  adapter's A/B matrices, each rank its partitions, as an adapter version
  (``tensorhub.lora``); rank 0 asks the engines to load it as it does a
  step of weights (they serve it from memory: ``engines.py``).
  ``TENSORHUB_CUT=readers``: every rank also publishes its share of the
  readers' cut, gathered over the ZeRO-3 partition group (``publisher.py``).

``TensorHubPolicyModelActor`` (OpenRLHF's ``PolicyModelActor`` reached through
``__ray_actor_class__``, subclassed and made a Ray actor again) builds that
trainer, and withdraws the published step before anything overwrites the
partitions (``fit``, ``offload_states``, ``reload_states``). Between the
sync and the next ``fit`` (the rollout phase) the step stays pullable from the
trainer, so an engine that restarts meanwhile catches up from it or its peers.

The driver's side (the PPO loop, async training's lock and pause/resume
around ``broadcast_to_vllm``) is OpenRLHF's own, unchanged.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
import torch.distributed as dist
from openrlhf.trainer.ray import ppo_actor

from tensorhub.lora import adapter_config_of, lora_parameters
from tensorhub_openrlhf.engines import update_engines
from tensorhub_openrlhf.publisher import WeightPublisher
from tensorhub_openrlhf.settings import TensorHubSettings

log = logging.getLogger(__name__)


class TensorHubActorPPOTrainer(ppo_actor.ActorPPOTrainer):
    _tensorhub: WeightPublisher | None = None
    tensorhub_stats: dict[str, Any] | None = None  # of the last sync, for logs and tests

    def _init_vllm_sync_group(self, backend: str) -> None:
        """No group: engines pull each step from the hub."""
        log.info("tensorhub: no %s weight-sync group is built; engines pull from TensorHub", backend)

    def tensorhub_publisher(self) -> WeightPublisher:
        if self._tensorhub is None:
            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            self._tensorhub = WeightPublisher(TensorHubSettings.from_env(), rank=rank, world=world)
        return self._tensorhub

    def broadcast_to_vllm(self) -> None:
        args = self.strategy.args
        if getattr(args.ds, "tensor_parallel_size", 1) > 1:
            raise NotImplementedError("tensorhub: DeepSpeed AutoTP (--ds.tensor_parallel_size > 1) splits "
                                      "parameters across ranks in a layout TensorHub does not publish yet")
        start = time.perf_counter()
        publisher = self.tensorhub_publisher()
        model = self.actor.model.module
        version = publisher.next_version(getattr(self.actor.model, "global_steps", 0))
        if publisher.settings.lora:  # only the adapter: its A/B matrices under PEFT's saved names
            stats = publisher.publish(version, lora_parameters(model).items(), adapter=adapter_config_of(model))
        else:
            # The same parameters OpenRLHF's own sync sends (a VLM's frozen vision tower stays out).
            params = [(n, p) for n, p in model.named_parameters()
                      if p.requires_grad or not getattr(self.actor, "is_vlm", False)]
            stats = publisher.publish(version, params)
        self.tensorhub_stats = {"version": version, "published_bytes": stats.nbytes,
                                "withdraw_s": stats.withdraw_s, "publish_s": stats.publish_s,
                                "delta_bytes": stats.delta_bytes}
        if publisher.settings.cut is not None:  # its share of the readers' cut (0 until readers are known)
            self.tensorhub_stats.update(cut_bytes=stats.cut_bytes, cut_peak_gather_bytes=stats.cut_peak_gather_bytes,
                                        cut_s=stats.cut_s)
        if publisher.rank == 0 and (self.vllm_engines or publisher.settings.lora):
            publisher.wait_visible(version)  # every rank's partitions are in (an adapter's: for any reader)
        if publisher.rank == 0 and self.vllm_engines:
            result = update_engines(self.vllm_engines, version, publisher.settings.update_timeout_s)
            self.tensorhub_stats.update(engines_loaded=result["loaded"], engines_failed=result["failed"])
        self.tensorhub_stats["sync_s"] = time.perf_counter() - start

    def tensorhub_withdraw(self) -> float:
        """Unpublish the last step (waits for its readers); seconds waited."""
        return 0.0 if self._tensorhub is None else self._tensorhub.withdraw()


class _TensorHubPolicyModelActor(ppo_actor.PolicyModelActor.__ray_actor_class__):
    def init_model_from_pretrained(self, *args: Any, **kwargs: Any) -> None:
        # OpenRLHF constructs its trainer by the module-level name; this Ray
        # worker process hosts this actor alone, so the name can point here.
        ppo_actor.ActorPPOTrainer = TensorHubActorPPOTrainer
        super().init_model_from_pretrained(*args, **kwargs)

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        self.trainer.tensorhub_withdraw()  # the optimizer is about to overwrite the published partitions
        return super().fit(*args, **kwargs)

    def offload_states(self) -> None:
        self.trainer.tensorhub_withdraw()
        super().offload_states()

    def reload_states(self) -> None:
        self.trainer.tensorhub_withdraw()
        super().reload_states()

    def tensorhub_stats(self) -> dict[str, Any] | None:
        return self.trainer.tensorhub_stats


# As OpenRLHF declares its own: one GPU per actor unless RayActorGroup says otherwise.
TensorHubPolicyModelActor = ray.remote(num_gpus=1)(_TensorHubPolicyModelActor)
