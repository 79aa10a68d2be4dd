"""A CPU platform for verl, for tests only.

verl 0.9.1 has no CPU platform: without an accelerator it falls back to
"nvidia" (device cuda, Ray resource GPU, backend nccl). Loaded in every process
through ``VERL_USE_EXTERNAL_MODULES=verl_cpu_platform`` and selected with
``VERL_PLATFORM=cpu``, this registers one that runs on gloo and host memory.
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


def _device_module() -> types.ModuleType:
    """``torch.cpu`` plus what verl calls on ``torch.cuda`` and ``torch.cpu`` lacks."""
    module = types.ModuleType("verl_cpu_device")
    module.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    module.empty_cache = noop
    module.reset_peak_memory_stats = noop
    module.memory_allocated = lambda *args, **kwargs: 0
    module.memory_reserved = lambda *args, **kwargs: 0
    module.max_memory_allocated = lambda *args, **kwargs: 0
    module.max_memory_reserved = lambda *args, **kwargs: 0
    module.mem_get_info = lambda *args, **kwargs: (16 << 30, 24 << 30)  # (free, total): plenty, on paper
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.set_device = noop
    module.current_device = lambda: "cpu"
    return module


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    _module = _device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._module

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:  # type: ignore[override]
        # verl passes this to .to(device=...): an index would mean cuda:0.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        """Nothing to do without an accelerator."""

    def synchronize(self, device_index: int | None = None) -> None:
        """Nothing to do without an accelerator."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        """Nothing to do without an accelerator."""

    def empty_cache(self) -> None:
        """Nothing to do without an accelerator."""

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CPU_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):  # type: ignore[no-untyped-def]
        yield

    def profiler_start(self) -> None:
        """Nothing to do without an accelerator."""

    def profiler_stop(self) -> None:
        """Nothing to do without an accelerator."""

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
