"""Keeps freed host memory in the process, so XLA's per-step buffers do not page-fault every step.

XLA on CPU allocates each step's temporaries with malloc. glibc serves big blocks with fresh
mmap()s and hands freed memory straight back to the kernel, so every step page-faults and
zeroes its working set again; on SmolLM2 that was a third of a decode step. Serving from the
heap and never trimming it keeps those pages mapped. Linux/glibc only; elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Tunes glibc malloc for this process; True if it applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all([mallopt(_M_MMAP_MAX, 0), mallopt(_M_TRIM_THRESHOLD, 2**31 - 1), mallopt(_M_TOP_PAD, 64 << 20)])
