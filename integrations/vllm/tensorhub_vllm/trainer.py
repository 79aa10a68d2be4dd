"""The trainer side of vLLM's weight-transfer API for the ``tensorhub`` backend.

    from tensorhub_vllm.trainer import TensorHubTrainerInitInfo   # registers the backend
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.base import ModuleSource

    engine = WeightTransferTrainerFactory.trainer_init(
        TensorHubTrainerInitInfo(hub="10.0.0.1:50051", model="qwen/policy", rank=dist.get_rank()),
        client=HTTPVLLMWeightSyncClient("http://rollout:8000"), source=ModuleSource(fsdp_model))
    for step in ...:
        train_step()
        engine.send_weights()          # on every rank

Every rank publishes what it holds of each parameter, in place: the local shard
of an FSDP2 (DTensor) parameter as its region of the full tensor (no
``full_tensor()``, no gather), a plain tensor whole. The version is visible once
the ranks' regions cover the model; rank 0 (the sender) waits for that, then
drives start / update / finish on the engines through the client, which pull
the version from the ranks (and from each other). When the engines are done,
every rank withdraws its shard (a barrier on the default process group, when
there is one, keeps the others from withdrawing before the update is over), so
the optimizer may write the parameters again; engines started with
``serve: true`` keep the version pullable for late engines.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from tensorhub import Hub, HubConfig, Shard
from tensorhub_vllm.plugin import BACKEND, register_trainer
from tensorhub_vllm.vllm_internals import module_of

log = logging.getLogger(__name__)

register_trainer()  # importing the init info is enough to select the backend


@dataclass(kw_only=True)
class TensorHubTrainerInitInfo(TrainerInitInfo):
    """``rank``: this trainer process's rank (0 drives the engines). ``engine``:
    more fields of the engines' ``init_info`` (``serve``, ``hub_config``, ...)."""

    backend: ClassVar[str] = BACKEND

    hub: str  # reference server, host:port
    model: str  # model key the versions are published under
    first_version: int = 1  # the first send_weights publishes this version, each next one +1
    engine: dict[str, Any] = field(default_factory=dict)
    hub_config: dict[str, Any] = field(default_factory=dict)  # this rank's tensorhub.HubConfig fields
    visible_timeout_s: float = 300.0  # the sender waits this long for every rank's shard
    unpublish_timeout_s: float = 60.0  # each rank waits this long for the engines' reads to drain


def local_entries(source: WeightSource, *, publish_whole: bool) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What this rank publishes of ``source``, in place, and the whole model's
    manifest (meta tensors). DTensor parameters: the local shard as its region.
    A source without a module to read shards from is iterated (its own
    materialization); then only ``publish_whole`` ranks publish, the names they hold."""
    manifest = {m.name: torch.empty(m.shape, dtype=m.dtype, device="meta") for m in source.metadata()}
    module = module_of(source)
    entries: dict[str, Any] = {}
    if module is None:
        if publish_whole:
            held = source.held_names()
            entries = {n: t.detach() for n, t in source if t is not None and (held is None or n in held)}
        return entries, manifest
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for name, param in module.named_parameters():
        if not isinstance(param, DTensor):
            entries[name] = param.detach()
            continue
        if any(isinstance(p, Partial) for p in param.placements):
            raise ValueError(f"tensorhub: {name} is a partial sum (placements {param.placements}): nothing to "
                             "publish in place until it is reduced")
        local = param.detach().to_local()
        if local.numel() == 0:
            continue  # an uneven split left this rank nothing of it
        if not local.is_contiguous():
            raise ValueError(f"tensorhub: the local shard of {name} is not contiguous; it cannot be published in place")
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        box = tuple((o, o + s) for o, s in zip(offset, shape))
        entries[name] = Shard(local, tuple(param.shape), box=box) if box else local
    return entries, manifest


class TensorHubTrainerWeightTransferEngine(TrainerWeightTransferEngine[TensorHubTrainerInitInfo]):
    init_info_cls = TensorHubTrainerInitInfo

    info: TensorHubTrainerInitInfo
    hub: Hub
    version: int
    published_bytes: int = 0  # by this rank, in the last send_weights

    @classmethod
    def trainer_init(cls, init_info: TensorHubTrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None) -> TensorHubTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("tensorhub: trainer_init needs source= (a WeightSource, e.g. ModuleSource(model))")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        engine.version = init_info.first_version - 1
        engine.hub = Hub.connect(init_info.hub, config=HubConfig.from_dict(
            {"name": f"vllm-trainer/rank{init_info.rank}", **init_info.hub_config}))
        if engine.is_sender:
            client.init_weight_transfer_engine({"hub": init_info.hub, "model": init_info.model, **init_info.engine})
        return engine

    def send_weights(self) -> None:
        """Publish the next version (every rank its part), have the engines load
        it (the sender), withdraw it (every rank). Called on every rank."""
        assert self.source is not None
        version = self.version + 1
        entries, manifest = local_entries(self.source, publish_whole=self.is_sender)
        publication = self.hub.publish(self.info.model, version, entries, manifest=manifest) if entries else None
        self.published_bytes = _nbytes(entries)
        try:
            if self.is_sender:
                self.hub.wait_for_version(self.info.model, at_least=version, timeout=self.info.visible_timeout_s)
                self.client.start_weight_update()
                self.client.update_weights({"version": version})
                self.client.finish_weight_update(weight_version=str(version))
        finally:
            _barrier()  # the engines are done (or failed): every rank may withdraw
            if publication is not None:
                publication.unpublish(timeout=self.info.unpublish_timeout_s)
        self.version = version
        log.info("tensorhub: version %d of %r sent (%d bytes published by rank %d)", version, self.info.model,
                 self.published_bytes, self.info.rank)

    def shutdown(self) -> None:
        self.hub.close()


def _nbytes(entries: Mapping[str, Any]) -> int:
    return sum((v.tensor if isinstance(v, Shard) else v).nbytes for v in entries.values())


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
