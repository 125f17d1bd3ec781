"""DynamicBatcher: packs queued sequences into batches under a token budget and runs them.

A request's sequences arrive end to end (`Sequences`: one ids array, one type-ids array, their lengths)
and are queued as one `Group` with ONE future, so no per-sequence Python objects are made where none
are needed.

A packed graph (ORT's RemovePadding, the CUDA default) costs by real tokens, not padded ones: there a
request is ONE queue entry, batches are taken first come first served up to `max_batch_tokens` real
tokens and `max_batch_size` rows, and an entry that does not fit is split at a row boundary.

A padded graph (the CPU) costs batch size x longest: there each sequence is its own entry, and a batch
is built around the oldest waiting entry (so nothing starves) from the waiting entries closest to it in
length (so padding stays small), up to `max_batch_tokens` counted padded and `max_padding`.

On a CUDA-graph session's thread (OrtEngine.replay_next) the batcher takes that session's next batch
itself, right after a replay, when the whole queue replays there: the session then does not wait for a
turn of the event loop between batches.

Either way a group's rows are copied into one [n, ...] array per output as its batches finish, and its
future resolves when the last row is in. Groups whose future was cancelled (the client went away) are
dropped before they cost inference.
"""
from __future__ import annotations

import asyncio
import bisect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from app.engine import Batch
from app.backlog import EngineSpeed, retry_after_s
from app.errors import EngineLost, InternalError, NotReady, Overloaded, ServiceError, TooManyInputs
from app.metrics import Metrics
from app.pooling import graph_outputs, pool_batch, pooled_here
from artifact.manifest import TOKEN_EMBEDDINGS

log = logging.getLogger("app.batcher")
_LOOKAHEAD = 2  # candidates considered per batch: this many times max_batch_size (sorting costs per candidate)


@dataclass(frozen=True, slots=True)
class Sequences:
    """Token sequences end to end: sequence i is ids[starts[i]: starts[i] + lengths[i]]."""
    ids: np.ndarray  # [total] integer token ids
    type_ids: np.ndarray  # [total] integer segment ids
    lengths: np.ndarray  # [n] int64

    @classmethod
    def concat(cls, ids: Sequence[np.ndarray], type_ids: Sequence[np.ndarray]) -> "Sequences":
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        return cls(np.concatenate(ids), np.concatenate(type_ids), lengths)

    @classmethod
    def joined(cls, parts: Sequence) -> "Sequences":
        """`parts` end to end: anything with ids, type_ids and lengths (Sequences, queue entries)."""
        if len(parts) == 1:
            return cls(parts[0].ids, parts[0].type_ids, parts[0].lengths)
        return cls(np.concatenate([p.ids for p in parts]), np.concatenate([p.type_ids for p in parts]),
                   np.concatenate([p.lengths for p in parts]))

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def starts(self) -> np.ndarray:
        starts = np.zeros(len(self.lengths), dtype=np.int64)
        np.cumsum(self.lengths[:-1], out=starts[1:])
        return starts


@dataclass(frozen=True, slots=True)
class GroupResult:
    """One request's outputs, row i for its sequence i: [n, H] vectors, [n, 2] logits; token vectors
    (ragged) as a list of n [len_i, H] arrays."""
    outputs: dict[str, np.ndarray | list[np.ndarray]]
    queue_s: float  # longest wait of its sequences for a batch
    inference_s: float  # longest batch it was part of
    batch_size: int


@dataclass(eq=False, slots=True)
class Group:
    """The sequences of one request, waiting for their rows; `future` gets a GroupResult of its `answers`
    (graph outputs, and vectors pooled from the token vectors: app.pooling.TOKEN_POOLED); `outputs` are the
    graph outputs that give them."""
    outputs: frozenset[str]
    answers: frozenset[str]
    future: asyncio.Future
    size: int
    enqueued: float
    pending: int = 0
    rows: dict[str, np.ndarray | list] = field(default_factory=dict)
    queue_s: float = 0.0
    inference_s: float = 0.0
    batch_size: int = 0

    def fill(self, outcome: dict[str, np.ndarray], spans: list[tuple[int, "Entry"]], started: float,
             inference_s: float, batch_size: int) -> None:
        """Copy this group's rows of one finished batch (its entries, each at its first batch row);
        resolve the future once all rows are in."""
        rows = sum(e.count for _, e in spans)
        for name in self.answers:
            value = outcome[name]
            if value.ndim == 3:  # token vectors: cut each row's padding off
                dest = self.rows.get(name)
                if dest is None:
                    dest = self.rows[name] = [None] * self.size
                for b, e in spans:
                    for k, n in enumerate(e.lengths.tolist()):
                        dest[e.first + k] = value[b + k, :n]
            elif rows == self.size and len(spans) == 1:  # the whole group, in order: a view, no copy
                b = spans[0][0]
                self.rows[name] = value[b: b + rows]
            else:
                dest = self.rows.get(name)
                if dest is None:
                    dest = self.rows[name] = np.empty((self.size, *value.shape[1:]), dtype=value.dtype)
                for b, e in spans:
                    dest[e.first: e.first + e.count] = value[b: b + e.count]
        self.queue_s = max(self.queue_s, started - self.enqueued)
        self.inference_s = max(self.inference_s, inference_s)
        self.batch_size = max(self.batch_size, batch_size)
        self.pending -= rows
        if self.pending == 0 and not self.future.done():
            self.future.set_result(GroupResult(self.rows, self.queue_s, self.inference_s, self.batch_size))


@dataclass(eq=False, slots=True)
class Entry:
    """Rows first .. first + count - 1 of a group, queued together: a whole request (packed graphs; split
    when it does not fit a batch) or one sequence (padded graphs)."""
    ids: np.ndarray  # these rows' ids end to end
    type_ids: np.ndarray
    lengths: np.ndarray  # [count] int64
    group: Group
    first: int
    tokens: int  # real tokens: len(ids)

    @property
    def count(self) -> int:
        return len(self.lengths)

    @property
    def length(self) -> int:
        """The sequence length of a one-row entry (padded graphs sort by it)."""
        return self.tokens

    @property
    def enqueued(self) -> float:
        return self.group.enqueued

    def split(self, rows: int) -> tuple["Entry", "Entry"]:
        """The first `rows` rows and the rest."""
        cut = int(self.lengths[:rows].sum())
        return (Entry(self.ids[:cut], self.type_ids[:cut], self.lengths[:rows], self.group, self.first, cut),
                Entry(self.ids[cut:], self.type_ids[cut:], self.lengths[rows:], self.group, self.first + rows,
                      self.tokens - cut))


class DynamicBatcher:
    """The in-process Batcher (app.backend): batches run on this process's engine, in worker threads."""

    def __init__(self, run: Callable[[Batch], dict[str, np.ndarray]], *, pad_id: int, max_batch_tokens: int,
                 max_batch_size: int, max_wait_ms: float, max_queued: int, inference_workers: int = 1,
                 packed: bool = False, max_padding: float = 1.0, max_queue_ms: float | None = None,
                 overlap_min_tokens: int | None = None, metrics: Metrics | None = None,
                 on_engine_lost: Callable[[], None] | None = None,
                 replay_thread: Callable[[int, int, int, frozenset[str], bool], Executor | None] | None = None,
                 replay_busy: Callable[[int, frozenset[str]], bool] | None = None,
                 replay_next: Callable[[Callable[[int, int, frozenset[str]], list | None]], list | None] | None = None,
                 replay_abandoned: Callable[[], None] | None = None,
                 graph_offers: frozenset[str] = frozenset()):
        self._run = run
        self._graph_offers = graph_offers  # the engine's graph outputs: a pooled vector among them is not pooled here
        # (rows, longest, tokens, outputs, alone) -> the thread a batch should run on instead of an inference
        # thread, or None (OrtEngine.replay_thread: a CUDA graph replays there, one hop fewer).
        self._replay_thread = replay_thread
        # (queued tokens, the oldest's outputs) -> whether such a batch would replay but wait for a busy lane
        # (OrtEngine.replay_busy): the work then stays queued and joins the next, larger batch.
        self._replay_busy = replay_busy
        # (take) -> the batch take(rows, tokens, outputs) chose for the replaying session whose thread calls it,
        # that session kept claimed for it (OrtEngine.replay_next): a session goes on to queued work itself.
        self._replay_next = replay_next
        # On that thread, after a batch claimed for it failed before reaching the engine, whose run would have
        # ended the claim (OrtEngine.replay_abandoned).
        self._replay_abandoned = replay_abandoned
        self._on_engine_lost = on_engine_lost  # called (on the loop) after a batch fails with EngineLost
        self.pad_id = pad_id
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.max_wait_s, self.max_queued = max_wait_ms / 1000, max_queued
        self.packed = packed
        self.max_padding = max_padding  # padded graphs: most of a batch's padded tokens that may be padding
        self.inference_workers = inference_workers  # batches run at once, each in its own thread
        # A batch starts beside a running one only once this many tokens are queued (None: any work).
        self.overlap_min_tokens = overlap_min_tokens
        self._metrics = metrics
        self._queue: list[Entry] = []  # FIFO
        # The queue and its counts: the loop, and a replaying session's thread taking its next batch.
        self._queue_lock = threading.Lock()
        self._queued_rows = 0  # sequences in _queue
        self._queued_tokens = 0  # their real tokens
        self.max_queue_s = None if max_queue_ms is None else max_queue_ms / 1000
        self.speed = EngineSpeed()
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(inference_workers)
        self._executor: ThreadPoolExecutor | None = None
        self._loop_task: asyncio.Task | None = None
        self._running: set[asyncio.Future] = set()  # one per batch in a worker thread
        self._running_batches = 0
        self._last_finish = 0.0  # perf_counter() when the last batch finished
        self._last_timed_finish = 0.0  # and the last one that timed the speed (_times_speed)
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        self._closed = True
        self._cancelled = False  # some queued group was cancelled since the queue was last swept

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._closed = False
        self._loop_ref = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(self.inference_workers, thread_name_prefix="inference")
        self._loop_task = asyncio.create_task(self._loop(), name="batcher")

    async def stop(self) -> None:
        """Refuse new work, finish the batches already running, fail whatever is still queued."""
        self._closed = True
        if self._loop_task:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        with self._queue_lock:
            left, self._queue = self._queue, []
            self._set_depth(0, 0)
        for entry in left:
            if not entry.group.future.done():
                entry.group.future.set_exception(NotReady("the server is shutting down"))
        if self._executor:
            self._executor.shutdown(wait=True)

    # -- admission ---------------------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Sequences waiting for a batch."""
        return self._queued_rows

    def expected_wait_s(self) -> float:
        """How long work queued now would wait for its batch: the queued tokens at the measured speed."""
        return self.speed.seconds_for(self._queued_tokens)

    def check_admission(self) -> None:
        """Overloaded (429, Retry-After from the backlog) when work queued now would wait past max_queue_ms.
        Until a batch has finished the speed is unknown: then at most one full batch per inference worker
        is queued, so a burst at start-up cannot queue minutes of work."""
        if self.max_queue_s is None:
            return
        if not self.speed.measured:
            if self._queued_tokens >= self.max_batch_tokens * self.inference_workers:
                raise Overloaded("the server has just started and is measuring its speed; retry in a moment")
            return
        wait = self.expected_wait_s()
        if wait > self.max_queue_s:
            raise Overloaded(f"the queue holds about {wait:.1f} s of work (limit {self.max_queue_s:g} s); retry "
                             f"later", retry_after_s(wait))

    def submit_group(self, sequences: Sequences, outputs: frozenset[str]) -> asyncio.Future:
        """Queue the sequences of one request, all or none; the future gets one GroupResult of `outputs`
        (graph outputs, or TOKEN_POOLED vectors). Raises Overloaded past the queue limits (sequences, and
        time)."""
        if self._closed:
            raise NotReady("the server is shutting down")
        n = len(sequences)
        if n > self.max_queued:  # could never be queued: no use retrying it
            raise TooManyInputs(f"the request has {n} sequences; the server queues at most {self.max_queued} at once "
                                f"(max_queued_sequences): send fewer per request")
        if self._queued_rows + n > self.max_queued:
            raise Overloaded(f"the queue is full ({self._queued_rows} sequences waiting, limit {self.max_queued}); "
                             f"retry later", retry_after_s(self.expected_wait_s()))
        self.check_admission()
        group = Group(graph_outputs(outputs, self._graph_offers), outputs, asyncio.get_running_loop().create_future(),
                      n, time.perf_counter(), pending=n)
        group.future.add_done_callback(self._note_cancel)
        ids, type_ids, lengths = sequences.ids, sequences.type_ids, sequences.lengths
        if self.packed:
            entries = [Entry(ids, type_ids, lengths, group, 0, len(ids))]
        else:
            spans = enumerate(zip(sequences.starts.tolist(), lengths.tolist()))
            entries = [Entry(ids[start: start + length], type_ids[start: start + length], lengths[i:i + 1], group, i,
                             length) for i, (start, length) in spans]
        with self._queue_lock:
            self._queue += entries
            self._set_depth(self._queued_rows + n, self._queued_tokens + len(ids))
        self._wakeup.set()
        return group.future

    def _set_depth(self, rows: int, tokens: int) -> None:
        self._queued_rows, self._queued_tokens = rows, tokens
        if self._metrics:
            self._metrics.queue_depth.set(rows)

    # -- batching ----------------------------------------------------------------------------------------
    def _note_cancel(self, future: asyncio.Future) -> None:
        """A group that ended early (cancelled, or failed in one of its batches) may still have queued rows."""
        if future.cancelled() or future.exception() is not None:
            self._cancelled = True

    def _drop_cancelled(self) -> None:
        """Sweep the queue only after a cancellation: the sweep costs per queued sequence."""
        if not self._cancelled:
            return
        self._cancelled = False
        with self._queue_lock:
            alive = [e for e in self._queue if not e.group.future.done()]
            if len(alive) == len(self._queue):
                return
            rows = sum(e.count for e in alive)
            dropped = self._queued_rows - rows
            self._queue = alive
            self._set_depth(rows, sum(e.tokens for e in alive))
        if self._metrics:
            self._metrics.dropped_sequences.inc(dropped)

    def _is_full(self) -> bool:
        if self._queued_rows >= self.max_batch_size:
            return True
        if self.packed:
            return sum(e.tokens for e in self._queue) >= self.max_batch_tokens
        return self._queued_rows * max(e.length for e in self._queue) >= self.max_batch_tokens

    def _take_in_order(self) -> list[Entry]:
        """Packed graphs: the oldest rows, within the real-token budget and the size cap (at least one
        row); the entry at the edge is split at the last row that fits."""
        queue, tokens_left, rows_left = self._queue, self.max_batch_tokens, self.max_batch_size
        n = 0
        while n < len(queue) and rows_left > 0:
            entry = queue[n]
            if entry.count <= rows_left and entry.tokens <= tokens_left:
                tokens_left -= entry.tokens
                rows_left -= entry.count
                n += 1
                continue
            # Rows of this entry that fit: within both limits, and at least one for an empty batch.
            fit = min(rows_left, int(np.searchsorted(np.cumsum(entry.lengths), tokens_left, side="right")))
            if n == 0:
                fit = max(fit, 1)
            if fit > 0:
                if fit < entry.count:
                    queue[n: n + 1] = entry.split(fit)
                n += 1
            break
        chosen, self._queue = queue[:n], queue[n:]
        self._set_taken(chosen)
        return chosen

    def _take_batch(self) -> list[Entry]:
        """The oldest entry plus its nearest neighbours in length, within the budget and size cap."""
        if self.packed:
            return self._take_in_order()
        queue = self._queue
        if len(queue) <= self.max_batch_size:
            padded = len(queue) * max(e.length for e in queue)
            if padded <= self.max_batch_tokens and padded - sum(e.length for e in queue) <= self.max_padding * padded:
                self._queue = []  # everything fits: what the search below would choose, without the search
                self._set_depth(0, 0)
                return queue
        window = queue[: self.max_batch_size * _LOOKAHEAD]
        anchor = window[0]
        ordered = sorted(window, key=lambda e: e.length)
        lengths = [e.length for e in ordered]
        pos = ordered.index(anchor, bisect.bisect_left(lengths, anchor.length))
        lo, hi = pos, pos + 1  # chosen = ordered[lo:hi]
        longest, real = anchor.length, anchor.length
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
            padded = (hi - lo + 1) * new_longest
            if padded > self.max_batch_tokens or padded - real - candidate.length > self.max_padding * padded:
                break
            real += candidate.length
            if candidate is down:
                lo -= 1
            else:
                hi += 1
            longest = new_longest
        chosen = ordered[lo:hi]
        taken = set(map(id, chosen))
        self._queue = [e for e in window if id(e) not in taken] + queue[len(window):]
        self._set_taken(chosen)
        return chosen

    def _set_taken(self, chosen: list[Entry]) -> None:
        self._set_depth(self._queued_rows - sum(e.count for e in chosen),
                        self._queued_tokens - sum(e.tokens for e in chosen))

    async def _loop(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                await self._wait_for_work()
            except BaseException:
                self._slots.release()
                raise
            with self._queue_lock:  # a replaying session may have taken the work meanwhile
                batch = self._take_batch() if self._queue else []
            batch = self._live(batch)
            if batch:
                self._launch(batch)
            else:
                self._slots.release()

    def _live(self, entries: list[Entry]) -> list[Entry]:
        """Entries whose group is still waiting: a cancellation whose callback has not run yet (so the
        queue was not swept for it) must not cost inference either."""
        live = [e for e in entries if not e.group.future.done()]
        if len(live) < len(entries) and self._metrics:
            self._metrics.dropped_sequences.inc(sum(e.count for e in entries) - sum(e.count for e in live))
        return live

    def _arrived_idle(self) -> bool:
        """Whether the oldest entry came to an idle batcher: no batch running then or now. Work that
        queued up behind a running batch has waited already, so it runs as soon as a slot is free."""
        return self._running_batches == 0 and self._queue[0].enqueued > self._last_finish

    async def _wait_for_work(self) -> None:
        """Until some live entry is queued; then, only for work that came to an idle batcher and while
        the batch is not full, until the oldest has waited max_wait_ms."""
        while True:
            self._drop_cancelled()
            if not self._queue or self._holds_back():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self.max_wait_s > 0 and self._arrived_idle():
                await self._gather_more()
                self._drop_cancelled()
            if self._queue:  # else everything waiting was cancelled meanwhile
                return

    def _holds_back(self) -> bool:
        """Whether queued work waits for a running batch to finish instead of starting beside it: with
        overlap_min_tokens, until that many tokens are queued; and while it would replay a CUDA graph whose
        every lane is busy (it would only wait on the lane's thread, as a batch too small). Several small
        batches side by side run fewer texts a second on a GPU than fewer, larger ones."""
        if self._running_batches == 0:
            return False
        with self._queue_lock:
            if not self._queue:  # a replaying session took it
                return True
            oldest = self._queue[0].group.outputs
        if self.overlap_min_tokens is not None and self._queued_tokens < self.overlap_min_tokens:
            return True
        return self._replay_busy is not None and self._replay_busy(self._queued_tokens, oldest)

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
        outputs = _outputs_of(entries)
        done = self._loop_ref.create_future()
        self._running.add(done)
        executor = self._executor
        if self._replay_thread is not None:
            rows, tokens = sum(e.count for e in entries), sum(e.tokens for e in entries)
            longest = max(int(e.lengths.max()) for e in entries)
            executor = self._replay_thread(rows, longest, tokens, outputs, self._running_batches == 0) or executor
        # its work came to an idle slot, not queued behind a batch: no batch finished since it came. With
        # several inference workers a lone query that starts beside a running batch is just as alone.
        after_idle = min(e.enqueued for e in entries) > self._last_finish
        self._running_batches += 1
        executor.submit(self._work, entries, outputs, time.perf_counter(), after_idle, done,
                        executor is not self._executor)

    def _work(self, entries: list[Entry], outputs: frozenset[str], started: float, after_idle: bool,
              done: asyncio.Future, replayed: bool) -> None:
        """Worker thread: collate, run, and post the outcome to the loop in one thread-safe call. On a
        replaying session's thread, then the queued work that replays there, in the same slot, until none is
        left: the session would otherwise wait for the loop's next turn between its batches."""
        while True:
            begun = time.perf_counter()
            reached = False  # the engine: on a replaying session's thread, its run ends the session's claim
            try:
                sequences = Sequences.joined(entries)
                batch = collate(sequences, self.pad_id, outputs)
                reached = True
                outcome: dict[str, np.ndarray] | Exception = self._run(batch)
                # pooled here, off the loop, as part of the batch's work
                if pooled := pooled_here(_answers_of(entries), self._graph_offers):
                    outcome = {**outcome, **pool_batch(outcome[TOKEN_EMBEDDINGS], sequences.lengths.tolist(), pooled)}
                tokens = batch.padded_tokens
            except Exception as e:  # noqa: BLE001 - every waiting request must hear about it
                outcome, tokens = e, 0
                if replayed and not reached and self._replay_abandoned is not None:
                    self._replay_abandoned()
            following = None
            if self._replay_next is not None and not isinstance(outcome, Exception):
                following = self._replay_next(self._take_replayable)
            busy = time.perf_counter() - begun
            self._loop_ref.call_soon_threadsafe(self._finish, entries, outcome, tokens, started, after_idle, done,
                                                following is not None, (busy, replayed))
            if following is None:
                return
            entries, started, after_idle = following, time.perf_counter(), False
            outputs = _outputs_of(entries)

    def _times_speed(self, tokens: int, after_idle: bool) -> bool:
        """Whether a finished batch tells the engine's speed, which admission by time extrapolates to queued
        work. A small batch whose work came to an idle slot took mostly the engine's fixed cost a batch (a
        lone query: a millisecond for ten tokens on a GPU that runs a million a second); queued work runs in
        full batches, back to back."""
        return not after_idle or tokens >= self.max_batch_tokens // 2

    def _take_replayable(self, rows: int, tokens: int, outputs: frozenset[str]) -> list[Entry] | None:
        """A replaying session's thread: the whole queue when it is the batch the loop would take and replay
        there (within `rows` and `tokens`, wanting only `outputs`), else None: the loop takes it, and a
        larger batch goes where OrtEngine.replay_thread sends it (a lane uncaptured, or the packed graph)."""
        if not self.packed:
            return None
        with self._queue_lock:
            if (self._closed or not self._queue or self._queued_rows > min(rows, self.max_batch_size)
                    or self._queued_tokens > min(tokens, self.max_batch_tokens)
                    or not all(e.group.outputs <= outputs for e in self._queue)):
                return None
            chosen, self._queue = self._queue, []
            self._set_depth(0, 0)
        return self._live(chosen) or None

    def _finish(self, entries: list[Entry], outcome: dict[str, np.ndarray] | Exception, tokens: int,
                started: float, after_idle: bool, done: asyncio.Future, goes_on: bool,
                busy: tuple[float, bool]) -> None:
        """A batch's outcome, on the loop. `after_idle`: its work came to an idle slot; `goes_on`:
        its thread went on to another batch in the same slot; `busy`: its time on that thread, and whether it
        replayed a CUDA graph there."""
        now = time.perf_counter()
        real_tokens = sum(e.tokens for e in entries)
        if not isinstance(outcome, Exception) and self._times_speed(real_tokens, after_idle):
            # since the last timed batch, not the last batch: a batch left out that ended while this one ran
            # would credit this one's tokens to only the end of its run
            self.speed.batch_finished(real_tokens, now - max(started, self._last_timed_finish))
            self._last_timed_finish = now
        self._last_finish = now
        self._wakeup.set()  # what is left queued may now start (another slot, the packed graph)
        if not goes_on:
            self._running_batches -= 1
            self._slots.release()
            self._running.discard(done)
            done.set_result(None)
        if isinstance(outcome, Exception):
            log.error("inference failed on a batch of %d entries", len(entries), exc_info=outcome)
            # Logged once, here: each request is answered 500 without its own copy of the traceback
            failed = outcome if isinstance(outcome, ServiceError) else InternalError(
                f"inference failed ({type(outcome).__name__}); see the server log")
            for entry in entries:
                if not entry.group.future.done():
                    entry.group.future.set_exception(failed)
            if isinstance(outcome, EngineLost) and self._on_engine_lost is not None:
                self._on_engine_lost()
            return
        inference_s = now - started
        size = sum(e.count for e in entries)
        if self._metrics:
            self._metrics.observe_batch(size, tokens, inference_s, *busy)
        # Each group's entries with their first row in the batch; then one fill per group.
        parts: dict[Group, list[tuple[int, Entry]]] = {}
        row = 0
        for entry in entries:
            part = parts.get(entry.group)
            if part is None:
                parts[entry.group] = [(row, entry)]
            else:
                part.append((row, entry))
            row += entry.count
        for group, spans in parts.items():
            if not group.future.done():  # else cancelled while running
                group.fill(outcome, spans, started, inference_s, size)


def _outputs_of(entries: list[Entry]) -> frozenset[str]:
    """The outputs a batch of these entries must answer: every one any of their requests wants."""
    return frozenset().union(*{e.group.outputs for e in entries})


def _answers_of(entries: list[Entry]) -> frozenset[str]:
    """Everything any of these entries' requests answers."""
    return frozenset().union(*{e.group.answers for e in entries})


def collate(sequences: Sequences, pad_id: int, outputs: frozenset[str]) -> Batch:
    """The batch of these sequences; padded only if the graph that runs it asks for that form."""
    return Batch.of_rows(sequences.ids, sequences.type_ids, sequences.lengths, pad_id, tuple(sorted(outputs)))
