"""`python -m app --workers N` (N > 1): one engine process per GPU (one in all without `cuda_device_ids`)
and N HTTP worker processes on one port.

An engine process (engine_process.py) owns an ONNX Runtime session and its batcher; this process
binds the port and hands each connection to the next HTTP worker (http_workers.py), which tokenise,
encode answers and reach the engine over a Unix socket. Python's per-request work is what limits one
process; the GPU wants large batches on one CUDA context. Metrics of every process are summed (prometheus_client's multiprocess mode)."""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

from app.metrics import MULTIPROC_DIR_VAR, use_metrics_folder
from app.multiprocess.cpu_cores import describe, split_cores
from app.multiprocess.engine_process import CANNOT_SERVE_EXIT
from app.multiprocess.engine_process import run as run_engine
from app.multiprocess.held_signals import LAUNCHER_STOP_SIGNAL, start_with_stop_signals_held
from app.multiprocess.http_workers import ENGINE_SOCKET_VAR, HttpWorkers, worker_stop_s
from app.settings import ENV_PREFIX, Settings
from app.uvicorn_server import listening_socket

log = logging.getLogger("app")
_MAX_FOLDER_CHARS = 80  # leaves room for "/engine99.sock" within AF_UNIX's 108-byte limit
_ENGINE_START_S = 600  # loading a large graph and its first CUDA forward pass can take minutes


def serve_with_workers(settings: Settings, flags: dict[str, str], device: str) -> int:
    """`device`: where the engines run (resolved from settings.device)."""
    # Workers and engines build their settings from the environment, so the flags travel as variables.
    os.environ.update({ENV_PREFIX + name.upper(): value for name, value in flags.items()})
    stopping = threading.Event()  # a stop signal from here on, while the engines load too, is an orderly stop
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        engine_cores, worker_cores = _cores(settings, device)
    except ValueError as e:
        log.error("%s", e)
        return 2
    with run_folder() as folder:
        sockets = [str(folder / f"engine{i}.sock") for i in range(len(settings.engine_devices))]
        engines = [_start_engine(path, gpu, cores)
                   for path, gpu, cores in zip(sockets, settings.engine_devices, engine_cores)]
        os.environ[ENGINE_SOCKET_VAR] = ",".join(sockets)
        ready = False
        try:
            if not all(_wait_for_socket(engine, path, stopping) for engine, path in zip(engines, sockets)):
                # an engine that said why it cannot serve the model: its status (as `python -m app`'s own checks)
                return (0 if stopping.is_set() else CANNOT_SERVE_EXIT
                        if any(e.exitcode == CANNOT_SERVE_EXIT for e in engines) else 1)
            ready = True
            for engine in engines:
                threading.Thread(target=_stop_if_engine_dies, args=(engine, stopping), daemon=True).start()
            with listening_socket(settings.host, settings.port) as listener:
                host = f"[{settings.host}]" if ":" in settings.host else settings.host
                log.info("listening on http://%s:%d: %d HTTP workers, %d engine process(es)", host,
                         listener.getsockname()[1], settings.workers, len(engines))
                HttpWorkers(settings.workers, worker_stop_s(settings), worker_cores).serve(listener, stopping)
        finally:
            stopping.set()
            for engine in engines:
                if engine.is_alive():  # it finishes running batches and exits
                    os.kill(engine.pid, LAUNCHER_STOP_SIGNAL)
            for engine in engines:
                engine.join(30)
                if engine.is_alive():
                    engine.kill()
                    engine.join()
                if engine.exitcode != 0 and ready:  # before, _wait_for_socket said so
                    log.error("the engine process exited with %s (%s)", engine.exitcode, engine.name)
    return 0 if all(engine.exitcode == 0 for engine in engines) else 1


def _cores(settings: Settings, device: str) -> tuple[list[frozenset[int] | None], frozenset[int] | None]:
    """Each engine process's cores and the HTTP workers' (engine_cores; None: any core). ValueError when
    this process may not use enough cores for them."""
    engines = len(settings.engine_devices)
    if not settings.engine_cores:
        return [None] * engines, None
    if device != "cuda":  # device auto on a machine without CUDA: the engine needs every core it can get
        log.warning("engine_cores applies to CUDA engines; these run on the %s, on any core", device)
        return [None] * engines, None
    engine_cores, worker_cores = split_cores(os.sched_getaffinity(0), engines, settings.engine_cores)
    log.info("engine process(es) on cores %s; HTTP workers on cores %s",
             " / ".join(describe(c) for c in engine_cores), describe(worker_cores))
    return engine_cores, worker_cores


def _start_engine(socket_path: str, cuda_device_id: int, cores: frozenset[int] | None) -> multiprocessing.Process:
    engine = multiprocessing.get_context("spawn").Process(target=run_engine, name=f"bertserve-engine-{cuda_device_id}",
                                                          args=(socket_path, os.getpid(), cuda_device_id, cores))
    start_with_stop_signals_held(engine)
    return engine


@contextlib.contextmanager
def run_folder():
    """A temporary folder for the engine socket and, unless PROMETHEUS_MULTIPROC_DIR names one, the
    metric files; removed on exit. A given metrics folder is emptied first: values of an earlier run
    must not count."""
    # mkdtemp makes it 0700: only this user's processes reach the socket (the engine answers whoever connects).
    folder = Path(tempfile.mkdtemp(prefix="bertserve-run-"))
    if len(str(folder)) > _MAX_FOLDER_CHARS:  # a long TMPDIR: a socket path has room for 107 bytes in all
        folder.rmdir()
        folder = Path(tempfile.mkdtemp(prefix="bertserve-run-", dir="/tmp"))
    given = os.environ.get(MULTIPROC_DIR_VAR)
    use_metrics_folder(Path(given) if given else folder / "metrics")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _wait_for_socket(engine: multiprocessing.Process, socket_path: str, stopping: threading.Event) -> bool:
    """Whether the engine came up (its socket appeared); else, unless a stop signal came, says why (the
    caller stops every engine)."""
    deadline = time.monotonic() + _ENGINE_START_S
    while engine.is_alive() and time.monotonic() < deadline:
        if os.path.exists(socket_path):
            return True
        if stopping.wait(0.05):
            return False
    if engine.is_alive():
        log.error("the engine process %s was not ready after %d s", engine.name, _ENGINE_START_S)
    elif engine.exitcode != CANNOT_SERVE_EXIT:  # that one said why in its `cannot serve` line
        log.error("the engine process %s exited (code %s) before it was ready; see its error above", engine.name,
                  engine.exitcode)
    return False


def _stop_if_engine_dies(engine: multiprocessing.Process, stopping: threading.Event) -> None:
    """Without its engine the server cannot answer: stop the whole server (exit status 1) so that the
    supervisor (Docker, Kubernetes, systemd) restarts it, rather than answering 503 forever. Waits on the
    process's sentinel and never reaps it: a join here raced the main thread's, whose waitpid could then
    find no child and leave `exitcode` None, so a clean stop exited 1."""
    multiprocessing.connection.wait([engine.sentinel])
    if not stopping.is_set():
        log.error("the engine process exited (%s, pid %s); stopping the server", engine.name, engine.pid)
        stopping.set()
