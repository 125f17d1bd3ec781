"""Stop signals held from a child's start until it handles them.

Ctrl-C reaches every process of the terminal's group, the ones still starting too: a worker importing
its modules or building its app would die there in a KeyboardInterrupt traceback, and a SIGTERM could
land between two handlers and be lost. So a child starts with its stop signals blocked (SIGINT, SIGTERM
and the launcher's own, SIGUSR1; the signal mask is inherited across fork and exec, and a blocked signal
stays pending, not lost) and releases them once its own handlers are in place: a stop that came during
its start is then handled as any other."""
from __future__ import annotations

import multiprocessing
import signal

# How the launcher stops its engine and HTTP worker processes. A SIGTERM to the whole process group
# (systemd, `timeout`, `kill -- -PGID`) reaches them with the launcher; they ignore it, and the launcher
# stops them in order: it stops accepting, then the workers drain, then the engines stop.
LAUNCHER_STOP_SIGNAL = signal.SIGUSR1
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, LAUNCHER_STOP_SIGNAL}


def start_with_stop_signals_held(process: multiprocessing.Process) -> None:
    """process.start(), the child holding its stop signals until it calls release_stop_signals()."""
    # Blocked in this thread only, for the moment of the start: a signal for this process meanwhile is
    # delivered once the mask is restored (or to another thread), never lost.
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def release_stop_signals() -> None:
    """Delivers the stop signals that came while they were held, to the handlers now installed."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
