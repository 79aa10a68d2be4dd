"""One control message per engine and step: vLLM's workers share their
engine's Resolve, their relays' announces and their last reports over the
engine's own CPU group (vLLM's world group among its TP workers), the first
worker sending each for all (``tensorhub.client.engineshare`` draws the
protocol; this module only finds the group)."""

from __future__ import annotations

from tensorhub.client.engineshare import EngineShare
from tensorhub_vllm.vllm_internals import engine_cpu_group


def engine_share(world_size: int, *, model: str, engine: str, pull_timeout_s: float) -> EngineShare | None:
    """The share among this engine's ``world_size`` workers, or None when it
    is one worker or its CPU group spans more than this engine."""
    found = engine_cpu_group(world_size)
    if found is None:
        return None
    return EngineShare(*found, model=model, engine=engine, pull_timeout_s=pull_timeout_s)
