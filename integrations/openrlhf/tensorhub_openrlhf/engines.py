"""Rollout engines that load weights from TensorHub.

``create_vllm_engines`` is OpenRLHF's own function, run unchanged, with its
engine class swapped for ``TensorHubRolloutRayActor`` for the duration of the
call (OpenRLHF builds the engine's arguments, the worker extension among them,
inside that function, so swapping the class is the one seam). Each engine,
when it starts:

* passes TensorHub's worker extension to vLLM (``TensorHubWorkerWrap``, which
  keeps OpenRLHF's ``WorkerWrap`` methods), and ``TENSORHUB_VLLM_QUANTIZATION``
  as vLLM's ``quantization`` where it is set (OpenRLHF has no flag for it);
* connects its workers to the hub, settings from ``TENSORHUB_*``;
* loads the newest version if there is one: an engine added or restarted
  between steps catches up by itself, with no group to rebuild.

The trainer then calls ``tensorhub_update(version)`` on every engine once per
step; a dead or slow engine is logged and left behind (``update_engines``).

With ``TENSORHUB_LORA=1`` the model key names adapter versions: the engine
runs with vLLM's LoRA on, ``tensorhub_update`` loads the adapter version into
its workers' memory (``tensorhub_vllm``'s ``AsyncAdapterVersions``, no file),
and every ``generate`` OpenRLHF's executors make names the newest version
loaded (``_AdapterRequests``: a request keeps the version it started with, the
one before stays resident until its last request ends). Before the first
version the engine generates with its base alone, which is what a fresh PEFT
adapter (B = 0) gives.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import ray
from openrlhf.trainer.ray import vllm_engine

from tensorhub import VersionNotFound
from tensorhub_openrlhf.settings import TensorHubSettings

log = logging.getLogger(__name__)

WORKER_EXTENSION = "tensorhub_openrlhf.worker.TensorHubWorkerWrap"
_STOCK_CREATE = vllm_engine.create_vllm_engines


def engine_args(kwargs: dict[str, Any], settings: TensorHubSettings) -> dict[str, Any]:
    """The keyword arguments of OpenRLHF's engine actor, which it hands to
    ``vllm.AsyncEngineArgs``, with ours: the worker extension, and vLLM's
    ``quantization`` where ``TENSORHUB_VLLM_QUANTIZATION`` sets it."""
    return {**kwargs, "worker_extension_cls": WORKER_EXTENSION, **settings.vllm_engine_args()}


class _TensorHubRolloutRayActor(vllm_engine.RolloutRayActor.__ray_actor_class__):
    """OpenRLHF's engine actor, whose workers pull versions from TensorHub."""

    async def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings = TensorHubSettings.from_env()
        await super().__init__(*args, **engine_args(kwargs, settings))
        from tensorhub.server.ray_actor import resolve_address

        address = resolve_address(settings.address)
        self.tensorhub_adapters: Any = None
        if settings.lora:  # the model key names adapter versions: not weights of this engine's base
            await self._start_adapters(settings, address)
            return
        info = settings.engine_init_info(f"openrlhf-engine-{uuid.uuid4().hex[:8]}")
        info["hub"] = address
        await self.llm.collective_rpc("tensorhub_init", args=(info,))
        (self.tensorhub_loaded,) = set(await self.llm.collective_rpc("tensorhub_update_if_any"))
        if self.tensorhub_loaded is not None:
            log.info("tensorhub: engine started at version %d", self.tensorhub_loaded)

    async def _start_adapters(self, settings: TensorHubSettings, address: str) -> None:
        """LoRA: the workers' adapter side, the newest adapter version if
        there is one, and OpenRLHF's generate calls naming it."""
        from tensorhub_vllm.adapter_versions import AsyncAdapterVersions

        info = settings.adapter_init_info()
        self.tensorhub_adapters = await AsyncAdapterVersions.start(self.llm, hub=address, model=settings.model,
                                                                   hub_config=info["hub_config"])
        self.llm = _AdapterRequests(self.llm, self.tensorhub_adapters)
        with contextlib.suppress(VersionNotFound):  # nothing published yet: the base alone until the first step
            await self.tensorhub_adapters.load("latest")
        self.tensorhub_loaded = self.tensorhub_adapters.current
        if self.tensorhub_loaded is not None:
            log.info("tensorhub: engine started serving adapter %r version %d", settings.model, self.tensorhub_loaded)

    async def init_process_group(self, *args: Any, **kwargs: Any) -> None:
        """No weight-sync group: the trainer never asks for one (its subclass
        skips it), and an engine has nothing to join."""

    async def tensorhub_update(self, version: int) -> int:
        """Load ``version`` on every worker (a group pull: all get the same one)
        and drop prefix-cache entries computed with the old weights. With
        LoRA, the adapter version (a new adapter name and id per version: no
        prefix-cache entry of another version is reused, none is dropped)."""
        if self.tensorhub_adapters is not None:
            await self.tensorhub_adapters.load(version)
            self.tensorhub_loaded = version
            return version
        loaded = set(await self.llm.collective_rpc("tensorhub_update", args=(version,)))
        if len(loaded) != 1:
            raise RuntimeError(f"tensorhub: the workers of one engine loaded different versions {sorted(loaded)}")
        await self.llm.reset_prefix_cache()
        (self.tensorhub_loaded,) = loaded
        return self.tensorhub_loaded

    async def tensorhub_version(self) -> int | None:
        """The version every worker of this engine serves (None before the first)."""
        if self.tensorhub_adapters is not None:
            return self.tensorhub_adapters.current
        versions = set(await self.llm.collective_rpc("tensorhub_version"))
        return versions.pop() if len(versions) == 1 else None

    async def tensorhub_stats(self) -> list[dict[str, float]]:
        return await self.llm.collective_rpc("tensorhub_stats")


class _AdapterRequests:
    """vLLM's async engine as OpenRLHF's actor holds it (``self.llm``), every
    ``generate`` naming the newest adapter version loaded and holding it
    until the request ends; everything else is the engine's own."""

    def __init__(self, llm: Any, adapters: Any) -> None:
        self._llm, self._adapters = llm, adapters

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        if self._adapters.current is None or kwargs.get("lora_request") is not None:
            async for output in self._llm.generate(*args, **kwargs):
                yield output
            return
        async with self._adapters.use() as lora:
            async for output in self._llm.generate(*args, **{**kwargs, "lora_request": lora}):
                yield output


TensorHubRolloutRayActor = ray.remote(_TensorHubRolloutRayActor)


@contextlib.contextmanager
def _engine_class(cls: Any) -> Iterator[None]:
    stock = vllm_engine.RolloutRayActor
    vllm_engine.RolloutRayActor = cls
    try:
        yield
    finally:
        vllm_engine.RolloutRayActor = stock


def create_vllm_engines(*args: Any, **kwargs: Any) -> list[Any]:
    """OpenRLHF's ``create_vllm_engines`` (same arguments), every engine a
    ``TensorHubRolloutRayActor``."""
    with _engine_class(TensorHubRolloutRayActor):
        return _STOCK_CREATE(*args, **kwargs)


def update_engines(engines: Sequence[Any], version: int, timeout_s: float) -> dict[str, Any]:
    """Ask every engine to load ``version`` and wait up to ``timeout_s`` for
    all of them. Engines pull in parallel (and from each other as chunks land).
    A dead engine, or one still pulling at the deadline, is logged and left
    behind: it catches up at the next step or when it restarts."""
    start = time.perf_counter()
    refs = {engine.tensorhub_update.remote(version): i for i, engine in enumerate(engines)}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    loaded, failed = [], {}
    for ref in ready:
        try:
            ray.get(ref)
            loaded.append(refs[ref])
        except (ray.exceptions.RayError, RuntimeError) as e:  # dead actor, or the pull raised in it
            failed[refs[ref]] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    for ref in pending:
        failed[refs[ref]] = f"still loading after {timeout_s:.0f}s"
        ray.cancel(ref)
    for i, why in sorted(failed.items()):
        log.warning("tensorhub: engine %d did not load version %d (%s); training goes on without waiting for it",
                    i, version, why)
    return {"loaded": sorted(loaded), "failed": failed, "seconds": time.perf_counter() - start}
