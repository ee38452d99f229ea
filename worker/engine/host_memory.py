"""Host allocator settings for workers that compute on the CPU.

Every pass allocates and frees the same large activations (logits, MLP intermediates, their gradients).
glibc's defaults hand buffers above a threshold to `mmap` and give freed heap tops back to the kernel,
so every pass touched fresh pages: ~270,000 page faults (~1 GB) per 512-token SmolLM2 pass and
~3,000-4,000 per small-bench step, a fifth to a third of their time (docs/performance.md, session 3).
Keeping freed memory in the heap for reuse costs only what the process already peaked at.

Only glibc is tuned (`mallopt`); elsewhere, or when the operator preloads another allocator (jemalloc,
tcmalloc: `LD_PRELOAD`), this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4

MMAP_THRESHOLD = 32 << 20
"""Buffers below this come from the heap (glibc's ceiling for the setting on 64-bit); with `mmap` switched
off (`M_MMAP_MAX` 0) larger ones do too: SmolLM2's 512-token logits alone are 100 MB."""
TRIM_THRESHOLD = (1 << 31) - 1
"""Free memory at the heap top kept for reuse instead of given back to the kernel (the largest value the
setting takes). At 1 GB a packed call that had freed eight adapters' gradients still trimmed and faulted
some of it back in on the next call."""
TOP_PAD = 64 << 20
"""Extra heap grown at a time, so growing passes do not extend the heap in small steps."""

_tuned = False


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True when glibc accepted all of them."""
    global _tuned
    if _tuned:
        return True
    if "LD_PRELOAD" in os.environ and "malloc" in os.environ["LD_PRELOAD"]:
        return False  # an allocator chosen by the operator: leave it alone
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                (_M_TOP_PAD, TOP_PAD))
    _tuned = all(mallopt(param, value) == 1 for param, value in settings)
    log.debug("host allocator tuned for reuse: %s", _tuned)
    return _tuned


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None  # not glibc (musl has no mallopt), or no C library to load
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt
