"""What one vLLM worker does: at init, learn its read set (a dry run of the
model's loaders); on an update, pull exactly that onto its own device, then
apply it. Shared by the weight-transfer backend and the worker extension."""

from __future__ import annotations

import logging
import os
import time

import torch
from vllm.config import VllmConfig

from tensorhub import PullResult
from tensorhub.lora import AdapterStaging, PulledAdapter, pull_adapter
from tensorhub_vllm.apply import apply_checkpoint
from tensorhub_vllm.config import TensorHubInitInfo
from tensorhub_vllm.merge import adapter_parts_for, merged_staging
from tensorhub_vllm.readset import dry_run
from tensorhub_vllm.receiver import VersionReceiver, checkpoint_layout, model_dir
from tensorhub_vllm.vllm_internals import check_moe_updatable

log = logging.getLogger(__name__)


def engine_group(vllm_config: VllmConfig, info: TensorHubInitInfo, role: str) -> str:
    """The group id of this engine's workers: the same on every TP/PP rank of
    one engine (the config is shipped to each worker), distinct across engines.
    ``role`` keeps apart update counters that restart: the backend's and the
    extension's, and those of each (re-)initialization."""
    base = info.engine_id or f"vllm-{vllm_config.instance_id}"
    return f"{base}/dp{vllm_config.parallel_config.data_parallel_index}/{role}"


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's weights live: staging goes there too (no detour through host memory)."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def pull_failures(error: str | None) -> list[str]:
    """What every worker of this engine says went wrong with its pull of the
    version (each passes its own ``error``, None where it pulled its part
    whole); empty only if every worker pulled. The workers of one engine (TP x
    PP) all call this once per update, in the same order, so it is a gather over
    their CPU process groups; a worker outside vLLM's parallel state speaks for
    itself. Only if all pulled may any apply: a worker that loaded the new
    version beside one that kept the old would serve a model that is half one,
    half the other, and vLLM's reload all-reduces per-tensor and row-parallel
    FP8 scales across TP while it rebuilds each layer, where a worker that does
    not reload would hang its peers."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return [error] if error else []
    said = [f"worker {torch.distributed.get_rank()}: {error}"] if error else []
    for group in (get_tp_group(), get_pp_group()):  # over TP, then PP: every rank gets every rank's
        if group.world_size > 1:
            gathered: list = [None] * group.world_size
            torch.distributed.all_gather_object(gathered, said, group=group.cpu_group)
            said = [e for part in gathered for e in part]
    return said


class NotApplied(Exception):
    """An update another worker of the engine reports as failed
    (``reports_failures``): this worker applied nothing, and its caller returns
    instead of raising."""

    def __init__(self, version: int | str, failures: list[str]) -> None:
        super().__init__(f"version {version!r} not applied: {'; '.join(failures)}")


def reports_failures() -> bool:
    """Whether this worker raises an update's failure for its engine: its last
    (the last TP rank of the last PP stage, whose response vLLM reads last),
    or a worker outside vLLM's parallel state."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return True
    tp, pp = get_tp_group(), get_pp_group()
    return tp.rank_in_group == tp.world_size - 1 and pp.rank_in_group == pp.world_size - 1


class WorkerUpdater:
    """One worker's side of TensorHub: a receiver plus the model it loads into."""

    def __init__(self, vllm_config: VllmConfig, model: torch.nn.Module, info: TensorHubInitInfo, *, role: str) -> None:
        self.vllm_config = vllm_config
        self.model = model
        layout = checkpoint_layout(model_dir(vllm_config.model_config.model, vllm_config.load_config.download_dir),
                                   vllm_config.model_config.dtype)
        self.device = model_device(model)
        check_moe_updatable(model, vllm_config.parallel_config)  # before any pull: a MoE layer we cannot update right fails here
        start = time.perf_counter()
        self.read_set = dry_run(model, layout, self.device).coalesced(info.overread)
        log.info("tensorhub: read set of this worker: %d of %d bytes of the checkpoint (%d tensors in parts, "
                 "%d whole by fallback, %d bytes read as whole rows in %d; dry run %.2fs)", self.read_set.nbytes(),
                 self.read_set.checkpoint_nbytes(), len(self.read_set.boxes), len(self.read_set.fallbacks),
                 sum(self.read_set.widened.values()), len(self.read_set.widened), time.perf_counter() - start)
        group = engine_group(vllm_config, info, role)
        self.receiver = VersionReceiver(info, layout, group=group, name=f"vllm:{group}:{os.getpid()}",
                                        read_set=self.read_set, device=self.device,
                                        world_size=vllm_config.parallel_config.world_size)
        self.pull_s = self.apply_s = 0.0  # of the last update
        self.nbytes = 0
        self.bytes_by_source: dict[str, int] = {}
        self.delta_from: int | None = None  # the last update patched the staging from this version's deltas
        self.read_bytes = 0
        self.descriptors = 0  # READ descriptors the last pull posted
        self.last_pull: PullResult | None = None  # the last update's pull (its path, named, refreshes, ...)
        # Merged mode (info.merge_adapter): the adapter version merged into the weights, and its staging
        self.adapter: PulledAdapter | None = None
        self._adapter_parts = adapter_parts_for(self.read_set)
        self._adapter_staging: AdapterStaging = {}
        self._adapter_round = 0

    @property
    def version(self) -> int | None:
        return self.receiver.version

    def update(self, version: int | str) -> int:
        """Pull ``version`` (int or ``"latest"``) and load it; returns the version
        now served. If any worker of the engine failed to pull its part, none
        loads it and the engine's last worker raises (``reports_failures``): its
        own error where it failed too, else a RuntimeError quoting the others';
        the others raise ``NotApplied``, which their callers turn into a
        return. Every model keeps its previous weights. In merged mode the
        adapter merged last is merged onto the new base too."""
        start = time.perf_counter()
        try:
            result, error = self.receiver.receive(version), None
            staged = self.receiver.staged if self.adapter is None else merged_staging(self.receiver.staged, self.adapter)
        except Exception as e:  # noqa: BLE001  (every worker must hear how this pull went, then it is raised)
            result, staged, error = None, None, e  # a failure of its own is among the failures: done() below
        self.pull_s = time.perf_counter() - start
        try:
            self._settle(version, self.receiver.info.model, error)
            apply_checkpoint(self.vllm_config, self.model, self.read_set.weights(staged, self.device))
        finally:
            self.receiver.done()
        self.apply_s = time.perf_counter() - start - self.pull_s
        self.receiver.version = result.version
        self.nbytes = result.nbytes
        self.bytes_by_source = result.bytes_by_source
        self.delta_from, self.read_bytes = result.delta_from, result.read_bytes
        self.descriptors = result.descriptors
        self.last_pull = result
        log.info("tensorhub: loaded %r version %d (%d bytes; pull %.3fs, apply %.3fs)", self.receiver.info.model,
                 result.version, result.nbytes, self.pull_s, self.apply_s)
        return result.version

    def update_adapter(self, version: int | str) -> int:
        """Merged mode: pull only ``version`` of the adapter ``merge_adapter``
        (the rows of B and columns of A this worker's boxes need) and load the
        base version in the staging merged with it, through the same reload as
        ``update``, with the same all-or-none rule across the engine's workers.
        Returns the adapter version now merged."""
        key = self.receiver.info.merge_adapter
        self._adapter_round += 1
        start = time.perf_counter()
        try:  # every failure, these two included, goes through _settle: one worker raises it for the engine
            if not key:
                raise RuntimeError("tensorhub: this engine merges no adapter: set merge_adapter in its init_info")
            if self.receiver.version is None or self.receiver.staged is None:
                raise RuntimeError("tensorhub: merged mode merges onto the base version in the staging, and there "
                                   "is none yet: update the base weights through TensorHub first")
            adapter = pull_adapter(self.receiver.hub, key, version, parts=self._adapter_parts,
                                   staging=self._adapter_staging, group=f"{self.receiver.group}/adapter",
                                   group_round=self._adapter_round)
            staged, error = merged_staging(self.receiver.staged, adapter), None
        except Exception as e:  # noqa: BLE001  (as in update: every worker hears, then it is raised)
            adapter, staged, error = None, None, e
        self.pull_s = time.perf_counter() - start
        self._settle(version, key or "(no adapter)", error)
        apply_checkpoint(self.vllm_config, self.model, self.read_set.weights(staged, self.device))
        self.apply_s = time.perf_counter() - start - self.pull_s
        self.adapter = adapter
        self.nbytes, self.read_bytes = adapter.result.nbytes, adapter.result.read_bytes
        self.bytes_by_source = dict(adapter.result.bytes_by_source)
        self.delta_from, self.descriptors = None, adapter.result.descriptors
        self.last_pull = adapter.result
        log.info("tensorhub: merged %r version %d onto %r version %d (%d bytes; pull %.3fs, apply %.3fs)", key,
                 adapter.version, self.receiver.info.model, self.receiver.version, self.nbytes, self.pull_s,
                 self.apply_s)
        return adapter.version

    def _settle(self, version: int | str, model: str, error: Exception | None) -> None:
        """Return only if every worker of the engine pulled its part of
        ``version``; else raise: the engine's last worker the failure, the
        others ``NotApplied`` (see ``update``)."""
        failures = pull_failures(None if error is None else f"{type(error).__name__}: {error}")
        if not failures:
            return
        if not reports_failures():
            # vLLM 0.32's multiprocess executor raises at the first failed
            # worker's response and leaves the later workers' responses in
            # their queues, where the next collective_rpc reads them (it
            # did: the next apply_model raised this update's error). So
            # only the engine's last worker raises out of the RPC; this
            # one's caller (backend, extension) returns.
            log.warning("tensorhub: version %r not applied: %s", version, "; ".join(failures))
            raise NotApplied(version, failures)
        if error is not None:  # typed (VersionNotFound, ...), as where every worker failed alike
            raise error
        raise RuntimeError(
            f"tensorhub: version {version!r} of {model!r} was not applied: not every worker of this engine pulled "
            f"its part ({'; '.join(failures)}); every worker keeps the weights it had")

    def close(self) -> None:
        self.receiver.close()
