"""One trainer rank's side of a weight sync: publish this rank's partition of
every parameter in place as version ``v``, and withdraw it before training
overwrites that memory.

    broadcast_to_vllm (every rank)        fit / offload / reload (every rank)
      version = agreed across ranks          withdraw(): unpublish, which waits
      publish {name: Shard(view)}            for readers still reading
      (rank 0 then asks the engines)

There is no copy and no gather: a version is visible once the ranks'
regions cover every element, which is when the last rank has published.

``TENSORHUB_CUT=readers`` (off by default) adds one: each rank also publishes
its share of the readers' cut (``Hub.publish(cut="readers")``), gathered from
the ranks' flat partitions over their partition group. That publish is
collective, so every rank calls it, and a rank holding nothing of the model
is refused on every rank at once (it could not join the gathers).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tensorhub import Hub, Publication, Shard
from tensorhub.client.trainercut import ranks_holding_nothing
from tensorhub.lora import AdapterConfig, publish_adapter
from tensorhub.server.ray_actor import resolve_address
from tensorhub_openrlhf.partitions import is_zero3, partition_group, replica_region, zero3_region
from tensorhub_openrlhf.settings import TensorHubSettings

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class PublishStats:
    version: int
    nbytes: int  # bytes this rank published (its partitions, in place)
    regions: int
    withdraw_s: float  # waiting for readers of the previous version (0 when already withdrawn)
    publish_s: float
    delta_bytes: int = 0  # of its delta from the last version (TENSORHUB_DELTA=copy; 0: none)
    # TENSORHUB_CUT=readers: its share of the readers' cut (0: no readers' cut
    # known yet, or the cut is off), the most bytes of full tensors it held at
    # once while gathering it (never over the bound), and the seconds it took
    cut_bytes: int = 0
    cut_peak_gather_bytes: int = 0
    cut_s: float = 0.0


class WeightPublisher:
    """Publishes one trainer rank's parameters; one per rank, for the whole run."""

    def __init__(self, settings: TensorHubSettings, *, rank: int, world: int) -> None:
        self.settings = settings
        self.rank, self.world = rank, world
        address = resolve_address(settings.address)
        self.hub = Hub.connect(address, config=settings.hub_config(
            f"openrlhf-trainer{rank}@{socket.gethostname()}:{os.getpid()}"))
        self._published: Publication | None = None
        self.last_version: int | None = None
        # delta "copy": this rank's partitions of the last version, in host memory
        self._previous: dict[str, Shard] | None = None

    def regions(self, named_params: Iterable[tuple[str, torch.nn.Parameter]]
                ) -> tuple[dict[str, Shard], dict[str, torch.Tensor]]:
        """This rank's region of each parameter, and the whole model's layout (meta tensors)."""
        regions: dict[str, Shard] = {}
        layout: dict[str, torch.Tensor] = {}
        for name, param in named_params:
            if is_zero3(param):
                group = param.ds_process_group
                region = zero3_region(param, dist.get_rank(group=group), dist.get_world_size(group=group))
                shape = tuple(param.ds_shape)
            else:
                region = replica_region(param, self.rank, self.world)
                shape = tuple(param.shape)
            layout[name] = torch.empty(shape, dtype=param.dtype, device="meta")
            if region is not None:
                regions[name] = region
        return regions, layout

    def next_version(self, step: int) -> int:
        """The version of this sync, the same on every rank: the trainer's step,
        or one past the newest version the hub already has when that is higher
        (a resumed run, another trainer under the same model key)."""
        if self.rank == 0:
            newest = max(self.hub.versions(self.settings.model), default=-1)
            if self.last_version is not None:
                newest = max(newest, self.last_version)
            mine = [max(int(step), newest + 1)]
        else:
            mine = [None]
        if self.world > 1:
            dist.broadcast_object_list(mine, src=0)
        return int(mine[0])

    def publish(self, version: int, named_params: Iterable[tuple[str, torch.nn.Parameter]], *,
                adapter: AdapterConfig | None = None) -> PublishStats:
        """``adapter``: the parameters are a LoRA adapter's, under PEFT's saved
        names, published as an adapter version (``tensorhub.lora``) with these
        settings beside them, whole (no delta)."""
        start = time.perf_counter()
        self.withdraw()
        withdrawn = time.perf_counter()
        params = list(named_params)
        regions, manifest = self.regions(params)
        delta_bytes = 0
        if adapter is not None:
            self._published = publish_adapter(self.hub, self.settings.model, version, regions, adapter,
                                              manifest=manifest)
        else:
            together = self.settings.cut is not None or self.settings.publish_together  # collective
            kwargs: dict[str, Any] = self._group_kwargs(params, bool(regions)) if together else {}
            if regions:  # a rank can hold nothing (tiny model, many ranks; refused above with the cut on)
                if self.settings.delta == "copy" and self.last_version is not None and _same_layout(
                        self._previous, regions):
                    kwargs.update(delta_from=self.last_version, previous=self._previous)
                self._published = self.hub.publish(self.settings.model, version, regions, manifest=manifest,
                                                   **kwargs)
                delta_bytes = sum(c.nbytes for c in self._published.companions)
                if self.settings.delta == "copy":
                    self._previous = _host_copy(regions, self._previous)
        self.last_version = version
        stats = PublishStats(version=version, nbytes=sum(s.tensor.numel() * s.tensor.element_size()
                                                         for s in regions.values()),
                             regions=len(regions), withdraw_s=withdrawn - start,
                             publish_s=time.perf_counter() - withdrawn, delta_bytes=delta_bytes)
        cut = None if self._published is None else self._published.cut_report
        if cut is not None:
            stats.cut_bytes, stats.cut_peak_gather_bytes, stats.cut_s = cut.nbytes, cut.peak_gather_bytes, cut.seconds
        log.info("tensorhub: rank %d published %d regions (%.1f MiB, in place) of %r version %d in %.3fs",
                 self.rank, stats.regions, stats.nbytes / 2**20, self.settings.model, version, stats.publish_s)
        return stats

    def _group_kwargs(self, params: list[tuple[str, torch.nn.Parameter]], holds: bool) -> dict[str, Any]:
        """``Hub.publish``'s arguments for the readers' cut and for the ranks
        publishing as one group, once every rank of the partition group is known
        to hold something (asked of all at once, so all refuse together rather
        than some waiting in the collective)."""
        setting = "TENSORHUB_CUT=readers" if self.settings.cut is not None else "TENSORHUB_PUBLISH_TOGETHER=1"
        off = "TENSORHUB_CUT=off" if self.settings.cut is not None else "TENSORHUB_PUBLISH_TOGETHER=0"
        if not dist.is_initialized():
            raise ValueError(f"{setting} publishes over the trainer's torch.distributed group, and none is "
                             f"initialized; set {off}")
        group = partition_group(p for _, p in params)
        empty = ranks_holding_nothing(holds, group)
        if empty:
            raise ValueError(f"{setting}: trainer rank(s) {empty} of the partition group hold nothing of the model "
                             f"(more ranks than elements?), and a collective publish needs every rank; set {off}")
        kwargs: dict[str, Any] = {"trainer_group": group} if self.settings.publish_together else {}
        if self.settings.cut is not None:
            kwargs.update(cut=self.settings.cut, cut_group=group, cut_gather_bytes=self.settings.cut_gather_bytes)
        return kwargs

    def withdraw(self) -> float:
        """Stop serving the last version's partitions; returns once no reader
        reads them any more, so training may overwrite them. Seconds waited."""
        if self._published is None:
            return 0.0
        start = time.perf_counter()
        publication, self._published = self._published, None
        publication.unpublish(self.settings.unpublish_timeout_s)
        return time.perf_counter() - start

    def wait_visible(self, version: int) -> int:
        """Block until every rank's regions of ``version`` are in (the version is visible)."""
        return self.hub.wait_for_version(self.settings.model, version, timeout=self.settings.update_timeout_s)

    def close(self) -> None:
        self._published = self._previous = None
        self.hub.close(timeout=self.settings.unpublish_timeout_s)


def _same_layout(previous: dict[str, Shard] | None, regions: dict[str, Shard]) -> bool:
    return previous is not None and list(previous) == list(regions) and all(
        (p.region, p.tensor.shape, p.tensor.dtype) == (r.region, r.tensor.shape, r.tensor.dtype)
        for p, r in zip(previous.values(), regions.values()))


def _host_copy(regions: dict[str, Shard], reuse: dict[str, Shard] | None) -> dict[str, Shard]:
    """A host copy of this rank's partitions (the buffers of the last one, where the layout is the same)."""
    if not _same_layout(reuse, regions):
        reuse = {name: Shard(torch.empty(s.tensor.shape, dtype=s.tensor.dtype), s.full_shape, box=s.region.box,
                             flat=s.region.flat) for name, s in regions.items()}
    for name, s in regions.items():
        reuse[name].tensor.copy_(s.tensor)
    return reuse
