"""Replaying lanes that take turns on the GPU (cuda_graph_lanes of 2 or more).

With one lane the GPU waits while the replaying thread gets the next batch ready on the host: it takes
the batch from the queue, packs it and copies it into the bucket's buffers (about a fifth of that thread's
time under one-text load, BENCHMARKS.md). With lanes taking turns, one replays while the next gets its
batch ready in its own buffers, and only one replays at a time: replays side by side cost more GPU time
per text than the larger batches they replace, and through HTTP side-by-side lanes lost to one lane.

A lane takes its next batch only when the running replay is due to end, less the time a lane needs to
get a batch ready (both measured as they run): its batch then holds the work that came in the meantime,
not the little that came since the other lane took its own.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

_SMOOTHING = 0.1  # the weight of the latest measurement in the running means
# A lane takes its batch this much earlier still: a sleep overshoots by tens of µs, and a replay that ends
# before the next lane is ready leaves the GPU idle, where one that ends after only keeps that lane waiting.
_MARGIN_S = 150e-6


class ReplayTurns:
    """Shared by the lanes of one engine: `turn(bucket)` around each replay, `wait_to_take()` before a lane
    takes its next batch (and `not_taken()` when it found none)."""

    def __init__(self) -> None:
        self._gpu = threading.Lock()
        self._due = 0.0  # time.perf_counter() at which the replay running now should end; 0: none running
        self._replay_s: dict[Hashable, float] = {}  # a replay's running mean time, by bucket
        self._ready_s = 0.0  # running mean time from taking a batch to asking for its turn
        self._taking = threading.local()  # when this thread took its batch

    @property
    def ready_s(self) -> float:
        return self._ready_s

    def expected_s(self, bucket: Hashable) -> float | None:
        """How long a replay of this bucket takes, as measured so far; None before its first turn."""
        return self._replay_s.get(bucket)

    def wait_to_take(self) -> None:
        """Sleep until the running replay is due to end, less a lane's time to get ready; again if another
        replay started meanwhile (the other lane took the work and runs it). Then the caller takes its batch."""
        while True:
            delay = self._due - self._ready_s - _MARGIN_S - time.perf_counter()
            if delay <= 0:
                break
            time.sleep(delay)
        self._taking.at = time.perf_counter()

    def not_taken(self) -> None:
        """The caller of wait_to_take found no batch: no time to get ready is measured."""
        self._taking.at = None

    @contextmanager
    def turn(self, bucket: Hashable) -> Iterator[None]:
        """The GPU to this thread's replay of `bucket`, once no other lane's replay runs."""
        taken_at = getattr(self._taking, "at", None)
        if taken_at is not None:
            self._taking.at = None
            self._ready_s += _SMOOTHING * (time.perf_counter() - taken_at - self._ready_s)
        with self._gpu:
            started = time.perf_counter()
            expected = self._replay_s.get(bucket)
            self._due = 0.0 if expected is None else started + expected
            try:
                yield
            finally:
                took = time.perf_counter() - started
                self._due = 0.0
                self._replay_s[bucket] = took if expected is None else expected + _SMOOTHING * (took - expected)
