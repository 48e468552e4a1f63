"""Keep the memory a training step frees in the process, instead of handing it back to the kernel each time.

glibc's malloc serves every block above its mmap threshold (128 KB, raised as such blocks are freed, to at most
32 MB) with a fresh mapping and unmaps it on free. A step allocates the same large, short-lived tensors again and
again (logits and their gradient, received messages, attention scores, each backward's temporaries), so every
micro-batch page-faults them in anew: on the 2-stage loopback benchmark that cost our engine 18% of its step time
(0.404 -> 0.330 s a step; benchmarks/RESULTS.md, "Faster than DeepSpeed"). Raising the mmap and trim thresholds
keeps freed blocks in the heap for reuse, as a GPU caching allocator does: the process holds on to what it freed
(up to its peak) instead of returning it to the kernel between micro-batches. A 4-bit base's run does the opposite
(`map_large_blocks`): its dequantized weights, one of each layer's sizes per matmul, are mapped and unmapped.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
KEEP_UP_TO = 1 << 30  # blocks of a GiB and more are still mapped and unmapped (an AQ-SGD buffer lives for the run)
MAP_FROM = 1 << 20  # a 4-bit base's: blocks of a MiB and more mapped and unmapped (map_large_blocks)
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "LD_PRELOAD")


def keep_freed_memory(limit: int = KEEP_UP_TO) -> bool:
    """Raise glibc's mmap and trim thresholds to `limit` bytes; False where that is not glibc or the user has
    chosen the allocator's settings (or another allocator) through the environment."""
    return _thresholds(mmap=limit, trim=limit)


def map_large_blocks(limit: int = MAP_FROM) -> bool:
    """Serve every block of `limit` bytes and more from a mapping of its own, returned to the kernel when freed, for
    good: glibc otherwise raises the threshold to each mapped block it frees (to 32 MB at most), so a 4-bit base's
    dequantized weights (one per matmul, forward and backward, 2-32 MB at width 2048) come from the heap after the
    first, which they fragment and grow (+0.1-0.15 GB a rank at width 2048; benchmarks/RESULTS.md, "QLoRA"). A
    4-bit base takes this instead of `keep_freed_memory`, whose reuse would hold every size at once. False where
    that is not glibc or the user chose the allocator's settings."""
    return _thresholds(mmap=limit)


def _thresholds(**values: int) -> bool:
    """mallopt's thresholds by name (mmap, trim), each fixed (glibc then no longer moves them as blocks are freed);
    False where that is not glibc or the user has chosen the allocator's settings through the environment."""
    if any(os.environ.get(name) for name in USER_SETTINGS):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    numbers = {"mmap": M_MMAP_THRESHOLD, "trim": M_TRIM_THRESHOLD}
    return all(bool(mallopt(numbers[key], value)) for key, value in values.items())


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
