"""HTTP worker processes that are handed their connections one by one, in turn.

When several processes accept from one shared listening socket, the kernel wakes them all and the
first one awake takes every connection waiting: a burst of 30 keep-alive connections spread over 8
workers as 24, 2, 2, 1, 1, 0, 0, 0 (measured here). Clients with connection pools then load one worker
to a full core while others idle, and the server answers at that one worker's pace. So the launching
process accepts, and passes each connection (its file descriptor, over a Unix socket) to the next
ready worker in turn, as Node's cluster module does for the same reason. A worker is a plain uvicorn
server with no listening socket of its own; it serves every connection it is handed.

Each worker is a spawned process with one SOCK_SEQPACKET channel to the launcher: the worker says
"ready" on it once its app has started, the launcher sends connections down it, and a closed channel
tells the worker that its launcher is gone."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import selectors
import signal
import socket
import threading
import time

import uvicorn

from app.front import ServingFront
from app.heap import keep_freed_memory
from app.main import create_app
from app.metrics import process_ended
from app.multiprocess.cpu_cores import pin
from app.multiprocess.engine_link import connect_to_engine
from app.multiprocess.held_signals import LAUNCHER_STOP_SIGNAL, release_stop_signals, start_with_stop_signals_held
from app.multiprocess.parent_watch import end_with_parent, remove_if_orphaned
from app.multiprocess.worker_files import worker_files_dir
from app.settings import ENV_PREFIX, Settings, configure_logging
from app.uvicorn_server import SHUTDOWN_MARGIN_S, ServingServer, uvicorn_options

log = logging.getLogger("app")
# Set by the launcher: the engine processes' Unix sockets, comma-separated (one engine per GPU); worker i
# uses engine i mod their number, and the launcher hands connections to the workers in turn.
ENGINE_SOCKET_VAR = ENV_PREFIX + "ENGINE_SOCKET"

_READY = b"ready"
_CONNECTION = b"c"
_RESTART_DELAY_S = 1.0  # a worker that dies at once is not restarted in a tight loop
_STOP_MARGIN_S = 5.0  # past a worker's own shutdown deadline (drain_seconds + SHUTDOWN_MARGIN_S)


class HttpWorkers:
    """`count` worker processes, each serving the app under uvicorn (settings from BERTSERVE_* variables).
    `serve(listener, stopping)` accepts until `stopping` is set, handing connections out in turn to the
    workers that are ready, and restarts any worker that dies. `stop_s`: how long a worker may take to
    drain and stop before it is killed."""

    def __init__(self, count: int, stop_s: float, cores: frozenset[int] | None = None):
        self.count, self.stop_s, self.cores = count, stop_s, cores  # cores: engine_cores' rest; None: any
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker | None] = [None] * count
        self._turn = 0

    def serve(self, listener: socket.socket, stopping: threading.Event) -> None:
        listener.setblocking(False)
        with selectors.DefaultSelector() as selector:
            try:
                for i in range(self.count):
                    self._start(i, selector)
                accepting = False
                while not stopping.is_set():
                    ready = any(w and w.ready for w in self._workers)
                    if ready and not accepting:  # connections wait in the backlog until a worker can serve them
                        selector.register(listener, selectors.EVENT_READ)
                    elif accepting and not ready:
                        selector.unregister(listener)
                    accepting = ready
                    for key, _ in selector.select(timeout=0.2):
                        if key.fileobj is listener:
                            self._hand_out(listener)
                        else:
                            self._on_message(key.data, selector)
                    self._restart_dead(selector)
            finally:
                # Stop accepting first: new connections are refused. The ones the kernel has accepted already
                # are taken in (the workers answer them 503), as closing resets the backlog's.
                with contextlib.suppress(OSError):
                    self._hand_out(listener)
                listener.close()
                self._stop_all()

    # -- connections ------------------------------------------------------------------------------------
    def _hand_out(self, listener: socket.socket) -> None:
        """Every connection waiting, each to the next ready worker (one whose channel is full is passed over)."""
        while True:
            try:
                connection, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            with connection:
                for _ in range(self.count):
                    worker = self._workers[self._turn]
                    self._turn = (self._turn + 1) % self.count
                    if worker and worker.ready and worker.send(connection):
                        break
                else:
                    log.warning("no HTTP worker could take a connection; closed it")

    # -- the workers' lives -----------------------------------------------------------------------------
    def _start(self, index: int, selector: selectors.BaseSelector) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        process = self._context.Process(target=run_worker, args=(theirs, os.getpid(), index, self.cores),
                                        name=f"bertserve-http-{index}")
        start_with_stop_signals_held(process)  # released once uvicorn handles them: see startup()
        theirs.close()
        ours.setblocking(False)
        worker = self._workers[index] = _Worker(index, process, ours)
        selector.register(ours, selectors.EVENT_READ, worker)

    def _on_message(self, worker: _Worker, selector: selectors.BaseSelector) -> None:
        try:
            message = worker.channel.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            message = b""
        if message == _READY:
            worker.ready = True
        elif not message:  # the worker is gone; _restart_dead starts another once it has exited
            selector.unregister(worker.channel)
            worker.ready = False

    def _restart_dead(self, selector: selectors.BaseSelector) -> None:
        for i, worker in enumerate(self._workers):
            if worker is None or worker.process.is_alive():
                continue
            if time.monotonic() - worker.started < _RESTART_DELAY_S:
                continue
            log.error("HTTP worker %d (pid %s) exited with %s; starting another", i, worker.process.pid,
                      worker.process.exitcode)
            process_ended(worker.process.pid)  # the requests it was serving are no longer in flight
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(worker.channel)
            worker.channel.close()
            self._start(i, selector)

    def _stop_all(self) -> None:
        """Tells every worker to stop (each drains: see ServingFront.drain), then waits; kills stragglers."""
        alive = [w for w in self._workers if w is not None]
        for worker in alive:
            with contextlib.suppress(ProcessLookupError):  # one that died meanwhile
                os.kill(worker.process.pid, LAUNCHER_STOP_SIGNAL)
        deadline = time.monotonic() + self.stop_s
        for worker in alive:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                log.error("HTTP worker %d did not stop in %g s; killing it", worker.index, self.stop_s)
                worker.process.kill()
                worker.process.join()
            worker.channel.close()


class _Worker:
    def __init__(self, index: int, process: multiprocessing.Process, channel: socket.socket):
        self.index, self.process, self.channel = index, process, channel
        self.ready = False
        self.started = time.monotonic()

    def send(self, connection: socket.socket) -> bool:
        """Hands the connection over (the worker holds its own copy of the descriptor); False when the
        worker cannot take it now (its channel is full or gone)."""
        try:
            socket.send_fds(self.channel, [_CONNECTION], [connection.fileno()])
            return True
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            self.ready = False
            return False


# -- inside a worker process ------------------------------------------------------------------------------
def create_worker_app(index: int = 0) -> ServingFront:
    """The app of HTTP worker `index`: settings from BERTSERVE_* variables (set by the launcher), its
    batcher an engine process's, its tokenizer that engine's copy."""
    # The processes are a worker's parallelism. The tokenizers' own thread pool only adds CPU per request
    # here (a hand-off to it and back, its threads spinning after each batch), and more of it once the
    # event loop tokenises a request itself (WORKER_INLINE_TOKENIZING).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = Settings()
    configure_logging(settings)
    sockets = os.environ[ENGINE_SOCKET_VAR].split(",")
    engine = sockets[index % len(sockets)]
    return create_app(settings, connect_to_engine(engine), worker_files_dir(engine))


def run_worker(channel: socket.socket, launcher_pid: int, index: int, cores: frozenset[int] | None = None) -> None:
    pin(cores, f"HTTP worker {index}")  # first: every thread made from here on inherits them
    # A worker notices its launcher's end on its channel and drains; this covers the time before its loop runs.
    end_with_parent(launcher_pid, LAUNCHER_STOP_SIGNAL)
    keep_freed_memory()
    front = create_worker_app(index)
    config = uvicorn.Config(front, **uvicorn_options(front.state.settings, front.metrics))
    # uvicorn raises SIGTERM / SIGINT again after its shutdown: the drain was the orderly end.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            _HandedConnectionsServer(config, channel, on_stop=front.drain, busy=front.busy).run()
    finally:
        remove_if_orphaned(launcher_pid, os.path.dirname(os.environ[ENGINE_SOCKET_VAR].split(",")[0]))


def worker_stop_s(settings: Settings) -> float:
    """How long a worker may take from the launcher's stop to its exit: its drain, uvicorn's margin, and ours."""
    return settings.drain_seconds + SHUTDOWN_MARGIN_S + _STOP_MARGIN_S


class _HandedConnectionsServer(ServingServer):
    """uvicorn's server without a listening socket: it serves the connections the launcher sends, and
    stops when the launcher says so (LAUNCHER_STOP_SIGNAL), once it has stopped accepting."""

    def __init__(self, config, channel: socket.socket, on_stop, busy):
        super().__init__(config, on_stop, busy)
        self._channel = channel
        self._protocol = None

    def handle_exit(self, sig: int, frame) -> None:
        """Ctrl-C as uvicorn takes it (a second one ends at once); SIGTERM only from the launcher."""
        if sig == signal.SIGTERM:  # to the whole group: the launcher got it too, and stops this worker in turn
            return
        super().handle_exit(signal.SIGTERM if sig == LAUNCHER_STOP_SIGNAL else sig, frame)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=[])  # the app's lifespan; no socket of its own
        loop = asyncio.get_running_loop()
        config = self.config

        def protocol():  # as uvicorn's own startup makes one per connection (called on the running loop)
            return config.http_protocol_class(config=config, server_state=self.server_state,
                                              app_state=self.lifespan.state)

        self._protocol = protocol
        self._channel.setblocking(False)
        loop.add_reader(self._channel.fileno(), self._receive, loop, protocol)
        self._channel.send(_READY)
        # uvicorn's handlers are in place (serve() installs them before startup), and the launcher's: a stop
        # that came while this worker was starting now drains it as any other.
        signal.signal(LAUNCHER_STOP_SIGNAL, self.handle_exit)
        release_stop_signals()

    def _receive(self, loop: asyncio.AbstractEventLoop, protocol) -> None:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self._channel, 16, 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                message, fds = b"", []
            if not message and not fds:  # the launcher is gone: drain and exit
                loop.remove_reader(self._channel.fileno())
                self.handle_exit(LAUNCHER_STOP_SIGNAL, None)
                return
            for fd in fds:  # served while stopping too: its client was accepted, and gets the drain's 503
                loop.create_task(_serve_connection(loop, protocol, socket.socket(fileno=fd), self.config.ssl))

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(self._channel.fileno())
        if self._protocol is not None:  # the connections sent before the launcher's stop are served (503)
            self._receive(loop, self._protocol)
        await super().shutdown(sockets)


async def _serve_connection(loop: asyncio.AbstractEventLoop, protocol, connection: socket.socket, ssl) -> None:
    try:
        await loop.connect_accepted_socket(protocol, connection, ssl=ssl)
    except OSError:  # the client left before it was served
        connection.close()
