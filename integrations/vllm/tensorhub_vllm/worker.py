"""What one vLLM worker does: at init, learn its read set (a dry run of the
model's loaders); on an update, pull exactly that onto its own device, then
apply it. Shared by the weight-transfer backend and the worker extension."""

from __future__ import annotations

import logging
import os
import time

import torch
from vllm.config import VllmConfig

from tensorhub_vllm.apply import apply_checkpoint
from tensorhub_vllm.config import TensorHubInitInfo
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

    @property
    def version(self) -> int | None:
        return self.receiver.version

    def update(self, version: int | str) -> int:
        """Pull ``version`` (int or ``"latest"``) and load it; returns the version
        now served. On any error the model keeps its previous weights."""
        start = time.perf_counter()
        result = self.receiver.receive(version)
        self.pull_s = time.perf_counter() - start
        try:
            apply_checkpoint(self.vllm_config, self.model, self.read_set.weights(self.receiver.staged, self.device))
        finally:
            self.receiver.done()
        self.apply_s = time.perf_counter() - start - self.pull_s
        self.receiver.version = result.version
        self.nbytes = result.nbytes
        self.bytes_by_source = result.bytes_by_source
        self.delta_from, self.read_bytes = result.delta_from, result.read_bytes
        self.descriptors = result.descriptors
        log.info("tensorhub: loaded %r version %d (%d bytes; pull %.3fs, apply %.3fs)", self.receiver.info.model,
                 result.version, result.nbytes, self.pull_s, self.apply_s)
        return result.version

    def close(self) -> None:
        self.receiver.close()
