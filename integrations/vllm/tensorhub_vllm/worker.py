"""What one vLLM worker does on an update: receive the whole version, then apply
it. Shared by the weight-transfer backend and the worker extension."""

from __future__ import annotations

import logging
import os
import time

import torch
from vllm.config import VllmConfig

from tensorhub_vllm.apply import apply_checkpoint
from tensorhub_vllm.config import TensorHubInitInfo
from tensorhub_vllm.receiver import VersionReceiver, checkpoint_layout, model_dir

log = logging.getLogger(__name__)


def engine_group(vllm_config: VllmConfig, info: TensorHubInitInfo, role: str) -> str:
    """The group id of this engine's workers: the same on every TP/PP rank of
    one engine (the config is shipped to each worker), distinct across engines.
    ``role`` keeps apart update counters that restart: the backend's and the
    extension's, and those of each (re-)initialization."""
    base = info.engine_id or f"vllm-{vllm_config.instance_id}"
    return f"{base}/dp{vllm_config.parallel_config.data_parallel_index}/{role}"


class WorkerUpdater:
    """One worker's side of TensorHub: a receiver plus the model it loads into."""

    def __init__(self, vllm_config: VllmConfig, model: torch.nn.Module, info: TensorHubInitInfo, *, role: str) -> None:
        self.vllm_config = vllm_config
        self.model = model
        layout = checkpoint_layout(model_dir(vllm_config.model_config.model, vllm_config.load_config.download_dir),
                                   vllm_config.model_config.dtype)
        group = engine_group(vllm_config, info, role)
        self.receiver = VersionReceiver(info, layout, group=group, name=f"vllm:{group}:{os.getpid()}")
        self.pull_s = self.apply_s = 0.0  # of the last update
        self.nbytes = 0

    @property
    def version(self) -> int | None:
        return self.receiver.version

    def update(self, version: int | str) -> int:
        """Pull ``version`` (int or ``"latest"``) and load it; returns the version
        now served. On any error the model keeps its previous weights."""
        start = time.perf_counter()
        result = self.receiver.receive(version)
        self.pull_s = time.perf_counter() - start
        apply_checkpoint(self.vllm_config, self.model, result.tensors)
        self.apply_s = time.perf_counter() - start - self.pull_s
        self.receiver.version = result.version
        self.nbytes = result.nbytes
        log.info("tensorhub: loaded %r version %d (%d bytes; pull %.3fs, apply %.3fs)", self.receiver.info.model,
                 result.version, result.nbytes, self.pull_s, self.apply_s)
        return result.version

    def close(self) -> None:
        self.receiver.close()
