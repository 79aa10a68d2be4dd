"""LoRA adapter versions served by one vLLM engine, driven from the process
that holds the engine (``vllm.LLM``, or anything with ``collective_rpc``).

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
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from vllm.lora.request import LoRARequest

from tensorhub import Hub, HubConfig
from tensorhub_vllm.adapters import adapter_request
from tensorhub_vllm.config import TensorHubAdapterInfo


class AdapterVersions:
    def __init__(self, llm: Any, *, hub: str, model: str, hub_config: dict[str, Any] | None = None) -> None:
        info = {"hub": hub, "hub_config": dict(hub_config or {})}
        TensorHubAdapterInfo.from_dict(info)  # a bad field fails here, before any worker is asked
        self.llm = llm
        self.model = model
        self._hub = Hub.connect(hub, config=HubConfig.from_dict({"name": "vllm-adapters:driver", **info["hub_config"]}))
        self._lock = threading.Lock()
        self._uses: dict[int, int] = {}  # resident version -> open uses
        self._retired: set[int] = set()
        self.current: int | None = None
        llm.collective_rpc("tensorhub_adapters_init", args=(info,))

    def load(self, version: int | Literal["latest"] = "latest") -> LoRARequest:
        """Every worker pulls ``version`` (``"latest"`` is resolved here once,
        so all workers load the same one) and registers it; it becomes
        current, and older versions are retired (dropped when their last use
        ends, or by the next load where none is open).
        On an error (lost holder, checksum mismatch, an adapter the engine
        cannot serve) it raises and the current version stays current and served."""
        v = self._hub.latest(self.model) if version == "latest" else version
        # Retired versions no use holds go with this load's RPC; out of
        # _uses first, so no use() can take them meanwhile.
        with self._lock:
            drops = sorted(u for u in self._retired if self._uses.get(u) == 0 and u != v)
            for u in drops:
                self._retired.discard(u)
                del self._uses[u]
        try:
            self.llm.collective_rpc("tensorhub_adapters_load", args=(self.model, v, drops))
        except BaseException:
            # A worker that did load it drops it again (all or none); one that
            # failed before its drops (the RPC never reached it) drops them now.
            self._drop_all(drops if v in self._uses else [*drops, v])
            raise
        with self._lock:
            self._uses.setdefault(v, 0)
            self._retired.discard(v)
            self._retired.update(u for u in self._uses if u != v)
            self.current = v
        return adapter_request(self.model, v)

    def request(self, version: int | None = None) -> LoRARequest:
        """The ``lora_request`` of a resident version (default: the current one).
        Use ``use`` instead where a later ``load`` may run before the request ends."""
        v = self._resident(version)
        return adapter_request(self.model, v)

    @contextmanager
    def use(self, version: int | None = None) -> Iterator[LoRARequest]:
        """Hold a resident version (default: the current one) while its
        requests run: it is not dropped before the last use ends."""
        with self._lock:
            v = self._resident(version)
            self._uses[v] += 1
        try:
            yield adapter_request(self.model, v)
        finally:
            with self._lock:
                self._uses[v] -= 1
            self._drain()

    def resident(self) -> list[int]:
        with self._lock:
            return sorted(self._uses)

    def _resident(self, version: int | None) -> int:
        v = self.current if version is None else version
        if v is None or v not in self._uses:
            raise LookupError(f"adapter {self.model!r} version {v} is not resident here (resident: "
                              f"{sorted(self._uses)}); load it first")
        return v

    def _drain(self) -> None:
        with self._lock:
            done = sorted(v for v in self._retired if self._uses.get(v) == 0)
            for v in done:
                self._retired.discard(v)
                del self._uses[v]
        if done:
            self._drop_all(done)

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
