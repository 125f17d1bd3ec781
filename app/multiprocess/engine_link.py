"""The link between HTTP worker processes and the one engine process of a multi-process server.

With `workers` > 1 one process owns the ONNX Runtime session and the batcher (one CUDA context, batches
formed from every worker's requests); the workers parse HTTP, tokenise and encode answers, and send
token ids here over a Unix socket. The engine process is what caps a GPU server's throughput, so the
link costs it as little as it can: no pickle on the hot path, the requests of one event-loop turn of a
worker sent as one group in one frame (up to _GATHER_ROWS sequences; each request gets its own rows back),
arrays read straight out of (and written straight from) their bytes, and frames received into their own
buffer instead of being copied out of a stream.

A frame is a 4-byte little-endian length, then a 1-byte kind:
  HELLO   engine -> worker, once: padding to 8 bytes, then a pickle of EngineInfo
  SUBMIT  worker -> engine: <kind, outputs bit mask, n, group id> (16 bytes), lengths int32[n],
          ids int32[total], type ids uint8[total]
  CANCEL  worker -> engine: <kind, group id> (16 bytes)
  RESULT  engine -> worker: <kind, arrays, batch size, group id, queue s, inference s, received at, answered
          at> (48 bytes; the engine process's time.monotonic(), one clock for every process of the host), one
          <output, dtype, rows, cols> (12 bytes) per array, then each array's bytes, 8-byte aligned; token
          vectors go as one [total, H] array, which the worker cuts by the lengths it sent
  ERROR   engine -> worker: <kind, group id> (16 bytes), then "ErrorType\\nmessage" in UTF-8
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import pickle
import struct
import time
from collections.abc import Callable

import numpy as np

from app import errors
from app.backend import Backend, EngineInfo, InlineTokenizing
from app.batcher import DynamicBatcher, GroupResult, Sequences
from app.metrics import Metrics
from app.pooling import TOKEN_POOLED
from artifact.manifest import CLASSIFIER_LOGITS, CLS_EMBEDDING, NSP_LOGITS, POOLED_EMBEDDING, TOKEN_EMBEDDINGS

log = logging.getLogger("app.engine_link")
_LENGTH = struct.Struct("<I")
_FRAME_LIMIT = 1 << 31  # 512 inputs x 512 token vectors of width 1024 in float32 is 1 GiB
HELLO, SUBMIT, CANCEL, RESULT, ERROR = range(5)
_HELLO = struct.Struct("<B7x")
_SUBMIT = struct.Struct("<BxHIQ")  # the outputs bit mask is 16 bits: one per name of _OUTPUTS
_REQUEST = struct.Struct("<B7xQ")  # CANCEL and ERROR
_RESULT = struct.Struct("<BBxxIQdddd")
_ARRAY = struct.Struct("<BBxxII")
# a request's outputs as bits of the SUBMIT frame's mask: the graph's, then those pooled in the engine process
_OUTPUTS = (TOKEN_EMBEDDINGS, CLS_EMBEDDING, POOLED_EMBEDDING, NSP_LOGITS, CLASSIFIER_LOGITS, *TOKEN_POOLED)
_OUTPUT_SETS = [frozenset(name for i, name in enumerate(_OUTPUTS) if mask >> i & 1)
                for mask in range(1 << len(_OUTPUTS))]
_MASKS = {outputs: mask for mask, outputs in enumerate(_OUTPUT_SETS)}  # a set's bits, looked up per request
_DTYPES = (np.dtype("<f4"), np.dtype("<f2"))
_SCRATCH = 1 << 16  # frames up to this size are read into one reused buffer; larger ones into their own
_HOLD_AT = 64 << 20  # unread answers the engine buffers for one worker before it stops reading its work
# A worker sends the requests of one event-loop turn that want the same outputs as one group, up to this many
# sequences: one-text requests then cost the engine process 15-18 us each instead of 41-48 (a group is
# answered when its last row is, so large requests go on their own; bench/engine_link_load.py, BENCHMARKS.md).
_GATHER_ROWS = 64


class _Framed(asyncio.BufferedProtocol):
    """One end of a link connection: `send()` writes a frame from parts (bytes, numpy arrays), and
    `on_frame(kind, frame)` gets each frame received, as its own writable bytearray. `greeting`: the
    parts of a frame sent as soon as the connection is made. Frames sent in one turn of the event loop
    (the answers of one finished batch, say) leave in one write: a system call per frame cost the engine
    process a tenth of its time with one-text requests. `hold_reading`: stop reading while the peer does
    not take what is written (the engine's side: a worker that does not read its answers gets no more
    work done, instead of the engine buffering its answers without bound)."""

    def __init__(self, on_frame: Callable[[int, bytearray], None], on_lost: Callable[[Exception | None], None],
                 greeting: tuple = (), hold_reading: bool = False):
        self.on_frame, self.on_lost, self.greeting, self.hold_reading = on_frame, on_lost, greeting, hold_reading
        self.transport: asyncio.Transport | None = None
        self._scratch = bytearray(_SCRATCH)
        self._have = 0  # bytes in _scratch not yet parsed into frames
        self._frame: bytearray | None = None  # a large frame being received straight into its buffer
        self._filled = 0
        self._outgoing: list = []  # frames sent in this turn of the loop, written by flush

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if self.hold_reading:  # far above one answer: a worker that reads normally never meets it
            transport.set_write_buffer_limits(high=_HOLD_AT)
        if self.greeting:
            self.send(*self.greeting)

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_lost(exc)

    def pause_writing(self) -> None:  # the transport's buffer passed its high-water mark
        if self.hold_reading:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.hold_reading and not self.transport.is_closing():
            self.transport.resume_reading()

    def send(self, *parts) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self.flush)
        self._outgoing.append(_LENGTH.pack(sum(v.nbytes for v in views)))
        self._outgoing += views

    def flush(self) -> None:
        """Write what was sent so far: at the next turn of the loop (scheduled by `send`), or now, for a
        caller that itself runs at the end of a turn's gathering."""
        outgoing, self._outgoing = self._outgoing, []
        if outgoing and not self.transport.is_closing():
            self.transport.writelines(outgoing)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._frame is not None:
            return memoryview(self._frame)[self._filled:]
        return memoryview(self._scratch)[self._have:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._frame is not None:
            self._filled += nbytes
            if self._filled == len(self._frame):
                frame, self._frame = self._frame, None
                self._deliver(frame)
            return
        self._have += nbytes
        scratch, pos, have = self._scratch, 0, self._have
        while have - pos >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(scratch, pos)
            if length == 0 or length > _FRAME_LIMIT:
                log.error("a frame of %d bytes: the peer is not a bertserve engine link; closing it", length)
                self.transport.close()
                return
            body = pos + _LENGTH.size
            if have - body >= length:  # the whole frame is here
                self._deliver(scratch[body: body + length])
                pos = body + length
            elif length > _SCRATCH - _LENGTH.size:  # will not fit the scratch buffer: read it into its own
                self._frame = bytearray(length)
                self._filled = have - body
                self._frame[: self._filled] = scratch[body: have]
                pos = have
                break
            else:
                break
        if pos:  # keep the start of an incomplete frame at the front
            scratch[: have - pos] = scratch[pos: have]
            self._have = have - pos

    def _deliver(self, frame: bytearray) -> None:
        try:
            self.on_frame(frame[0], frame)
        except Exception:  # noqa: BLE001 - a malformed frame ends this connection, not the process
            log.exception("could not handle a link frame (kind %d); closing the connection", frame[0])
            self.transport.close()


# -- engine side ------------------------------------------------------------------------------------------
def _result_frame(rid: int, result: GroupResult, received_at: float) -> list:
    """The RESULT frame's parts (`received_at`: when the engine process read the request); TooManyInputs
    when they would pass the frame limit (token vectors of very many long inputs), which the worker
    answers with 413 while the link stays up."""
    arrays = []
    for name, value in result.outputs.items():
        if isinstance(value, list):  # token vectors: [len_i, H] each -> [total, H]
            value = np.concatenate(value) if len(value) > 1 else value[0]
        arrays.append((_OUTPUTS.index(name), np.ascontiguousarray(value)))
    size = sum(a.nbytes for _, a in arrays)
    if size > _FRAME_LIMIT - 1024:
        raise errors.TooManyInputs(f"the answer would take {size / 2**30:.1f} GiB; send fewer inputs per request, "
                                   f"or ask for token vectors of fewer inputs at a time")
    parts = [_RESULT.pack(RESULT, len(arrays), result.batch_size, rid, result.queue_s, result.inference_s,
                          received_at, time.monotonic())]
    parts += [_ARRAY.pack(index, _DTYPES.index(a.dtype), *a.shape) for index, a in arrays]
    offset = _RESULT.size + _ARRAY.size * len(arrays)
    for _, a in arrays:
        if offset % 8:
            parts.append(bytes(8 - offset % 8))
            offset += 8 - offset % 8
        parts.append(a)
        offset += a.nbytes
    return parts


def serve_workers(batcher: DynamicBatcher, info: EngineInfo) -> Callable[[], asyncio.BaseProtocol]:
    """The protocol factory for the engine's Unix server: per worker connection, queue what it submits,
    answer each request when its future resolves, and drop its queued work when it cancels a request or
    goes away."""
    hello = pickle.dumps(info, protocol=5)

    def connection() -> _Framed:
        pending: dict[int, asyncio.Future] = {}

        def reply(rid: int, received_at: float, future: asyncio.Future) -> None:
            pending.pop(rid, None)
            if future.cancelled() or link.transport.is_closing():
                return
            error = future.exception()
            if error is None:
                try:
                    link.send(*_result_frame(rid, future.result(), received_at))
                    return
                except errors.ServiceError as e:
                    error = e
            link.send(_REQUEST.pack(ERROR, rid), _error_payload(error))

        def on_frame(kind: int, frame: bytearray) -> None:
            if kind == SUBMIT:
                received_at = time.monotonic()
                _, mask, n, rid = _SUBMIT.unpack_from(frame)
                ids_at = _SUBMIT.size + 4 * n
                total = (len(frame) - ids_at) // 5  # int32 ids + uint8 type ids per token
                sequences = Sequences(np.frombuffer(frame, np.int32, total, ids_at),
                                      np.frombuffer(frame, np.uint8, total, ids_at + 4 * total),
                                      np.frombuffer(frame, np.int32, n, _SUBMIT.size).astype(np.int64))
                try:
                    future = batcher.submit_group(sequences, _OUTPUT_SETS[mask])
                except errors.ServiceError as e:
                    link.send(_REQUEST.pack(ERROR, rid), _error_payload(e))
                    return
                pending[rid] = future
                future.add_done_callback(lambda f, rid=rid, at=received_at: reply(rid, at, f))
            elif kind == CANCEL:
                future = pending.pop(_REQUEST.unpack_from(frame)[1], None)
                if future is not None:
                    future.cancel()
            else:
                raise ValueError(f"unexpected frame kind {kind} from a worker")

        def on_lost(exc: Exception | None) -> None:  # the worker exited: its queued work is dropped
            for future in pending.values():
                future.cancel()
            pending.clear()

        link = _Framed(on_frame, on_lost, greeting=(_HELLO.pack(HELLO), hello), hold_reading=True)
        return link

    return connection


# -- worker side -------------------------------------------------------------------------------------------
_ERRORS = {cls.__name__: cls for cls in (errors.InvalidInput, errors.TooManyInputs, errors.InputTooLong,
                                         errors.Overloaded, errors.NotReady, errors.EngineLost, errors.Unsupported)}


def _error_payload(error: BaseException) -> bytes:
    """An ERROR frame's body: the error's class name, its Retry-After (or nothing) and its message."""
    retry = getattr(error, "headers", {}).get("Retry-After", "")
    return f"{type(error).__name__}\n{retry}\n{error}".encode()


def _error_from(payload: bytes) -> errors.ServiceError:
    name, retry, message = payload.decode().split("\n", 2)
    error = _ERRORS.get(name, errors.InternalError)(message)
    if retry:
        error.headers["Retry-After"] = retry
    return error


def _read_result(frame: bytearray, lengths: np.ndarray) -> GroupResult:
    _, count, batch_size, _, queue_s, inference_s, _, _ = _RESULT.unpack_from(frame)
    offset = _RESULT.size + _ARRAY.size * count
    outputs: dict = {}
    for k in range(count):
        index, dtype, rows, cols = _ARRAY.unpack_from(frame, _RESULT.size + _ARRAY.size * k)
        offset += -offset % 8
        dtype = _DTYPES[dtype]
        value = np.frombuffer(frame, dtype, rows * cols, offset).reshape(rows, cols)
        offset += value.nbytes
        name = _OUTPUTS[index]
        if name == TOKEN_EMBEDDINGS:  # back to one [len_i, H] array per sequence
            ends = np.cumsum(lengths).tolist()
            value = [value[a:b] for a, b in zip([0, *ends[:-1]], ends)]
        outputs[name] = value
    return GroupResult(outputs, queue_s, inference_s, batch_size)


class _Submission:
    """The requests of one event-loop turn that want the same outputs, sent to the engine as one group:
    the engine process pays its per-request work (a frame, a queue entry, an answer) once for all of them.
    Each request's future gets its own rows of the answer."""

    __slots__ = ("futures", "parts", "rows", "cancelled")

    def __init__(self) -> None:
        self.futures: list[asyncio.Future] = []
        self.parts: list[Sequences] = []
        self.rows = 0
        self.cancelled = 0

    def add(self, future: asyncio.Future, sequences: Sequences) -> None:
        self.futures.append(future)
        self.parts.append(sequences)
        self.rows += len(sequences)

    def answer(self, result: GroupResult) -> None:
        first = 0
        for future, part in zip(self.futures, self.parts):
            n = len(part)
            if not future.done():
                rows = result.outputs if len(self.parts) == 1 else {
                    name: value[first: first + n] for name, value in result.outputs.items()}
                future.set_result(GroupResult(rows, result.queue_s, result.inference_s, result.batch_size))
            first += n

    def fail(self, make_error: Callable[[], BaseException]) -> None:
        for future in self.futures:
            if not future.done():
                future.set_exception(make_error())


class EngineClient:
    """The Batcher (app.backend) of an HTTP worker process: `submit_group()` sends the work to the engine
    process and returns a future of the group's GroupResult; cancelling it drops the work there too.
    `metrics`: where each answered group's hops are recorded (Metrics.observe_link)."""

    def __init__(self, socket_path: str, on_lost: Callable[[], None] | None = None, metrics: Metrics | None = None,
                 max_queued: int | None = None):
        self.socket_path, self.on_lost, self.metrics = socket_path, on_lost, metrics
        # The engine's queue limit (max_queued_sequences): the engine refuses a group past it whole, as one request
        # too large (413), so requests are gathered only while their group stays within it.
        self.max_queued = max_queued
        self.info: EngineInfo | None = None
        self._link: _Framed | None = None
        self._hello: asyncio.Future | None = None
        # Sent and not yet answered, by group id: (requests, lengths, when sent)
        self._pending: dict[int, tuple[_Submission, np.ndarray, float]] = {}
        self._gathering: dict[int, _Submission] = {}  # this loop turn's requests, by outputs mask
        self._ids = itertools.count()
        self._closed = True

    @property
    def max_batch_tokens(self) -> int:
        return self.info.max_batch_tokens

    @property
    def inference_workers(self) -> int:
        return self.info.inference_workers

    async def connect(self) -> EngineInfo:
        loop = asyncio.get_running_loop()
        self._hello = loop.create_future()
        _, self._link = await loop.create_unix_connection(lambda: _Framed(self._on_frame, self._on_lost),
                                                          self.socket_path)
        self.info = await self._hello
        self._closed = False
        return self.info

    async def stop(self) -> None:
        self._closed = True
        if self._link is not None and self._link.transport is not None:
            self._link.transport.close()
        self._fail_pending("the server is shutting down")

    def check_admission(self) -> None:
        """The queue is the engine process's: its batcher decides when the request is submitted."""

    def submit_group(self, sequences: Sequences, outputs: frozenset[str]) -> asyncio.Future:
        """Joins this loop turn's submission for the same outputs, sent when the turn ends (no wait)."""
        if self._closed:
            raise errors.NotReady("the engine process is not available")
        loop = asyncio.get_running_loop()
        mask = _MASKS.get(outputs)
        if mask is None:  # a name the link does not carry: the bits of those it does
            mask = sum(1 << i for i, name in enumerate(_OUTPUTS) if name in outputs)
        future = loop.create_future()
        if len(sequences) >= _GATHER_ROWS:  # pays its own way: sent now, on its own, answered sooner
            alone = _Submission()
            alone.add(future, sequences)
            self._send(mask, alone)
            return future
        submission = self._gathering.get(mask)
        if submission is not None and not self._fits(submission, len(sequences)):
            self._send(mask, self._gathering.pop(mask))  # this request starts the next group
            submission = None
        if submission is None:
            if not self._gathering:
                loop.call_soon(self._send_gathered)
            submission = self._gathering[mask] = _Submission()
        submission.add(future, sequences)
        if submission.rows >= _GATHER_ROWS:
            self._send(mask, self._gathering.pop(mask))
        return future

    def _fits(self, submission: _Submission, rows: int) -> bool:
        """Whether `rows` more sequences keep the gathered group within the engine's queue limit."""
        return self.max_queued is None or submission.rows + rows <= self.max_queued

    def _send_gathered(self) -> None:
        gathered, self._gathering = self._gathering, {}
        for mask, submission in gathered.items():
            self._send(mask, submission)
        if not self._closed:  # this already runs a turn after the requests came: no second turn's wait
            self._link.flush()

    def _send(self, mask: int, submission: _Submission) -> None:
        if self._closed:
            submission.fail(lambda: errors.NotReady("the engine process is gone"))
            return
        rid = next(self._ids)
        sequences = Sequences.joined(submission.parts)
        self._pending[rid] = (submission, sequences.lengths, time.monotonic())
        self._link.send(_SUBMIT.pack(SUBMIT, mask, len(sequences), rid), sequences.lengths.astype(np.int32),
                        sequences.ids.astype(np.int32), sequences.type_ids.astype(np.uint8))
        done = functools.partial(self._done, rid)
        for future in submission.futures:
            future.add_done_callback(done)

    def _done(self, rid: int, future: asyncio.Future) -> None:
        """A request that was cancelled (its client went away); when every request of its submission was,
        the engine drops the work too."""
        entry = self._pending.get(rid)
        if entry is None or not future.cancelled():
            return
        submission = entry[0]
        submission.cancelled += 1
        if submission.cancelled == len(submission.futures):
            del self._pending[rid]
            if not self._closed:
                self._link.send(_REQUEST.pack(CANCEL, rid))

    def _on_frame(self, kind: int, frame: bytearray) -> None:
        if kind == HELLO:
            if not self._hello.done():
                self._hello.set_result(pickle.loads(memoryview(frame)[_HELLO.size:]))
            return
        rid = _REQUEST.unpack_from(frame)[1] if kind == ERROR else _RESULT.unpack_from(frame)[3]
        submission, lengths, sent_at = self._pending.pop(rid, (None, None, None))
        if submission is None:
            return  # every request of it was cancelled meanwhile
        if kind == RESULT:
            try:
                result = _read_result(frame, lengths)
            except Exception:  # its requests hear of it; the link closes (_Framed._deliver), failing the rest
                submission.fail(lambda: errors.InternalError("the engine process's answer could not be read"))
                raise
            if self.metrics is not None:  # one clock for every process of the host: time.monotonic()
                received_at, answered_at = _RESULT.unpack_from(frame)[6:]
                self.metrics.observe_link(received_at - sent_at, answered_at - received_at,
                                          time.monotonic() - answered_at)
            submission.answer(result)
        elif kind == ERROR:
            payload = bytes(frame[_REQUEST.size:])
            submission.fail(lambda: _error_from(payload))
        else:
            raise ValueError(f"unexpected frame kind {kind} from the engine")

    def _on_lost(self, exc: Exception | None) -> None:
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(ConnectionError("the engine process closed the link before greeting"))
        if not self._closed:
            log.error("lost the engine process (%s); answering 503 from now on", exc or "closed")
            self._closed = True
            self._fail_pending("the engine process is gone")
            if self.on_lost:
                self.on_lost()

    def _fail_pending(self, message: str) -> None:
        for submission in [*(entry[0] for entry in self._pending.values()), *self._gathering.values()]:
            submission.fail(lambda: errors.NotReady(message))
        self._pending.clear()
        self._gathering.clear()


# An HTTP worker tokenises on its event loop any request of up to this many characters in all (a few ms of
# tokenising): its processes are its parallelism, and the hop to a thread and back costs more CPU than it
# saves (bench/http_worker_load.py; create_worker_app also turns off the tokenizer's own threads, which
# cost more still when called from the event loop).
WORKER_INLINE_TOKENIZING = InlineTokenizing(max_texts=None, max_chars=16384)


def connect_to_engine(socket_path: str):
    """The deployment mode of an HTTP worker process (app.backend.StartBackend): its batcher is the engine
    process's, reached over `socket_path`."""

    async def start(settings, manifest, tokenizer, metrics, on_lost) -> Backend:
        client = EngineClient(socket_path, on_lost, metrics, settings.max_queued_sequences)
        info = await client.connect()
        return Backend(client, info, WORKER_INLINE_TOKENIZING)

    return start


__all__ = ["EngineClient", "EngineInfo", "GroupResult", "connect_to_engine", "serve_workers"]
