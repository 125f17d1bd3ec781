"""A transport wrapper that sends the small writes of one event-loop turn as one: uvicorn writes a
response's status line and headers, then its body, each with its own `transport.write`, which uvloop
sends at once, so a small answer cost two send() calls and went out as two TCP segments. The HTTP
protocol class (app/http_limits.py) wraps its connection's transport in this, through asyncio's public
`connection_made`."""
from __future__ import annotations

import asyncio

# A write at least this large goes out at once (after what is held), not copied into a joined buffer.
JOIN_MAX_BYTES = 64 * 1024


class CoalescedWrites:
    """`transport` with its small writes held until the end of the loop turn (or the next large write,
    write_eof or close) and then written as one; everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport, self._loop = transport, loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if len(data) >= JOIN_MAX_BYTES:
            self.flush()
            self._transport.write(data)
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(bytes(data))

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        if not self._held:
            return
        data = self._held[0] if len(self._held) == 1 else b"".join(self._held)
        self._held = []
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(data) for data in self._held)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def __getattr__(self, name: str):  # is_closing, get_extra_info, pause_reading, ...: the transport's
        return getattr(self._transport, name)
