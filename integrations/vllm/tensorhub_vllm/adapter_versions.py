"""LoRA adapter versions served by one vLLM engine, driven from the process
that holds the engine: ``AdapterVersions`` for ``vllm.LLM`` (or anything with
a blocking ``collective_rpc``), ``AsyncAdapterVersions`` for vLLM's async
engine (``AsyncLLM``, whose ``collective_rpc`` is awaited: OpenRLHF's engine
actors). Both keep their books in ``Residency``.

    adapters = AdapterVersions(llm, hub="10.0.0.1:50051", model="policy/lora/math")
    adapters.load("latest")                       # every worker pulls it into memory, no file
    with adapters.use() as lora:                  # the newest version, held while in use
        llm.generate(prompts, params, lora_request=lora)

Several versions stay resident: ``load`` makes the new version current and
retires the older ones. A retired version is dropped from the workers (vLLM's
adapter cache and our memory) when its last ``use`` ends, or, unused, by the
next ``load``, in the same ``collective_rpc`` (dropped before the pull, so no
more versions are resident at once than with a drop of its own: the previous
version and the new one). One round trip to the workers per update, not two.
Requests in flight therefore finish on the version they started with. The
engine must hold the versions in use at once: ``max_loras`` (and
``max_cpu_loras``) >= the staleness allowed + 1.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Literal

from vllm.lora.request import LoRARequest

from tensorhub import Hub, HubConfig
from tensorhub_vllm.adapters import adapter_request
from tensorhub_vllm.config import TensorHubAdapterInfo


def _driver(hub: str, hub_config: dict[str, Any] | None) -> tuple[dict[str, Any], Hub]:
    """The workers' ``init_info`` (checked: a bad field fails here, before any
    worker is asked) and the driver's own Hub, which resolves ``"latest"``."""
    info = {"hub": hub, "hub_config": dict(hub_config or {})}
    TensorHubAdapterInfo.from_dict(info)
    return info, Hub.connect(hub, config=HubConfig.from_dict({"name": "vllm-adapters:driver", **info["hub_config"]}))


class Residency:
    """Which adapter versions an engine holds and which may go: pure
    bookkeeping, no I/O, shared by the blocking and the async front ends.

        begin_load(v) ─▶ the retired versions no use holds (dropped with v's load, out of the books now)
        loaded(v)      ─▶ v current; every other version retired (dropped when its last use ends)
        failed(v, d)   ─▶ what the workers must drop now so all hold the same: d, and v if it was not resident
        acquire / release(v) ─▶ uses; release returns the retired versions nobody uses any more
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self._lock = threading.Lock()
        self._uses: dict[int, int] = {}  # resident version -> open uses
        self._retired: set[int] = set()
        self.current: int | None = None

    def begin_load(self, version: int) -> list[int]:
        # Out of _uses first, so no use() can take them meanwhile.
        with self._lock:
            drops = sorted(u for u in self._retired if self._uses.get(u) == 0 and u != version)
            for u in drops:
                self._retired.discard(u)
                del self._uses[u]
            return drops

    def loaded(self, version: int) -> None:
        with self._lock:
            self._uses.setdefault(version, 0)
            self._retired.discard(version)
            self._retired.update(u for u in self._uses if u != version)
            self.current = version

    def failed(self, version: int, drops: list[int]) -> list[int]:
        """A load failed: a worker that did load it drops it again (all or
        none); one that failed before its drops (the RPC never reached it)
        drops them now."""
        with self._lock:
            return drops if version in self._uses else [*drops, version]

    def acquire(self, version: int | None) -> int:
        with self._lock:
            v = self._resident(version)
            self._uses[v] += 1
            return v

    def release(self, version: int) -> list[int]:
        with self._lock:
            self._uses[version] -= 1
            done = sorted(v for v in self._retired if self._uses.get(v) == 0)
            for v in done:
                self._retired.discard(v)
                del self._uses[v]
            return done

    def resident(self, version: int | None = None) -> int:
        with self._lock:
            return self._resident(version)

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._uses)

    def _resident(self, version: int | None) -> int:
        v = self.current if version is None else version
        if v is None or v not in self._uses:
            raise LookupError(f"adapter {self.model!r} version {v} is not resident here (resident: {sorted(self._uses)}); "
                              "load it first")
        return v


class AdapterVersions:
    def __init__(self, llm: Any, *, hub: str, model: str, hub_config: dict[str, Any] | None = None) -> None:
        info, self._hub = _driver(hub, hub_config)
        self.llm = llm
        self.model = model
        self._books = Residency(model)
        llm.collective_rpc("tensorhub_adapters_init", args=(info,))

    @property
    def current(self) -> int | None:
        return self._books.current

    def load(self, version: int | Literal["latest"] = "latest") -> LoRARequest:
        """Every worker pulls ``version`` (``"latest"`` is resolved here once,
        so all workers load the same one) and registers it; it becomes
        current, and older versions are retired (dropped when their last use
        ends, or by the next load where none is open).
        On an error (lost holder, checksum mismatch, an adapter the engine
        cannot serve) it raises and the current version stays current and served."""
        v = self._hub.latest(self.model) if version == "latest" else version
        drops = self._books.begin_load(v)  # retired versions no use holds go with this load's RPC
        try:
            self.llm.collective_rpc("tensorhub_adapters_load", args=(self.model, v, drops))
        except BaseException:
            self._drop_all(self._books.failed(v, drops))
            raise
        self._books.loaded(v)
        return adapter_request(self.model, v)

    def request(self, version: int | None = None) -> LoRARequest:
        """The ``lora_request`` of a resident version (default: the current one).
        Use ``use`` instead where a later ``load`` may run before the request ends."""
        return adapter_request(self.model, self._books.resident(version))

    @contextmanager
    def use(self, version: int | None = None) -> Iterator[LoRARequest]:
        """Hold a resident version (default: the current one) while its
        requests run: it is not dropped before the last use ends."""
        v = self._books.acquire(version)
        try:
            yield adapter_request(self.model, v)
        finally:
            self._drop_all(self._books.release(v))

    def resident(self) -> list[int]:
        return self._books.versions()

    def _drop_all(self, versions: list[int]) -> None:
        if versions:
            self.llm.collective_rpc("tensorhub_adapters_drop", args=(self.model, versions))

    def base_updated(self) -> None:
        """Call after every base-weight update. vLLM 0.32 drops its adapters on
        one (they come back from memory by themselves) but keeps the prefix
        cache, so a request naming an adapter version would reuse KV blocks
        computed on the old base (measured in tests/vllm/test_vllm_lora.py)."""
        self.llm.reset_prefix_cache()

    def stats(self) -> list[dict[str, Any]]:
        """Per worker: adapter ids held in memory and in vLLM's cache, and its last load."""
        return self.llm.collective_rpc("tensorhub_adapters_stats")

    def close(self) -> None:
        self.llm.collective_rpc("tensorhub_adapters_close")
        self._hub.close()


class AsyncAdapterVersions:
    """``AdapterVersions`` for vLLM's async engine (``AsyncLLM``), whose
    ``collective_rpc`` is a coroutine: the same rules, awaited. Made with
    ``await AsyncAdapterVersions.start(llm, ...)``."""

    def __init__(self, llm: Any, model: str, hub: Hub) -> None:
        self.llm, self.model, self._hub = llm, model, hub
        self._books = Residency(model)

    @classmethod
    async def start(cls, llm: Any, *, hub: str, model: str,
                    hub_config: dict[str, Any] | None = None) -> AsyncAdapterVersions:
        info, driver = _driver(hub, hub_config)
        try:
            await llm.collective_rpc("tensorhub_adapters_init", args=(info,))
        except BaseException:
            driver.close()
            raise
        return cls(llm, model, driver)

    @property
    def current(self) -> int | None:
        return self._books.current

    async def load(self, version: int | Literal["latest"] = "latest") -> LoRARequest:
        """As ``AdapterVersions.load``; ``"latest"`` with nothing published
        raises VersionNotFound, and nothing changes."""
        v = self._hub.latest(self.model) if version == "latest" else version
        drops = self._books.begin_load(v)
        try:
            await self.llm.collective_rpc("tensorhub_adapters_load", args=(self.model, v, drops))
        except BaseException:
            await self._drop_all(self._books.failed(v, drops))
            raise
        self._books.loaded(v)
        return adapter_request(self.model, v)

    @asynccontextmanager
    async def use(self, version: int | None = None) -> AsyncIterator[LoRARequest]:
        """As ``AdapterVersions.use``."""
        v = self._books.acquire(version)
        try:
            yield adapter_request(self.model, v)
        finally:
            await self._drop_all(self._books.release(v))

    def resident(self) -> list[int]:
        return self._books.versions()

    async def _drop_all(self, versions: list[int]) -> None:
        if versions:
            await self.llm.collective_rpc("tensorhub_adapters_drop", args=(self.model, versions))

    async def close(self) -> None:
        try:
            await self.llm.collective_rpc("tensorhub_adapters_close")
        finally:
            self._hub.close()
