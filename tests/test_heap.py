"""glibc's thresholds set by app.heap: a freed array's memory stays for the next batch (real glibc, real numpy)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

libc = ctypes.CDLL(None)
pytestmark = pytest.mark.skipif(not hasattr(libc, "mallinfo2"), reason="glibc 2.33 or later (mallinfo2) only")

# In a fresh interpreter: how many chunks glibc serves with their own mmap while arrays of 1 and 8 MB live,
# and how much of the heap stays after the 8 MB one is freed.
PROBE = """
import ctypes, sys
import numpy as np
sys.path.insert(0, {root!r})
from app.heap import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
tuned = {tune} and keep_freed_memory()
before = libc.mallinfo2()
small, large = np.ones(1 << 20, np.uint8), np.ones(8 << 20, np.uint8)
mapped = libc.mallinfo2().hblks - before.hblks
del large
kept = libc.mallinfo2().arena - before.arena
print(tuned, mapped, kept)
"""


def probe(tune: bool) -> tuple[bool, int, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's own defaults
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), tune=tune)], capture_output=True,
                         text=True, check=True, env=env).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2])


def test_glibc_default_maps_and_unmaps_each_large_array():
    tuned, mapped, kept = probe(tune=False)
    assert not tuned and mapped == 2  # what keep_freed_memory is for: each array its own mmap


def test_keep_freed_memory_serves_batch_sized_arrays_from_the_heap_and_keeps_them():
    tuned, mapped, kept = probe(tune=True)
    assert tuned
    assert mapped == 0
    assert kept >= 8 << 20  # the freed 8 MB stays in the heap for the next batch
