"""DynamicBatcher: packs queued sequences into padded batches under a token budget and runs them.

Each queued entry carries its own future and timings. A batch is built around the oldest waiting
entry (so nothing starves) from the waiting entries closest to it in length (so padding stays small),
up to `max_batch_tokens` counted padded (batch size x longest) and `max_batch_size`. Entries whose
future was cancelled (the client went away) are dropped before they cost inference.
"""
from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from app.engine import Batch
from app.errors import NotReady, Overloaded
from app.metrics import Metrics

log = logging.getLogger("app.batcher")
_LOOKAHEAD = 8  # candidates considered per batch: this many times max_batch_size


@dataclass(eq=False, slots=True)
class Entry:
    ids: np.ndarray  # [n] int64
    type_ids: np.ndarray  # [n] int64
    outputs: frozenset[str]
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)

    @property
    def length(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, slots=True)
class EntryResult:
    outputs: dict[str, np.ndarray]  # this entry's rows: [H] vectors, [2] logits, [n, H] token vectors
    queue_s: float
    inference_s: float
    batch_size: int


class DynamicBatcher:
    def __init__(self, run: Callable[[Batch], dict[str, np.ndarray]], *, pad_id: int, max_batch_tokens: int,
                 max_batch_size: int, max_wait_ms: float, max_queued: int, workers: int = 1,
                 metrics: Metrics | None = None):
        self._run = run
        self.pad_id = pad_id
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.max_wait_s, self.max_queued = max_wait_ms / 1000, max_queued
        self._workers = workers
        self._metrics = metrics
        self._queue: list[Entry] = []  # FIFO
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(workers)
        self._executor: ThreadPoolExecutor | None = None
        self._loop_task: asyncio.Task | None = None
        self._running: set[asyncio.Future] = set()  # one per batch in a worker thread
        self._running_batches = 0
        self._last_finish = 0.0  # perf_counter() when the last batch finished
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        self._closed = True

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._closed = False
        self._loop_ref = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="inference")
        self._loop_task = asyncio.create_task(self._loop(), name="batcher")

    async def stop(self) -> None:
        """Refuse new work, finish the batches already running, fail whatever is still queued."""
        self._closed = True
        if self._loop_task:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        for entry in self._queue:
            if not entry.future.done():
                entry.future.set_exception(NotReady("the server is shutting down"))
        self._queue.clear()
        self._set_depth()
        if self._executor:
            self._executor.shutdown(wait=True)

    # -- admission ---------------------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(self, sequences: list[tuple[np.ndarray, np.ndarray]], outputs: frozenset[str]) -> list[asyncio.Future]:
        """Queue the sequences of one request; all or none. Raises Overloaded past the queue limit."""
        if self._closed:
            raise NotReady("the server is shutting down")
        if len(self._queue) + len(sequences) > self.max_queued:
            raise Overloaded(f"the queue is full ({len(self._queue)} sequences waiting, limit {self.max_queued}); "
                             f"retry later")
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        entries = [Entry(ids, types, outputs, loop.create_future(), now) for ids, types in sequences]
        self._queue.extend(entries)
        self._set_depth()
        self._wakeup.set()
        return [e.future for e in entries]

    def _set_depth(self) -> None:
        if self._metrics:
            self._metrics.queue_depth.set(len(self._queue))

    # -- batching ----------------------------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        alive = [e for e in self._queue if not e.future.done()]
        dropped = len(self._queue) - len(alive)
        if dropped:
            self._queue = alive
            self._set_depth()
            if self._metrics:
                self._metrics.dropped_sequences.inc(dropped)

    def _is_full(self) -> bool:
        n = len(self._queue)
        if n >= self.max_batch_size:
            return True
        return n * max(e.length for e in self._queue) >= self.max_batch_tokens

    def _take_batch(self) -> list[Entry]:
        """The oldest entry plus its nearest neighbours in length, within the budget and size cap."""
        window = self._queue[: self.max_batch_size * _LOOKAHEAD]
        anchor = window[0]
        ordered = sorted(window, key=lambda e: e.length)
        lengths = [e.length for e in ordered]
        pos = ordered.index(anchor, bisect.bisect_left(lengths, anchor.length))
        lo, hi = pos, pos + 1  # chosen = ordered[lo:hi]
        longest = anchor.length
        while hi - lo < self.max_batch_size:
            # Prefer the shorter neighbour when it costs no extra padding, else the closer one.
            down = ordered[lo - 1] if lo > 0 else None
            up = ordered[hi] if hi < len(ordered) else None
            if down is None and up is None:
                break
            if up is None or (down is not None and anchor.length - down.length <= up.length - anchor.length):
                candidate, new_longest = down, longest
            else:
                candidate, new_longest = up, max(longest, up.length)
            if (hi - lo + 1) * new_longest > self.max_batch_tokens:
                break
            if candidate is down:
                lo -= 1
            else:
                hi += 1
            longest = new_longest
        chosen = ordered[lo:hi]
        taken = set(map(id, chosen))
        self._queue = [e for e in self._queue if id(e) not in taken]
        self._set_depth()
        return chosen

    async def _loop(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                await self._wait_for_work()
            except BaseException:
                self._slots.release()
                raise
            self._launch(self._take_batch())

    def _arrived_idle(self) -> bool:
        """Whether the oldest entry came to an idle batcher: no batch running then or now. Work that
        queued up behind a running batch has waited already, so it runs as soon as a slot is free."""
        return self._running_batches == 0 and self._queue[0].enqueued > self._last_finish

    async def _wait_for_work(self) -> None:
        """Until some live entry is queued; then, only for work that came to an idle batcher and while
        the batch is not full, until the oldest has waited max_wait_ms."""
        while True:
            self._drop_cancelled()
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self.max_wait_s > 0 and self._arrived_idle():
                await self._gather_more()
                self._drop_cancelled()
            if self._queue:  # else everything waiting was cancelled meanwhile
                return

    async def _gather_more(self) -> None:
        while not self._is_full():
            remaining = self._queue[0].enqueued + self.max_wait_s - time.perf_counter()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                return

    # -- running -----------------------------------------------------------------------------------------
    def _launch(self, entries: list[Entry]) -> None:
        """Hand the batch to a worker thread; `_finish` runs back on the loop, once per batch."""
        outputs = frozenset().union(*(e.outputs for e in entries))
        done = self._loop_ref.create_future()
        self._running.add(done)
        self._running_batches += 1
        self._executor.submit(self._work, entries, outputs, time.perf_counter(), done)

    def _work(self, entries: list[Entry], outputs: frozenset[str], started: float, done: asyncio.Future) -> None:
        """Worker thread: collate, run, and post the outcome to the loop in one thread-safe call."""
        try:
            batch = collate([e.ids for e in entries], [e.type_ids for e in entries], self.pad_id, outputs)
            outcome: dict[str, np.ndarray] | Exception = self._run(batch)
            tokens = batch.input_ids.size
        except Exception as e:  # noqa: BLE001 - every waiting request must hear about it
            outcome, tokens = e, 0
        self._loop_ref.call_soon_threadsafe(self._finish, entries, outcome, tokens, started, done)

    def _finish(self, entries: list[Entry], outcome: dict[str, np.ndarray] | Exception, tokens: int,
                started: float, done: asyncio.Future) -> None:
        now = time.perf_counter()
        self._running_batches -= 1
        self._last_finish = now
        self._slots.release()
        self._wakeup.set()
        self._running.discard(done)
        done.set_result(None)
        if isinstance(outcome, Exception):
            log.error("inference failed on a batch of %d", len(entries), exc_info=outcome)
            for entry in entries:
                if not entry.future.done():
                    entry.future.set_exception(outcome)
            return
        inference_s = now - started
        if self._metrics:
            self._metrics.observe_batch(len(entries), tokens, inference_s)
        size = len(entries)
        for row, entry in enumerate(entries):
            if entry.future.done():  # cancelled while running
                continue
            mine = {name: (value[row, : entry.length] if value.ndim == 3 else value[row])
                    for name, value in outcome.items() if name in entry.outputs}
            entry.future.set_result(EntryResult(mine, started - entry.enqueued, inference_s, size))


def collate(ids: list[np.ndarray], type_ids: list[np.ndarray], pad_id: int, outputs: frozenset[str]) -> Batch:
    """Pad sequences to the longest with a few whole-array operations (not three per row)."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    real = np.arange(lengths.max()) < lengths[:, None]  # [B, S] True on real tokens; filled row-major
    input_ids = np.full(real.shape, pad_id, dtype=np.int64)
    input_ids[real] = np.concatenate(ids)
    token_type_ids = np.zeros(real.shape, dtype=np.int64)
    token_type_ids[real] = np.concatenate(type_ids)
    return Batch(input_ids, real.astype(np.int64), token_type_ids, tuple(sorted(outputs)))
