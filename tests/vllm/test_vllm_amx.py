"""On CPUs with AMX, vLLM's bf16 CPU attention runs AMX tile instructions
without asking Linux for the tile state first, and the process dies with
SIGILL at its first generation. Our ``vllm.general_plugins`` entry point asks
in every vLLM process: checked here in a fresh process, as vLLM loads it.
The crash itself is what the engine tests of this suite hit first on such a CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tensorhub_vllm import cpu_amx

# A fresh interpreter: the AMX permission is per process and cannot be withdrawn,
# so this test process (which may have asked already) cannot show it.
LOAD_PLUGINS_AS_VLLM_DOES = """
from tensorhub_vllm.cpu_amx import amx_permitted
before = amx_permitted()
from vllm.plugins import load_general_plugins
load_general_plugins()
print(before, amx_permitted())
"""


def _fresh(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


@pytest.mark.skipif(not cpu_amx.amx_supported(), reason="this CPU has no AMX tile data (amx_tile): nothing to request")
def test_vllm_plugins_request_amx_state():
    before, after = _fresh(LOAD_PLUGINS_AS_VLLM_DOES)
    assert after == "True", f"AMX state not requested by the plugins (before loading them: {before})"


def test_request_is_harmless_without_amx():
    """Everywhere: asking twice is fine, and on a CPU without AMX nothing is asked."""
    first = cpu_amx.request_amx_tile_state()
    assert cpu_amx.request_amx_tile_state() == first == cpu_amx.amx_supported()
    assert cpu_amx.amx_permitted() == cpu_amx.amx_supported()
