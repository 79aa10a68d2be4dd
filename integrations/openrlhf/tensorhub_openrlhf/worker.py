"""The class vLLM mixes into each engine worker (``worker_extension_cls``):
OpenRLHF's own ``WorkerWrap`` (so its methods still exist) and TensorHub's
worker extension (``tensorhub_init`` / ``tensorhub_update`` / ...)."""

from __future__ import annotations

from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap
from tensorhub_vllm.extension import TensorHubWorkerExtension

from tensorhub import VersionNotFound


class TensorHubWorkerWrap(WorkerWrap, TensorHubWorkerExtension):
    def tensorhub_update_if_any(self) -> int | None:
        """Load the newest version if the hub has one (an engine that starts
        after training began); None when nothing is published yet."""
        try:
            return self.tensorhub_update("latest")
        except VersionNotFound:
            return None
