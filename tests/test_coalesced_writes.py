"""app/coalesced_writes.py: the small writes of one loop turn leave as one write, in order, and nothing
held is lost or sent after the connection ends; and a real server's answer arrives whole."""
from __future__ import annotations

import asyncio
import json
import socket

from app.coalesced_writes import JOIN_MAX_BYTES, CoalescedWrites
from tests.test_server import running_server


class RecordingTransport:
    def __init__(self):
        self.writes: list[bytes] = []
        self.events: list[str] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        assert not self.closing
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default

    def write_eof(self) -> None:
        self.events.append("eof")

    def close(self) -> None:
        self.events.append("close")
        self.closing = True

    def abort(self) -> None:
        self.events.append("abort")
        self.closing = True


def test_small_writes_of_one_loop_turn_leave_as_one_write_in_order():
    async def main():
        raw = RecordingTransport()
        transport = CoalescedWrites(raw, asyncio.get_running_loop())
        transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n")
        transport.write(memoryview(b"hello"))
        assert raw.writes == [] and transport.get_write_buffer_size() == 43
        await asyncio.sleep(0)  # the loop turn ends
        assert raw.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"]
        transport.write(b"next")
        await asyncio.sleep(0)
        assert raw.writes[1:] == [b"next"]
        assert transport.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the transport's

    asyncio.run(main())


def test_a_large_write_goes_out_at_once_after_what_is_held():
    async def main():
        raw = RecordingTransport()
        transport = CoalescedWrites(raw, asyncio.get_running_loop())
        big = b"x" * JOIN_MAX_BYTES
        transport.write(b"head")
        transport.write(big)
        assert raw.writes == [b"head", big]  # no copy of the large body into a joined buffer
        await asyncio.sleep(0)
        assert raw.writes == [b"head", big]

    asyncio.run(main())


def test_close_and_write_eof_send_what_is_held_first_and_abort_drops_it():
    async def main():
        loop = asyncio.get_running_loop()
        raw = RecordingTransport()
        transport = CoalescedWrites(raw, loop)
        transport.write(b"answer")
        transport.write_eof()
        assert raw.writes == [b"answer"] and raw.events == ["eof"]
        transport.write(b"last")
        transport.close()
        assert raw.writes == [b"answer", b"last"] and raw.events == ["eof", "close"]
        await asyncio.sleep(0)  # the scheduled flush finds nothing held: no write to a closed transport
        assert raw.writes == [b"answer", b"last"]

        raw = RecordingTransport()
        transport = CoalescedWrites(raw, loop)
        transport.write(b"never sent")
        transport.abort()
        await asyncio.sleep(0)
        assert raw.writes == [] and raw.events == ["abort"]

    asyncio.run(main())


def test_held_writes_are_dropped_when_the_peer_has_gone():
    async def main():
        raw = RecordingTransport()
        transport = CoalescedWrites(raw, asyncio.get_running_loop())
        transport.write(b"answer")
        raw.closing = True  # connection_lost came within the turn
        await asyncio.sleep(0)
        assert raw.writes == []

    asyncio.run(main())


def test_a_real_servers_answers_on_one_kept_alive_connection_arrive_whole_and_in_order(tiny_artifact_dir):
    """Over a raw socket: two requests pipelined on one connection, each answer complete (status line,
    headers, body of its content-length) and in order."""
    with running_server(tiny_artifact_dir) as url:
        host, port = url.removeprefix("http://").split(":")
        request = lambda text: (json.dumps({"inputs": text}).encode(), text)  # noqa: E731
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            wire = b""
            for body, _ in (request("first one"), request("the second, longer text")):
                wire += (f"POST /embed HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(body)}\r\n\r\n").encode() + body
            sock.sendall(wire)
            received = b""
            answers = []
            while len(answers) < 2:
                chunk = sock.recv(1 << 16)
                assert chunk, "the server closed the connection"
                received += chunk
                while b"\r\n\r\n" in received:
                    head, rest = received.split(b"\r\n\r\n", 1)
                    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:"))
                    if len(rest) < length:
                        break
                    answers.append((head.split(b"\r\n")[0], json.loads(rest[:length])))
                    received = rest[length:]
    assert [status for status, _ in answers] == [b"HTTP/1.1 200 OK"] * 2
    assert [len(a["data"]) for _, a in answers] == [1, 1]
    assert answers[0][1]["usage"]["tokens"] < answers[1][1]["usage"]["tokens"]
