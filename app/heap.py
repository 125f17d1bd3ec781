"""glibc's heap kept for reuse: numpy's arrays of a batch are allocated and freed hundreds of times a second.

By default glibc serves an allocation of 128 KB or more (a batch's padded ids, its packed token offsets,
its output vectors) with a fresh mmap and unmaps it when freed, and trims freed memory off a heap's top
once 128 KB of it is free. Either way every page of the next such array faults in again, zeroed by the
kernel: packing one 75-text batch for a CUDA-graph replay took 590 us in a fresh thread instead of 67
(BENCHMARKS.md, "The replaying thread's own time"). glibc raises these limits by itself only after the
first unmap, per process, and not for a thread's own heap in every case.

`keep_freed_memory()` fixes them with mallopt (glibc's public knob, as MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ would at start-up): arrays under 32 MB come from the heap, and up to 64 MB freed
at a heap's top stays there for the next batch. Elsewhere (macOS, musl) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (half its 64 MB thread heaps)
TRIM_THRESHOLD = 64 << 20


def keep_freed_memory() -> bool:
    """Set glibc's thresholds for this process; whether they were set (False where there is no glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # musl's mallopt does nothing
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
