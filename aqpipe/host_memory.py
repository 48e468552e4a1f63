"""Keep the memory a training step frees in the process, instead of handing it back to the kernel each time.

glibc's malloc serves every block above its mmap threshold (128 KB, raised as such blocks are freed, to at most
32 MB) with a fresh mapping and unmaps it on free. A step allocates the same large, short-lived tensors again and
again (logits and their gradient, received messages, attention scores, each backward's temporaries), so every
micro-batch page-faults them in anew: on the 2-stage loopback benchmark that cost our engine 18% of its step time
(0.404 -> 0.330 s a step; benchmarks/RESULTS.md, "Faster than DeepSpeed"). Raising the mmap and trim thresholds
keeps freed blocks in the heap for reuse, as a GPU caching allocator does: the process holds on to what it freed
(up to its peak) instead of returning it to the kernel between micro-batches.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
KEEP_UP_TO = 1 << 30  # blocks of a GiB and more are still mapped and unmapped (an AQ-SGD buffer lives for the run)
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD")


def keep_freed_memory(limit: int = KEEP_UP_TO) -> bool:
    """Raise glibc's mmap and trim thresholds to `limit` bytes; False where that is not glibc or the user has
    chosen the allocator's settings (or another allocator) through the environment."""
    if any(os.environ.get(name) for name in USER_SETTINGS):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, limit)) and bool(mallopt(M_TRIM_THRESHOLD, limit))


def release_freed_memory() -> bool:
    """Hand the kernel back what the process freed so far (glibc's malloc_trim): after set-up, whose temporaries
    (a 4-bit base's quantization, one tensor at a time) the kept thresholds would otherwise hold for the whole run.
    False where that is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        return bool(ctypes.CDLL(name).malloc_trim(0))
    except (OSError, AttributeError):
        return False
