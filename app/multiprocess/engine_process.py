"""The engine process of a multi-process server (`workers` > 1): it owns the one ONNX Runtime session
and the batcher, so batches are formed from every HTTP worker's requests on one CUDA context, and serves
the HTTP worker processes over a Unix socket (engine_link). Started and stopped by the launcher."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

from app.backend import EngineInfo
from app.build import UNSERVABLE, build_engine, cannot_serve, load_tokenizer
from app.heap import keep_freed_memory
from app.metrics import Metrics
from app.multiprocess.cpu_cores import pin
from app.multiprocess.engine_link import serve_workers
from app.multiprocess.held_signals import LAUNCHER_STOP_SIGNAL, release_stop_signals
from app.multiprocess.parent_watch import end_with_parent, remove_if_orphaned
from app.multiprocess.worker_files import copy_worker_files, worker_files_dir
from app.settings import Settings, configure_logging
from app.tokenization import TokenizerFileError
from artifact.manifest import ManifestError

log = logging.getLogger("app.engine_process")

CANNOT_SERVE_EXIT = 2  # the engine said why it cannot serve the model, as `python -m app` exits for it


def run(socket_path: str, launcher_pid: int, cuda_device_id: int, cores: frozenset[int] | None = None) -> None:
    """Process entry point (multiprocessing, spawn): settings from BERTSERVE_* variables, as the workers',
    on GPU `cuda_device_id` (one engine process per GPU), on `cores` (engine_cores; None: any)."""
    pin(cores, "the engine process")  # first: every thread made from here on inherits them
    # Ctrl-C, and a SIGTERM to the whole group (systemd, `timeout`, `kill -- -PGID`), reach this process
    # with the launcher and the HTTP workers. The workers then drain through this engine: it stops only
    # when `python -m app` says so (LAUNCHER_STOP_SIGNAL), after the workers have answered what they hold,
    # or when the launcher dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(LAUNCHER_STOP_SIGNAL, lambda *_: sys.exit(0))  # until the event loop handles it
    release_stop_signals()
    end_with_parent(launcher_pid, LAUNCHER_STOP_SIGNAL)
    keep_freed_memory()
    settings = Settings(cuda_device_id=cuda_device_id)
    configure_logging(settings)
    with contextlib.suppress(ImportError):
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        device_lost = asyncio.run(_serve(settings, socket_path))
    except UNSERVABLE as e:  # one line, not a traceback: the launcher adds none and exits with the same status
        print(cannot_serve(settings.model_dir, e), file=sys.stderr, flush=True)
        sys.exit(CANNOT_SERVE_EXIT)
    finally:
        remove_if_orphaned(launcher_pid, os.path.dirname(socket_path))
    if device_lost:
        sys.exit(1)  # the launcher sees its engine die and stops the server, for its supervisor to restart


async def _serve(settings: Settings, socket_path: str) -> bool:
    """Serves the HTTP workers until LAUNCHER_STOP_SIGNAL, or until the engine's device is lost (then True)."""
    metrics = Metrics()
    worker_files = worker_files_dir(socket_path)
    copy_worker_files(settings.model_dir, worker_files)  # what the HTTP workers read, as this process serves it
    try:
        manifest, tokenizer = load_tokenizer(settings, worker_files)
    except (ManifestError, TokenizerFileError) as e:  # said of the artifact's file, not of this process's copy
        raise type(e)(str(e).replace(str(worker_files), str(settings.model_dir))) from e
    stop, lost = asyncio.Event(), asyncio.Event()

    def engine_lost() -> None:  # the device is unusable: stop serving, and the process exits 1
        if not lost.is_set():
            log.critical("the engine's device is lost; the engine process stops, and with it the server")
        lost.set()
        stop.set()

    engine, batcher = build_engine(settings, manifest, tokenizer, metrics, engine_lost)
    batcher.start()
    info = EngineInfo.of(engine, batcher)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(LAUNCHER_STOP_SIGNAL, stop.set)
    # The socket file appears once the model is loaded and checked: `python -m app` waits for it.
    server = await loop.create_unix_server(serve_workers(batcher, info), path=socket_path)
    log.info("engine process %d ready on %s", os.getpid(), socket_path)
    try:
        await stop.wait()
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)  # asyncio leaves a Unix socket's file behind (before Python 3.13)
        await batcher.stop()
        metrics.process_exited()
    return lost.is_set()
