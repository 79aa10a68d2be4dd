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

``lora=True``: the module (``ModuleSource`` of a PEFT model, FSDP2 or plain)
trains a LoRA adapter on a frozen base, and every rank publishes only the
adapter: its part of each ``lora_A`` / ``lora_B`` (an FSDP2 rank its local
shards) under PEFT's saved names, with the PEFT settings, as version ``v`` of
``model``, an adapter version (``tensorhub.lora``; name the key like
``policy/lora/<name>``). vLLM's weight-transfer API has no route for adapters,
so the engines are not driven: the process holding each engine loads the
version with ``tensorhub_vllm.adapter_versions.AdapterVersions`` when it
chooses, and ``client`` may be None. Each rank therefore publishes a host copy
of its part (about 1% of the model, buffers reused step to step) and keeps it
published until its next ``send_weights``, which withdraws it first (waiting
for readers): the optimizer may write the parameters as soon as
``send_weights`` returns.

``cut="readers"`` (off by default) also publishes, from every rank, its share
of the readers' cut (``Hub.publish(cut="readers")``): the regions the engines'
workers read of the last version, gathered on the trainer at most
``cut_gather_bytes`` at a time and laid out back to back, so a TP worker reads
contiguous bytes instead of a run per row of each row-parallel tensor. Turn it
on for TP engines fed by row-sharded (FSDP) trainers; it costs each rank a
gather of a few layers and its share of the cut in memory. The gather is
collective over the default process group: every rank of it calls
``send_weights``, and every rank must hold a part of the model (one that holds
none is refused on every rank at once, before any gather).

``publish_together=True`` (off by default): the ranks announce each version
as one group, and withdraw it as one (``Hub.publish(trainer_group=)`` over the
default process group): rank 0 sends every rank's announce in one message and
their withdrawals in another, so a version costs the reference server two
messages from the whole trainer, not two per rank (Kimi-K2 on 256 ranks: 896
-> 386 messages a step, ``tensorhub bench scale --trainer-group``). Collective
like the cut, with the same rule: every rank calls ``send_weights`` and holds
a part of the model. With the cut on, the ranks already go as one group.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from tensorhub import Hub, HubConfig, Publication, Shard
from tensorhub.client.trainercut import ranks_holding_nothing
from tensorhub.dtensor import local_part
from tensorhub.lora import adapter_of, lora_parameters, publish_adapter
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
    cut: Literal["readers"] | None = None  # "readers": also publish the readers' cut (collective; see above)
    cut_gather_bytes: int | None = None  # the cut's gather bound per rank (None: HubConfig.cut_gather_bytes)
    lora: bool = False  # publish only the PEFT adapter, as an adapter version (see above)
    # The ranks announce and withdraw each version as one group (Hub.publish(trainer_group=), over the
    # default process group): rank 0 sends every rank's messages, two a version for the whole trainer
    # instead of two per rank (see above)
    publish_together: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.lora, bool):
            raise ValueError(f"{name}.lora: must be True or False, not {self.lora!r}")  # noqa: TRY004
        if self.lora and self.cut is not None:
            raise ValueError(f"{name}.cut: the readers' cut is for base weights; an adapter is read whole")
        if self.cut not in (None, "readers"):
            raise ValueError(f"{name}.cut: must be 'readers' or None, not {self.cut!r}")
        g = self.cut_gather_bytes
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g <= 0):
            raise ValueError(f"{name}.cut_gather_bytes: must be a positive number of bytes or None, not {g!r}")
        if g is not None and self.cut is None:
            raise ValueError(f"{name}.cut_gather_bytes: only means something with cut='readers'")
        if not isinstance(self.publish_together, bool):
            raise ValueError(f"{name}.publish_together: must be True or False, not {self.publish_together!r}")  # noqa: TRY004
        if self.publish_together and self.lora:
            raise ValueError(f"{name}.publish_together: an adapter version is published by each rank alone "
                             "(lora=True); leave publish_together False")


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
    for name, param in module.named_parameters():
        part = local_part(name, param)
        if part is not None:  # None: an uneven split left this rank nothing of it
            entries[name] = part
    return entries, manifest


class TensorHubTrainerWeightTransferEngine(TrainerWeightTransferEngine[TensorHubTrainerInitInfo]):
    init_info_cls = TensorHubTrainerInitInfo

    info: TensorHubTrainerInitInfo
    hub: Hub
    version: int
    adapter_copy: AdapterCopy | None = None  # lora: this rank's published copy of its part of the adapter
    published_bytes: int = 0  # by this rank, in the last send_weights (its shards)
    cut_bytes: int = 0  # of the readers' cut, by this rank, in the last send_weights (its extra memory)

    @classmethod
    def trainer_init(cls, init_info: TensorHubTrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None) -> TensorHubTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("tensorhub: trainer_init needs source= (a WeightSource, e.g. ModuleSource(model))")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        if init_info.cut is not None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("TensorHubTrainerInitInfo.cut: 'readers' gathers over the default torch.distributed "
                                 "process group: initialize it before trainer_init (or leave cut unset)")
        if init_info.publish_together:
            _default_group()  # refused here, naming the field, before it connects anywhere
        engine.version = init_info.first_version - 1
        if init_info.lora and module_of(source) is None:
            raise ValueError("TensorHubTrainerInitInfo.lora: the adapter is read from the PEFT model itself: pass "
                             "source=ModuleSource(peft_model)")
        engine.hub = Hub.connect(init_info.hub, config=HubConfig.from_dict(
            {"name": f"vllm-trainer/rank{init_info.rank}", **init_info.hub_config}))
        engine.adapter_copy = AdapterCopy() if init_info.lora else None
        if engine.is_sender and not init_info.lora:
            client.init_weight_transfer_engine({"hub": init_info.hub, "model": init_info.model, **init_info.engine})
        return engine

    def send_weights(self) -> None:
        """Publish the next version (every rank its part), have the engines load
        it (the sender), withdraw it (every rank). Called on every rank."""
        assert self.source is not None
        version = self.version + 1
        if self.adapter_copy is not None:
            self._send_adapter(version)
            return
        entries, manifest = local_entries(self.source, publish_whole=self.is_sender)
        if self.info.cut is None and not self.info.publish_together:
            publication = self.hub.publish(self.info.model, version, entries, manifest=manifest) if entries else None
        else:  # collective: every rank publishes
            together: dict[str, Any] = {"trainer_group": _default_group()} if self.info.publish_together else {}
            _every_rank_holds_some(entries, self.info.rank, "cut" if self.info.cut is not None else "publish_together")
            if self.info.cut is not None:
                together.update(cut=self.info.cut, cut_gather_bytes=self.info.cut_gather_bytes)
            publication = self.hub.publish(self.info.model, version, entries, manifest=manifest, **together)
        self.published_bytes = _nbytes(entries)
        self.cut_bytes = publication.cut_report.nbytes if publication is not None and publication.cut is not None \
            else 0
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

    def _send_adapter(self, version: int) -> None:
        module = module_of(self.source)
        publication = self.adapter_copy.publish(self.hub, self.info.model, version, module,
                                                self.info.unpublish_timeout_s)
        self.published_bytes = publication.nbytes
        if self.is_sender:
            self.hub.wait_for_version(self.info.model, at_least=version, timeout=self.info.visible_timeout_s)
        self.version = version
        log.info("tensorhub: adapter version %d of %r published (%d bytes by rank %d)", version, self.info.model,
                 self.published_bytes, self.info.rank)

    def shutdown(self) -> None:
        if self.adapter_copy is not None:
            self.adapter_copy.withdraw(self.info.unpublish_timeout_s)
        self.hub.close()


class AdapterCopy:
    """One rank's host copy of its part of a PEFT model's adapter, published
    as an adapter version until the next one replaces it."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.publication: Publication | None = None

    def withdraw(self, timeout: float) -> None:
        """Stop serving the last version; returns once no reader reads the buffers."""
        publication, self.publication = self.publication, None
        if publication is not None:
            publication.unpublish(timeout)

    def publish(self, hub: Hub, model: str, version: int, module: torch.nn.Module, timeout: float) -> Publication:
        parts, config = adapter_of(module)
        layout = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in lora_parameters(module).items()}
        self.withdraw(timeout)  # the buffers are about to be overwritten
        copies = {name: self._copy(name, part) for name, part in parts.items()}
        self.publication = publish_adapter(hub, model, version, copies, config, manifest=layout)
        return self.publication

    def _copy(self, name: str, part: torch.Tensor | Shard) -> torch.Tensor | Shard:
        tensor = part.tensor if isinstance(part, Shard) else part
        buffer = self.buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        buffer.copy_(tensor)
        return Shard(buffer, part.full_shape, box=part.region.box) if isinstance(part, Shard) else buffer


def _nbytes(entries: Mapping[str, Any]) -> int:
    return sum((v.tensor if isinstance(v, Shard) else v).nbytes for v in entries.values())


def _every_rank_holds_some(entries: Mapping[str, Any], rank: int, setting: str) -> None:
    """A publish with the cut or ``publish_together`` is collective: a rank
    without entries could not join it and the others would wait for it. Asked
    of every rank at once, so all refuse together instead."""
    empty = ranks_holding_nothing(bool(entries))
    if empty:
        raise ValueError(f"TensorHubTrainerInitInfo.{setting}: the trainer rank(s) at default-group position(s) "
                         f"{empty} hold nothing of the model, and a collective publish needs every rank (a source "
                         "without a module publishes from the sender only: pass ModuleSource of the sharded model, "
                         f"or leave {setting} unset); refused on rank {rank} too")


def _default_group() -> Any:
    """``publish_together``'s group: the default one, which must exist."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("TensorHubTrainerInitInfo.publish_together: the ranks publish as the default "
                         "torch.distributed group, and none is initialized (leave publish_together False)")
    return dist.group.WORLD


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
