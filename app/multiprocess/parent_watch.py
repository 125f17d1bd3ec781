"""A process of the multi-process server ends with its launcher, however the launcher dies (`kill -9`
included): otherwise a supervisor restarting the server piles up engines holding GPU memory."""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_parent(parent_pid: int, stop_signal: int = signal.SIGTERM) -> None:
    """The kernel sends this process `stop_signal` (its orderly stop) when its parent dies; Linux only."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, stop_signal)
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os.kill(os.getpid(), stop_signal)


def remove_if_orphaned(parent_pid: int, run_folder: str) -> None:
    """The launcher removes its run folder (the engine socket, metric files) when it stops. When it died
    first, each of its processes removes it at its own end: the last to end leaves nothing behind."""
    if os.getppid() != parent_pid:
        shutil.rmtree(run_folder, ignore_errors=True)
