"""Connection limits uvicorn lacks, as the HTTP protocol class uvicorn is given (`uvicorn.Config(http=...)`,
its public way to choose the protocol): a bound on the request line + headers (431), and on the time to
receive them and the body (408, then the connection is closed); a request that cannot be parsed is
answered 400 in the app's error shape, not uvicorn's plain text. They act before the app sees the
request: before the API key is checked and before a body is read. The idle time between requests on a
keep-alive connection is uvicorn's own `timeout_keep_alive`. A client that reads none of its answer for
the body timeout is cut off: its close would otherwise wait, holding the answer, for as long as it stays.

httptools' parser keeps every header byte it is fed, and uvicorn neither bounds the headers nor times
out a client that never finishes sending them: 40 connections each sending 10 MB of headers held 420 MB,
and a connection that sends half a request line stayed open for ever."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from app.coalesced_writes import CoalescedWrites
from app.errors import error_response

log = logging.getLogger("app")

try:  # the kernel's count of a socket's unacknowledged bytes, where there is one
    import fcntl
    import termios
    _OUTQ = getattr(termios, "TIOCOUTQ", None)  # Linux's SIOCOUTQ
except ImportError:  # Windows
    fcntl, _OUTQ = None, None


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int  # request line and headers of one request
    header_timeout_s: float  # from the connection's start, or a request's first byte, to the end of its headers
    body_timeout_s: float  # from the end of the headers to the end of the body


class _ProtocolLog(logging.LoggerAdapter):
    """uvicorn's protocol logger, less its "Invalid HTTP request received.": send_400_response below says it,
    with the client's address (one line a malformed request, not two)."""

    @property
    def level(self) -> int:  # uvicorn reads its logger's level
        return self.logger.level

    def warning(self, msg, *args, **kwargs) -> None:
        if msg != "Invalid HTTP request received.":
            self.logger.warning(msg, *args, **kwargs)


_PROTOCOL_LOG = _ProtocolLog(logging.getLogger("uvicorn.error"), {})


def limited_protocol(limits: ConnectionLimits,
                     answered: Callable[[int, str, float], None] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with `limits`, its small writes coalesced (app/coalesced_writes.py);
    uvicorn's h11 protocol when httptools is missing (h11 bounds the headers itself,
    `h11_max_incomplete_event_size`; the timeouts are then not enforced). `answered(status, error type,
    seconds)` hears of each request answered here, before any app saw it (the metrics count it)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        _limits = limits
        _answered = staticmethod(answered) if answered else None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(CoalescedWrites(transport, self.loop))
            self.logger = _PROTOCOL_LOG
            self._in_head = True  # the bytes arriving belong to a request line or headers
            self._head_bytes = 0
            self._started = False  # some byte of the current request arrived
            self._discarding = False  # answered and closing: what still arrives is read and dropped
            self._deadline = (self.loop.time() + self._limits.header_timeout_s, "headers")
            self._unsent: tuple[int, float] | None = None  # (bytes not yet sent, since when) while writing is paused
            self._socket = transport.get_extra_info("socket")
            _watch(self)

        def connection_lost(self, exc: Exception | None) -> None:
            self._deadline = self._unsent = None
            super().connection_lost(exc)

        # asyncio's flow control: the transport's buffer passed its high-water mark (the client reads slowly,
        # or not at all), and went below its low-water mark again
        def pause_writing(self) -> None:
            self._unsent = (self._unsent_bytes(), self.loop.time())
            super().pause_writing()

        def resume_writing(self) -> None:
            self._unsent = None
            super().resume_writing()

        def _unsent_bytes(self) -> int:
            """The answer's bytes the client has not acknowledged: the transport's buffer, and the kernel's
            send queue where it says (Linux: SIOCOUTQ). The kernel's alone shrinks with every read, while
            the transport's waits until a third of the kernel's buffer (up to megabytes) is free."""
            queued = 0
            if _OUTQ is not None and self._socket is not None:
                with contextlib.suppress(OSError, ValueError):
                    queued = struct.unpack("i", fcntl.ioctl(self._socket.fileno(), _OUTQ, b"\0\0\0\0"))[0]
            return self.transport.get_write_buffer_size() + queued

        def data_received(self, data: bytes) -> None:
            if self._discarding:
                return
            if not self._in_head:
                super().data_received(data)
                return
            room = self._limits.max_header_bytes - self._head_bytes
            if len(data) <= room:
                self._head_bytes += len(data)
                super().data_received(data)
                return
            super().data_received(data[:room])  # the headers may end within the limit
            if self._in_head:
                self._reject(431, "request_header_fields_too_large",
                             f"the request line and headers exceed {self._limits.max_header_bytes} bytes")
            elif not self.transport.is_closing():
                self.data_received(data[room:])

        # httptools' parser callbacks
        def on_message_begin(self) -> None:
            super().on_message_begin()
            if not self._started:  # the next request on a kept-alive connection: its header time starts now
                self._started = True
                self._deadline = (self.loop.time() + self._limits.header_timeout_s, "headers")

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes = False, 0
            self._deadline = (self.loop.time() + self._limits.body_timeout_s, "body")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_head, self._started = True, False
            self._deadline = None  # the next request's header time starts with its first byte
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            """A request httptools cannot parse (uvicorn answers it in plain text): in our error shape."""
            self._reject(400, "bad_request", "not a valid HTTP/1.1 request (its request line, a header, or a chunked "
                         "body is malformed, or it has both Content-Length and Transfer-Encoding); the connection "
                         "is closed")

        def check_deadline(self, now: float) -> bool:
            """Answers 408 past the deadline; aborts a connection whose client read none of its answer for
            body_timeout_s (a closing transport too: its close waits for the buffer to drain, for ever if the
            client never reads); False once this connection needs no more watching."""
            if self._unsent is not None:
                size, since = self._unsent
                left = self._unsent_bytes()
                if left < size:  # the client reads, however slowly
                    self._unsent = (left, now)
                elif now - since >= self._limits.body_timeout_s:
                    log.warning("closed a connection from %s: it read none of its answer for %g s (%d bytes unsent)",
                                _address(self.client), self._limits.body_timeout_s, left)
                    self._unsent = None
                    self.transport.abort()  # frees the buffered answer; a pending write of the app sees a disconnect
                    return False
                return True
            if self.transport.is_closing():
                return False
            if self._deadline is None:  # between requests: uvicorn's keep-alive timeout applies
                return True
            at, part = self._deadline
            if now < at:
                return True
            self._deadline = None
            if part == "headers" and not self._started and self._head_bytes == 0:
                self.transport.close()  # nothing of a request arrived: nobody to answer
                return False
            seconds = self._limits.header_timeout_s if part == "headers" else self._limits.body_timeout_s
            self._reject(408, "request_timeout", f"the request {part} did not arrive within {seconds:g} s", seconds)
            return False

        def _reject(self, status: int, type_: str, message: str, seconds: float = 0.0) -> None:
            """Answers in our error shape and closes the connection, unless the app already answers (and
            counts the request itself)."""
            self._deadline = None
            # On a kept-alive connection self.cycle is the last request's until the next one's headers end:
            # only a cycle whose answer is under way stands in the way.
            running = self.cycle is not None and not self.cycle.response_complete
            if running and self.cycle.response_started:
                self.transport.close()
                return
            log.warning("closed a connection from %s: %s", _address(self.client), message)
            body = error_response(status, type_, message).body  # the app's error shape, rendered as it renders it
            head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode("latin-1")
            if running:  # the app's reads now see a disconnect; its writes go nowhere
                # ...and the front counts what the client was told, not a 499 (app/front.py, _read_body)
                self.cycle.scope.setdefault("bertserve", {})["answered"] = (status, type_, message)
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            elif self._answered is not None:
                self._answered(status, type_, seconds)
            self.transport.write(head + body)
            # A close with unread bytes in the socket sends a reset, which can destroy the answer before the
            # client reads it: end our side, drop what still comes, and close once the client has (or soon).
            self._discarding = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(_LINGER_S, self.transport.close)
            else:
                self.transport.close()

    return LimitedHttpToolsProtocol


# Deadlines are checked by one sweep per process every _SWEEP_S rather than a timer per request: arming
# and cancelling timers twice per request cost more than the sweep over the open connections.
_SWEEP_S = 0.25
_watched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its connections


def _watch(connection) -> None:
    loop = connection.loop
    connections = _watched.get(loop)
    if not connections:
        connections = _watched[loop] = set()
        loop.call_later(_SWEEP_S, _sweep, loop)
    connections.add(connection)


def _sweep(loop: asyncio.AbstractEventLoop) -> None:
    now, connections = loop.time(), _watched.get(loop, set())
    for connection in list(connections):
        if not connection.check_deadline(now):
            connections.discard(connection)
    if connections:
        loop.call_later(_SWEEP_S, _sweep, loop)


_LINGER_S = 2.0
_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown client"
