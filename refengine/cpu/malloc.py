"""Memory for the CPU engine: glibc malloc thresholds (freed activations stay mapped) and a huge-page KV pool.

A forward pass allocates its activations afresh: NumPy arrays of up to tens of MB at
prefill sizes (2048 tokens x SmolLM2's fused gate/up width is 25 MB). glibc serves every
allocation above its mmap threshold with a fresh ``mmap`` and unmaps it on ``free``, so
each pass faults all those pages in again, and zeroes them. :func:`keep_freed_memory`
raises the threshold to glibc's largest (32 MB on 64-bit) and the heap's trim threshold
to :data:`TRIM_THRESHOLD`, so freed buffers return to the heap and the next pass reuses
them, already mapped. vLLM's CPU backend recommends preloading tcmalloc for the same reason.

Only glibc has ``mallopt``; elsewhere, and when the user set glibc's own variables
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``), nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import platform


#: Allocations up to this size come from the heap (glibc's maximum on 64-bit systems).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of the heap beyond this is returned to the system.
TRIM_THRESHOLD = 256 << 20

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
_applied = False


def keep_freed_memory() -> bool:
    """Apply the thresholds above (once per process); return whether they are in effect."""
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(k in os.environ for k in _USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied


