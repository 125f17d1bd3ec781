"""SIGTERM, what schedulers, Kubernetes and torchrun send to stop a job, ends a run as Ctrl-C does: the
same clean-up of half-written files and the same one line, instead of a silent exit that leaves them.
Training stops at a step's end with a checkpoint there; export stops where it is."""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt in the main thread (elsewhere: no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_stop = threading.Event()


@contextmanager
def sigterm_stops_between_steps() -> Iterator[None]:
    """Within the block, SIGTERM asks a training run to stop after its current step (`stop_requested`),
    where nothing is half done (raising in the middle of a step can land inside a data loader's start);
    a second SIGTERM interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request(signum, frame):
        if _stop.is_set():
            raise KeyboardInterrupt
        _stop.set()

    _stop.clear()
    previous = signal.signal(signal.SIGTERM, request)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop.clear()


def stop_requested() -> bool:
    return _stop.is_set()
