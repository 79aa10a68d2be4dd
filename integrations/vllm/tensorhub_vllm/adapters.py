"""LoRA adapter versions on one vLLM worker, served from memory.

A request names an adapter version through its ``LoRARequest``
(``adapter_request``): name ``<model>@<version>``, an id of its own per
version, and the path ``tensorhub://<model>@<version>``, which no file backs.
The worker pulls the version (``load``), keeps its tensors, and registers it
with vLLM; vLLM's loader is routed to those tensors for our paths
(``vllm_internals.serve_adapters_from``), so whenever vLLM (re)loads the
adapter, on first use, after its LRU cache evicted it, or after a base-weight
update emptied that cache, it comes from this memory, never from disk.

Distinct ids and paths per version keep versions apart everywhere vLLM keys
adapter state: its adapter cache (by id) and its prefix cache (by name and
path), so a new version never reuses KV blocks computed with another.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any

from vllm.lora.request import LoRARequest

from tensorhub import Hub, HubConfig
from tensorhub.lora import AdapterStaging, PulledAdapter, pull_adapter
from tensorhub_vllm.adapter_parts import AdapterParts
from tensorhub_vllm.config import TensorHubAdapterInfo
from tensorhub_vllm.vllm_internals import lora_manager_of, lora_model_from_tensors, serve_adapters_from

log = logging.getLogger(__name__)

SCHEME = "tensorhub://"


def adapter_name(model: str, version: int) -> str:
    return f"{model}@{version}"


def adapter_id(model: str, version: int) -> int:
    """vLLM's int id of an adapter version: the same in every process (a
    hash, not a counter), distinct per (model, version), in [1, 2**31)."""
    digest = hashlib.blake2b(adapter_name(model, version).encode(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "big") % (2**31 - 2)


def adapter_request(model: str, version: int) -> LoRARequest:
    """What a generate call passes as ``lora_request`` to use this version."""
    return LoRARequest(adapter_name(model, version), adapter_id(model, version), SCHEME + adapter_name(model, version))


class WorkerAdapters:
    """The adapter versions one worker holds in memory."""

    def __init__(self, worker: Any, info: TensorHubAdapterInfo) -> None:
        self.worker = worker
        self.manager = lora_manager_of(worker)
        rank = getattr(worker, "rank", 0)
        # Exact reads unless told otherwise: at TP > 1 a worker keeps a column
        # part of each row-parallel layer's A, r short rows; read as whole rows
        # (the hub's choice over shared memory) they cost twice their bytes
        # and measured no faster (docs/history/vllm.md, LoRA at TP=2).
        self.hub = Hub.connect(info.hub, config=HubConfig.from_dict(
            {"name": f"vllm-adapters:rank{rank}:{os.getpid()}", "read_cost": "exact", **info.hub_config}))
        # At TP > 1, only the part of each matrix this worker's LoRA layers keep.
        self.parts = AdapterParts(self.manager)
        # Per adapter model: the buffer its versions land in, registered and planned once
        self.staging: dict[str, AdapterStaging] = {}
        self.held: dict[int, PulledAdapter] = {}  # adapter id -> its pulled tensors and settings
        self.last: dict[str, Any] = {}  # stats of the last load
        serve_adapters_from(self.manager, SCHEME, self._build)

    def _build(self, request: LoRARequest):
        pulled = self.held.get(request.lora_int_id)
        if pulled is None:
            raise ValueError(f"tensorhub: adapter {request.lora_name!r} is not held by this worker "
                             "(load it first with AdapterVersions.load; a dropped version cannot come back)")
        return lora_model_from_tensors(self.manager, request.lora_int_id, pulled.tensors, pulled.config.to_peft_dict())

    def load(self, model: str, version: int) -> int:
        """Pull ``version`` of adapter ``model`` and register it with vLLM
        (built and checked against the engine's LoRA limits now, not at the
        first request). On any error nothing changes: the versions this
        worker held stay held and served."""
        request = adapter_request(model, version)
        if request.lora_int_id in self.held:
            return version
        start = time.perf_counter()
        pulled = pull_adapter(self.hub, model, version, parts=self.parts, staging=self.staging.setdefault(model, {}))
        pull_s = time.perf_counter() - start
        self.held[request.lora_int_id] = pulled
        try:
            self.worker.add_lora(request)
        except BaseException:
            del self.held[request.lora_int_id]
            raise
        self.last = {"version": version, "nbytes": pulled.result.nbytes, "read_bytes": pulled.result.read_bytes,
                     "adapter_nbytes": pulled.nbytes, "parts": self._parts_of(pulled), "pull_s": pull_s,
                     "register_s": time.perf_counter() - start - pull_s,
                     "bytes_by_source": dict(pulled.result.bytes_by_source), "path": pulled.result.path}
        log.info("tensorhub: adapter %s loaded (%d bytes; pull %.3fs)", request.lora_name, pulled.result.nbytes, pull_s)
        return version

    def _parts_of(self, pulled: PulledAdapter) -> dict[str, list[list[int]]]:
        """The box of each matrix this worker read (absent: whole)."""
        out = {}
        for name, t in pulled.tensors.items():
            box = self.parts(name, tuple(t.shape), t.dtype)
            if box is not None:
                out[name] = [list(r) for r in box]
        return out

    def drop(self, model: str, version: int) -> bool:
        """Forget ``version``: out of vLLM's adapter cache and out of memory."""
        lora_id = adapter_id(model, version)
        self.worker.remove_lora(lora_id)
        return self.held.pop(lora_id, None) is not None

    def held_ids(self) -> list[int]:
        return sorted(self.held)

    def close(self) -> None:
        self.hub.close()
