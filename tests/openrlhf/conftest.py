"""Fixtures of the OpenRLHF suite. (No __init__.py: OpenRLHF's wheel, like
verl's, installs a top-level ``tests`` package, which ours must not shadow.)

OpenRLHF 0.11.2 imports flash-attn at the top of its model code, and flash-attn
has no CPU build: ``gpu_stand_ins/`` provides the names it imports (each raises
if called) and goes on ``sys.path`` here and on ``PYTHONPATH`` for the Ray
workers and subprocesses the tests start.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
STAND_INS = HERE / "gpu_stand_ins"
sys.path[:0] = [str(STAND_INS), str(HERE)]
# Before vLLM is imported anywhere: a small KV cache (the default takes most of
# the RAM and the worker is OOM-killed).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def child_pythonpath() -> str:
    """PYTHONPATH for processes the tests start: the stand-ins and this folder."""
    return os.pathsep.join([str(STAND_INS), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The vLLM suite's tiny Qwen2 model and tokenizer, built at test time."""
    sys.path.insert(0, str(HERE.parent / "vllm"))
    from vllm_tiny_model import build

    return build(tmp_path_factory.mktemp("tiny-qwen2"))
