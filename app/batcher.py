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
        self._running: set[asyncio.Task] = set()
        self._closed = True

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._closed = False
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
            batch = self._take_batch()
            task = asyncio.create_task(self._execute(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _wait_for_work(self) -> None:
        """Until some live entry is queued; then, while the batch is not full, until the oldest has
        waited max_wait_ms (a busy worker already gives arrivals time to gather)."""
        while True:
            self._drop_cancelled()
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            while not self._is_full():
                remaining = self._queue[0].enqueued + self.max_wait_s - time.perf_counter()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            self._drop_cancelled()
            if self._queue:  # else everything waiting was cancelled meanwhile
                return

    async def _execute(self, entries: list[Entry]) -> None:
        try:
            started = time.perf_counter()
            outputs = frozenset().union(*(e.outputs for e in entries))
            loop = asyncio.get_running_loop()
            try:
                batch, result = await loop.run_in_executor(self._executor, self._collate_and_run, entries, outputs)
            except Exception as e:  # noqa: BLE001 - every waiting request must hear about it
                log.exception("inference failed on a batch of %d", len(entries))
                for entry in entries:
                    if not entry.future.done():
                        entry.future.set_exception(e)
                return
            inference_s = time.perf_counter() - started
            if self._metrics:
                self._metrics.observe_batch(len(entries), batch.input_ids.size, inference_s)
            for row, entry in enumerate(entries):
                if entry.future.done():  # cancelled while running
                    continue
                mine = {name: (value[row, : entry.length] if value.ndim == 3 else value[row])
                        for name, value in result.items() if name in entry.outputs}
                entry.future.set_result(EntryResult(mine, started - entry.enqueued, inference_s, len(entries)))
        finally:
            self._slots.release()
            self._wakeup.set()

    def _collate_and_run(self, entries: list[Entry], outputs: frozenset[str]) -> tuple[Batch, dict[str, np.ndarray]]:
        """Worker thread: pad to the longest in the batch and run the engine."""
        longest = max(e.length for e in entries)
        ids = np.full((len(entries), longest), self.pad_id, dtype=np.int64)  # [B, S]
        mask = np.zeros((len(entries), longest), dtype=np.int64)
        types = np.zeros((len(entries), longest), dtype=np.int64)
        for row, e in enumerate(entries):
            ids[row, : e.length] = e.ids
            mask[row, : e.length] = 1
            types[row, : e.length] = e.type_ids
        batch = Batch(ids, mask, types, tuple(sorted(outputs)))
        return batch, self._run(batch)
