"""SIGTERM, what schedulers, Kubernetes and torchrun send to stop a job, ends a run as Ctrl-C does: the
same clean-up of half-written files and the same one line, instead of a silent exit that leaves them.
Training stops at a step's end with a checkpoint there; export stops where it is."""
from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn


@contextmanager
def _on_signal(signum: int, handler) -> Iterator[None]:
    """`handler` for `signum` within the block; only the main thread may set one (elsewhere: no change)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signum) is signal.SIG_IGN:
        yield  # a signal the parent set to be ignored (a shell's background job: SIGINT) stays ignored
        return
    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)


def _on_sigterm(handler):
    return _on_signal(signal.SIGTERM, handler)


_received: list[int] = []  # the signals that stopped this process, for its exit code


def _interrupt(signum, frame):
    _received.append(signum)
    raise KeyboardInterrupt


def sigterm_as_interrupt():
    """Within the block, SIGTERM raises KeyboardInterrupt in the main thread."""
    return _on_sigterm(_interrupt)


def sigterm_ends_the_process():
    """Within the block, SIGTERM's default: the process ends at once (where a handler could not run: a wait
    inside a collective call)."""
    return _on_sigterm(signal.SIG_DFL)


_stop = threading.Event()


def _request_stop(signum, frame):
    _received.append(signum)
    if _stop.is_set():
        raise KeyboardInterrupt
    _stop.set()


def _interrupt_or_stop(signum, frame):
    # Python drops an exception raised where it cannot propagate (inside a __del__, such as a data loader's
    # clean-up of its workers at a phase's start): should it drop this one, the run still stops, at the
    # step's end.
    _received.append(signum)
    _stop.set()
    raise KeyboardInterrupt


@contextmanager
def sigterm_stops_between_steps() -> Iterator[None]:
    """Within the block, SIGTERM asks a training run to stop after its current step (`stop_requested`),
    where nothing is half done (raising in the middle of a step can land inside a data loader's start);
    a second SIGTERM interrupts at once. Ctrl-C (SIGINT) interrupts at once, and also asks for that stop,
    in case the interruption is lost."""
    _stop.clear()
    _received.clear()
    try:
        with _on_sigterm(_request_stop), _on_signal(signal.SIGINT, _interrupt_or_stop):
            yield
    finally:
        _stop.clear()


def forget_caught_interrupt() -> None:
    """Call where a KeyboardInterrupt was caught and the process then exits with its own code (130, 143).
    CPython marks an interrupt that ends a string exec or eval as unhandled even when a caller catches it
    (dataclasses make their methods so, many while torch imports), and under `python -m` the process then
    dies of SIGINT instead of exiting with its code. Each string exec clears the mark as it starts."""
    exec("pass", {})


def interrupted_exit_code() -> int:
    """128 + the number of the signal that stopped the process, as a shell reports a process killed by it:
    143 for SIGTERM, so that a scheduler tells its own stop from a user's Ctrl-C (130, also the default)."""
    code = 128 + (_received[0] if _received else signal.SIGINT)
    _received.clear()
    return code


def stop_requested() -> bool:
    return _stop.is_set()


@contextmanager
def finishing() -> Iterator[None]:
    """The output is written: what is left (the summary lines) is not cut short by a SIGTERM or Ctrl-C,
    which would otherwise end a finished job with a traceback and 130 or 143."""
    with _on_signal(signal.SIGINT, signal.SIG_IGN), _on_sigterm(signal.SIG_IGN):
        yield


def exit_with(code: int) -> NoReturn:
    """sys.exit(code), a command's last step. After a success its output is written and said: a SIGTERM or
    Ctrl-C while the interpreter ends (up to a second with torch loaded) is ignored: the exit is 0, not 143
    or 130, for the job did not stop short."""
    if code == 0 and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)
    sys.exit(code)
