"""SIGTERM, what schedulers, Kubernetes and torchrun send to stop a job, ends a run as Ctrl-C does: the
same clean-up of half-written files and the same one line, instead of a silent exit that leaves them.
Training stops at a step's end with a checkpoint there; export stops where it is."""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def _on_sigterm(handler) -> Iterator[None]:
    """`handler` for SIGTERM within the block; only the main thread may set one (elsewhere: no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def sigterm_as_interrupt():
    """Within the block, SIGTERM raises KeyboardInterrupt in the main thread."""
    return _on_sigterm(_interrupt)


_stop = threading.Event()


def _request_stop(signum, frame):
    if _stop.is_set():
        raise KeyboardInterrupt
    _stop.set()


@contextmanager
def sigterm_stops_between_steps() -> Iterator[None]:
    """Within the block, SIGTERM asks a training run to stop after its current step (`stop_requested`),
    where nothing is half done (raising in the middle of a step can land inside a data loader's start);
    a second SIGTERM interrupts at once."""
    _stop.clear()
    try:
        with _on_sigterm(_request_stop):
            yield
    finally:
        _stop.clear()


def stop_requested() -> bool:
    return _stop.is_set()
