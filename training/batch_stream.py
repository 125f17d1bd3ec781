"""The trainer's endless micro-batches: epoch after epoch from a position that a checkpoint records,
built in the training process or, ahead of need, by worker processes (the same batches in the same order).

Workers are processes, not threads: building a batch is mostly Python (pairs, masks, collation), and a
thread would take turns at the GIL with the training loop, whose kernel launches are Python too."""
from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.utils.data


class BatchSource(Protocol):
    """What the stream needs from `training.data.PretrainingDataset`."""

    def batches(self, epoch: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                skip_batches: int = 0, stride: int = 1) -> Iterator[dict[str, torch.Tensor]]: ...

    def num_batches(self, epoch: int, batch_size: int, world_size: int = 1) -> int: ...

    def draw_ahead(self, epoch: int, steps: int) -> None: ...

    def draw_ahead_step(self) -> None: ...

    def most_frequent_token_id(self) -> int: ...


@dataclass
class StreamBatch:
    epoch: int
    index: int  # the batch's number within its epoch
    tokens: int  # real (non-padding) tokens
    inputs: Any  # what `prepare` made of the collated batch

    def pin_memory(self) -> StreamBatch:
        """DataLoader's pinning thread calls this (pin_memory=True): the arrays a worker sent become
        tensors in page-locked memory, ready for an asynchronous copy to the GPU."""
        self.inputs = map_leaves(lambda a: torch.from_numpy(a).pin_memory(), np.ndarray, self.inputs)
        return self


def _collated(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return batch


class BatchStream:
    """Endless micro-batches of one dataset for one rank, epoch after epoch. `epoch` / `batch_in_epoch`
    are the position after the last batch `next()` returned, so that a checkpoint can restart the
    stream at the very next batch; batches the workers built ahead do not move it.

    `prepare` turns each collated batch into what the caller wants (the trainer: its CPU model inputs),
    in the workers when there are any. `workers` = 0 builds every batch in `next()`. `pin_memory` (with
    workers, on a CUDA host): a thread of this process receives the workers' batches and pins them, so
    that next() neither reads them from the workers' pipes (milliseconds a batch, on the thread that
    launches the GPU's work) nor copies them into page-locked memory."""

    def __init__(self, data: BatchSource, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 epoch: int = 0, batch_in_epoch: int = 0, *, prepare: Callable[[dict], Any] = _collated,
                 workers: int = 0, prefetch: int = 2, pin_memory: bool = False):
        if workers < 0:
            raise ValueError(f"--data-workers must not be negative, got {workers}")
        self.epoch, self.batch_in_epoch = epoch, batch_in_epoch
        self._plan = _Plan(data, batch_size, seed, rank, world_size, prepare)
        self._workers, self._prefetch, self._pin_memory = workers, prefetch, pin_memory
        self._local: Iterator[StreamBatch] | None = None
        self._loader: Any = None  # the DataLoader's iterator over the workers, started on the first next()

    def next(self) -> StreamBatch:
        if self._workers == 0:
            if self._local is None:
                self._local = self._plan.share(self.epoch, self.batch_in_epoch, first=0, stride=1)
            item = next(self._local)
        else:
            if self._loader is None:
                self._loader = iter(self._data_loader())
            item = next(self._loader)
        if isinstance(item, _Failure):
            self.close()
            raise item.error from _WorkerTraceback(item.traceback)
        if self._workers:
            item.inputs = map_leaves(torch.from_numpy, np.ndarray, item.inputs)
        self.epoch, self.batch_in_epoch = item.epoch, item.index + 1
        return item

    def close(self) -> None:
        """Stops the workers and waits for them to exit. A later next() starts again from the position."""
        loader, self._loader, self._local = self._loader, None, None
        if loader is not None:
            # What DataLoader's own __del__ calls; explicit so that no exit path leaves workers behind
            # (a traceback that holds the iterator would delay __del__).
            loader._shutdown_workers()
            for worker in loader._workers:  # still there after its SIGTERM, which workers ignore
                if worker.is_alive():
                    worker.kill()
                    worker.join()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _data_loader(self) -> torch.utils.data.DataLoader:
        # Fork shares the dataset's memory maps and tokenizer instead of pickling them.
        context = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        return torch.utils.data.DataLoader(
            _WorkerShares(self._plan, self.epoch, self.batch_in_epoch), batch_size=None,
            num_workers=self._workers, prefetch_factor=self._prefetch, multiprocessing_context=context,
            pin_memory=self._pin_memory,
            # Worker seeds come from this generator instead of the global RNG, which holds the
            # training's dropout state (a resumed run must draw the same masks as a straight one).
            generator=torch.Generator().manual_seed(0),
            worker_init_fn=functools.partial(_start_worker, os.getpid()))


def _start_worker(trainer_pid: int, worker_id: int) -> None:
    _end_with_trainer(trainer_pid)
    _leave_sigterm_to_trainer()


def _end_with_trainer(trainer_pid: int) -> None:
    """Have the kernel kill this worker when the trainer dies, however it dies. DataLoader's own check of
    its parent is not enough: a worker that finds the trainer gone cannot exit while a batch it queued
    (larger than a pipe's buffer) waits in the pipe, so a `kill -9` of the trainer left its workers running."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != trainer_pid:  # the trainer died before the line above took effect
        os._exit(1)


def _leave_sigterm_to_trainer() -> None:
    """Ignore SIGTERM: the trainer decides what it means (stop at the step's end, with a checkpoint) and
    then stops this worker itself. A stop sent to the whole process group or control group (GNU timeout,
    Slurm, systemd) reaches the workers too, and DataLoader's own handler would end them at once, which
    the trainer reports as a failed worker. SIGINT needs nothing: DataLoader's workers exit quietly on
    Ctrl-C, and the trainer stops at once on it anyway."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@dataclass(frozen=True)
class _Plan:
    """Which batch comes where in the stream, and how each is built."""

    data: BatchSource
    batch_size: int
    seed: int
    rank: int
    world_size: int
    prepare: Callable[[dict], Any]

    def share(self, epoch: int, batch_in_epoch: int, first: int, stride: int) -> Iterator[StreamBatch]:
        """The stream's batches number first, first + stride, ... counted from (epoch, batch_in_epoch).

        Entering an epoch with no batch raises, where the stream would otherwise repeat empty epochs
        for ever."""
        skip = first  # batches of the stream to pass before the next one of this share
        while True:
            count = self.data.num_batches(epoch, self.batch_size, self.world_size)
            start = batch_in_epoch + skip
            mine = range(start, count, stride)
            # The next epoch's pairs, a step after each of this share's first half of batches of this one
            self.data.draw_ahead(epoch + 1, steps=len(mine) // 2)
            if start < count:
                batches = self.data.batches(epoch, self.batch_size, self.seed, rank=self.rank,
                                            world_size=self.world_size, skip_batches=start, stride=stride)
                for index, batch in zip(mine, batches):
                    tokens = int(batch["attention_mask"].sum())
                    yield StreamBatch(epoch, index, tokens, self.prepare(batch))
                    self.data.draw_ahead_step()
            # The first batch of this share at or past the epoch's end, as a distance from that end.
            skip = start - count if start >= count else (start - count) % stride
            epoch, batch_in_epoch = epoch + 1, 0
            if self.data.num_batches(epoch, self.batch_size, self.world_size) == 0:
                raise ValueError(f"the training data yields no batch of {self.batch_size} sequences per "
                                 f"process; use a larger corpus or a smaller --batch-size")


class _WorkerShares(torch.utils.data.IterableDataset):
    """Worker w of N builds the stream's batches w, w + N, w + 2N, ...; DataLoader asks the workers in
    turn and returns their batches in that order, which is the stream's."""

    def __init__(self, plan: _Plan, epoch: int, batch_in_epoch: int):
        self.plan, self.epoch, self.batch_in_epoch = plan, epoch, batch_in_epoch

    def __iter__(self) -> Iterator[StreamBatch | _Failure]:
        worker = torch.utils.data.get_worker_info()  # only iterated in DataLoader workers
        try:
            share = self.plan.share(self.epoch, self.batch_in_epoch, first=worker.id, stride=worker.num_workers)
            for item in share:
                # As arrays, a batch travels inside the pickle. As tensors, each storage would become a
                # shared-memory file whose descriptor the training process fetches over a connection of
                # its own: milliseconds per batch, whatever its size.
                item.inputs = map_leaves(torch.Tensor.numpy, torch.Tensor, item.inputs)
                yield item
        except Exception as e:  # in the place of the batch it concerns; the main process raises it there
            yield _Failure(e, traceback.format_exc())


def map_leaves(fn: Callable[[Any], Any], kind: type, x: Any) -> Any:
    """`fn` applied to each `kind` in x, through dicts and named tuples (PackedSequences); the rest kept."""
    if isinstance(x, kind):
        return fn(x)
    if isinstance(x, dict):
        return {k: map_leaves(fn, kind, v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(map_leaves(fn, kind, v) for v in x))
    return x


@dataclass
class _Failure:
    """An exception raised while building a batch, passed on to be raised where the batch was wanted."""

    error: Exception
    traceback: str


class _WorkerTraceback(Exception):
    def __init__(self, text: str):
        super().__init__("\n" + text.rstrip())
