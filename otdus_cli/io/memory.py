"""Keep the process's resident memory bounded while tensors are loaded and freed one by one.

glibc raises its mmap threshold after large blocks are freed, so later tensor-sized buffers come
from the heap and freed ones stay resident: streaming 24 layers then looks like holding 24 layers.
Pinning the threshold makes every large buffer its own mapping, returned to the OS when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
_THRESHOLD_BYTES = 4 * 1024 * 1024
_done = False


def return_freed_tensors_to_os() -> None:
    """Idempotent; a no-op where the C library is not glibc."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return
    _done = True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD_BYTES)
    except (OSError, AttributeError):  # musl or an unusual libc: keep its defaults
        pass
