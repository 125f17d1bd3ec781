"""How every HTTP process runs under uvicorn: its options from Settings (fast loop and parser, connection
limits, keep-alive, the shutdown deadline) and a Server that tells the app when a stop signal came."""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import socket
from collections.abc import Callable

import uvicorn

from app.http_limits import ConnectionLimits, limited_protocol
from app.metrics import Metrics
from app.settings import Settings

log = logging.getLogger("app")

# uvicorn's own deadline for the requests in flight, past the drain deadline: what is still queued then was
# answered 503 by the drain, so this only covers a batch that was running and the answers being written.
# Past it uvicorn cancels the requests, which answers a plain-text 500.
SHUTDOWN_MARGIN_S = 5.0


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (IPv6 for an IPv6 address), SO_REUSEADDR as uvicorn binds."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def uvicorn_options(settings: Settings, metrics: Metrics | None = None) -> dict:
    """uvicorn.Config keywords for one HTTP process (not the app, host or port); `metrics`: the app's, which
    then count the requests the connection limits answer (400, 408, 431) under endpoint "other"."""
    loop, http = _fast_protocols()
    limits = ConnectionLimits(settings.max_header_bytes, settings.header_timeout_s, settings.body_timeout_s)
    answered = None
    if metrics is not None:
        def answered(status: int, type_: str, seconds: float) -> None:
            metrics.request_answered("other", status, seconds, {"error_type": type_})
    # log_config None: uvicorn's lines go through the root logger that configure_logging set up, so every
    # line of the server has one format, with its time (uvicorn's own has none)
    return dict(log_config=None, log_level=settings.log_level, access_log=settings.access_log, loop=loop,
                http=limited_protocol(limits, answered) if http == "httptools" else "h11",
                h11_max_incomplete_event_size=settings.max_header_bytes,
                timeout_keep_alive=settings.keep_alive_s,
                timeout_graceful_shutdown=settings.drain_seconds + SHUTDOWN_MARGIN_S)


def _fast_protocols() -> tuple[str, str]:
    """uvloop and httptools when installed (uvicorn[standard]): each costs a fraction of asyncio's loop
    and the pure-Python h11 parser per request. Named explicitly so a missing one shows in the log."""
    found = {name: importlib.util.find_spec(name) is not None for name in ("uvloop", "httptools")}
    for name, ok in found.items():
        if not ok:
            log.warning("%s is not installed: serving slower (pip install uvicorn[standard])", name)
    if not found["httptools"]:
        log.warning("without httptools the header and body timeouts are not enforced")
    return "uvloop" if found["uvloop"] else "asyncio", "httptools" if found["httptools"] else "h11"


class ServingServer(uvicorn.Server):
    """uvicorn's Server, whose shutdown (on the first stop signal) stops accepting, then calls `on_stop`
    (the app drains from there: new requests are answered 503 with `Connection: close`), and keeps the
    open connections while `busy()` (the app has requests in flight), up to uvicorn's own deadline, before
    uvicorn's shutdown closes the rest. In that order a client told 503 reconnects to a closed port, not
    into the listener's backlog, which the kernel resets when it closes; and a keep-alive client's next
    request meets the 503, not a connection closed under it, as when uvicorn closes every idle connection
    at the signal."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None], busy: Callable[[], bool] = lambda: False):
        super().__init__(config)
        self._on_stop, self._busy = on_stop, busy

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # stop accepting, as uvicorn's shutdown does first
            server.close()
        for sock in sockets or []:
            sock.close()
        self._on_stop()
        limit = self.config.timeout_graceful_shutdown
        if limit is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + limit
            while self._busy() and loop.time() < deadline and not self.force_exit:
                await asyncio.sleep(0.02)
            # uvicorn's own wait gets what is left of the one deadline, not a second one (and a moment to close)
            self.config.timeout_graceful_shutdown = max(1.0, deadline - loop.time())
        await super().shutdown(sockets)
