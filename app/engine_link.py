"""The link between HTTP worker processes and the one engine process of a multi-process server.

With `workers` > 1 one process owns the ONNX Runtime session and the batcher (one CUDA context, batches
formed from every worker's requests); the workers parse HTTP, tokenise and encode answers, and send
token ids here over a Unix socket. A frame is a 4-byte length and a pickle (protocol 5). Worker ->
engine: ("submit", id, outputs, ids, type ids, lengths) with the sequences concatenated (three arrays,
not two per sequence: unpickling costs per array), ("cancel", id). Engine -> worker: ("hello",
EngineInfo) once, then ("result", id, GroupResult) or ("error", id, type name, message).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from app import errors
from app.batcher import DynamicBatcher, GroupResult

log = logging.getLogger("app.engine_link")
_LENGTH = struct.Struct("<I")
_FRAME_LIMIT = 1 << 31  # a batch of 512 x 512 token vectors of width 1024 in float32 stays under it


@dataclass(frozen=True)
class EngineInfo:
    """What a worker reports about the engine it uses (/info, metrics): OrtEngine's device, precision,
    provider and threads, the batcher's limits, and the engine process id."""
    device: str
    precision: str
    provider: str
    intra_op_threads: int | None
    inference_workers: int
    max_batch_tokens: int
    pid: int


def _send(writer: asyncio.StreamWriter, message: tuple) -> None:
    body = pickle.dumps(message, protocol=5)
    writer.write(_LENGTH.pack(len(body)))
    writer.write(body)  # not concatenated: no copy of a large body to prepend its length


async def _read(reader: asyncio.StreamReader) -> tuple:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > _FRAME_LIMIT:
        raise ConnectionError(f"frame of {length} bytes: the peer is not a bertserve engine link")
    return pickle.loads(await reader.readexactly(length))


# -- engine side ------------------------------------------------------------------------------------------
async def serve_workers(batcher: DynamicBatcher, info: EngineInfo, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
    """One worker's connection: queue what it submits, answer each group when its future resolves, and
    drop its queued work when it cancels a request or goes away."""
    pending: dict[int, asyncio.Future] = {}

    def reply(rid: int, future: asyncio.Future) -> None:
        pending.pop(rid, None)
        if future.cancelled() or writer.is_closing():
            return
        error = future.exception()
        if error is None:
            _send(writer, ("result", rid, future.result()))
        else:
            _send(writer, ("error", rid, type(error).__name__, str(error)))

    _send(writer, ("hello", info))
    try:
        while True:
            message = await _read(reader)
            if message[0] == "submit":
                _, rid, outputs, ids, type_ids, lengths = message
                ends = np.cumsum(lengths).tolist()
                starts = [0, *ends[:-1]]  # slices, not np.split: that costs ~10 us per piece
                sequences = [(ids[a:b], type_ids[a:b]) for a, b in zip(starts, ends)]
                try:
                    future = batcher.submit_group(sequences, outputs)
                except errors.ServiceError as e:
                    _send(writer, ("error", rid, type(e).__name__, str(e)))
                    continue
                pending[rid] = future
                future.add_done_callback(lambda f, rid=rid: reply(rid, f))
            elif message[0] == "cancel":
                future = pending.pop(message[1], None)
                if future is not None:
                    future.cancel()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # the worker exited
    finally:
        for future in pending.values():
            future.cancel()
        writer.close()


# -- worker side -------------------------------------------------------------------------------------------
_ERRORS = {cls.__name__: cls for cls in (errors.InvalidInput, errors.TooManyInputs, errors.InputTooLong,
                                         errors.Overloaded, errors.NotReady, errors.Unsupported)}


class EngineClient:
    """Stands where DynamicBatcher stands in a single process: `submit_group()` returns a future of the
    group's GroupResult; cancelling it drops the work in the engine process too."""

    def __init__(self, socket_path: str, on_lost: Callable[[], None] | None = None):
        self.socket_path, self.on_lost = socket_path, on_lost
        self.info: EngineInfo | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._closed = True

    @property
    def max_batch_tokens(self) -> int:
        return self.info.max_batch_tokens

    @property
    def workers(self) -> int:
        return self.info.inference_workers

    async def connect(self) -> EngineInfo:
        reader, self._writer = await asyncio.open_unix_connection(self.socket_path)
        kind, self.info = await _read(reader)
        if kind != "hello":
            raise ConnectionError(f"the engine process greeted with {kind!r}")
        self._closed = False
        self._reader_task = asyncio.create_task(self._dispatch(reader), name="engine-link")
        return self.info

    async def stop(self) -> None:
        self._closed = True
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        if self._writer is not None:
            self._writer.close()
        self._fail_pending("the server is shutting down")

    def submit_group(self, sequences: list[tuple[np.ndarray, np.ndarray]], outputs: frozenset[str]) -> asyncio.Future:
        if self._closed:
            raise errors.NotReady("the engine process is not available")
        rid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        ids, type_ids = zip(*sequences)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        _send(self._writer, ("submit", rid, outputs, np.concatenate(ids), np.concatenate(type_ids), lengths))
        future.add_done_callback(lambda f: self._done(rid, f))
        return future

    def _done(self, rid: int, future: asyncio.Future) -> None:
        if self._pending.pop(rid, None) is not None and future.cancelled() and not self._closed:
            _send(self._writer, ("cancel", rid))  # the client went away: drop it there too

    async def _dispatch(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await _read(reader)
                future = self._pending.get(message[1])
                if future is None or future.done():
                    continue  # cancelled here meanwhile
                if message[0] == "result":
                    future.set_result(message[2])
                else:
                    future.set_exception(_ERRORS.get(message[2], errors.InternalError)(message[3]))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            if not self._closed:
                log.error("lost the engine process (%s); answering 503 from now on", e or "closed")
                self._closed = True
                self._fail_pending("the engine process is gone")
                if self.on_lost:
                    self.on_lost()

    def _fail_pending(self, message: str) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(errors.NotReady(message))
        self._pending.clear()


__all__ = ["EngineClient", "EngineInfo", "GroupResult", "serve_workers"]
