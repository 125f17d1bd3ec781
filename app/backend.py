"""The seam between the serving core and a deployment mode: what the core asks of a batcher (`Batcher`),
what it reports about the engine (`EngineInfo`), and what a mode hands it at start (`Backend`).

In one process the Backend is this process's OrtEngine and DynamicBatcher (app.build.start_in_process);
in an HTTP worker of a multi-process server it is a link to the engine process (app.multiprocess)."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from app.batcher import DynamicBatcher, Sequences
    from app.engine import OrtEngine
    from app.metrics import Metrics
    from app.settings import Settings
    from app.tokenization import Item, TextTokenizer
    from artifact.manifest import Manifest


class Batcher(Protocol):
    """Queues tokenized requests into batches for the engine."""

    max_batch_tokens: int  # token budget of one batch
    inference_workers: int  # batches run at the same time on the engine's session

    def check_admission(self) -> None:
        """Raises Overloaded when work queued now would wait too long (max_queue_ms); called before a
        request is tokenised. A batcher that cannot tell here leaves it to submit_group."""

    def submit_group(self, sequences: Sequences, outputs: frozenset[str]) -> asyncio.Future:
        """Queue one request's sequences (all or none); the future gets its GroupResult. Cancelling the
        future drops the work before inference. Raises Overloaded past the queue limits, NotReady once stopped."""

    async def stop(self) -> None:
        """Refuse new work and finish (or fail) what was submitted."""


@dataclass(frozen=True)
class EngineInfo:
    """How the engine runs (/info, metrics): OrtEngine's device, precision, provider and threads, the
    batcher's limits, whether custom kernels and CUDA graphs run, and the process that holds the session."""
    device: str
    precision: str
    provider: str
    intra_op_threads: int | None
    inference_workers: int
    max_batch_tokens: int
    pid: int
    custom_kernels: bool = False  # a stand-in engine (bench/) need not say
    cuda_graphs: bool = False

    @classmethod
    def of(cls, engine: OrtEngine, batcher: DynamicBatcher) -> "EngineInfo":
        """This process's engine and batcher."""
        return cls(engine.device, engine.precision, engine.provider, engine.intra_op_threads,
                   batcher.inference_workers, batcher.max_batch_tokens, os.getpid(), engine.custom_kernels,
                   engine.cuda_graphs)


@dataclass(frozen=True)
class InlineTokenizing:
    """Requests this small are tokenised on the event loop; larger ones in a thread, where encode_batch
    runs without the GIL. A thread hop costs more than tokenising a short text."""
    max_texts: int | None  # None: any number
    max_chars: int  # in all

    def applies(self, items: Sequence[Item]) -> bool:
        if self.max_texts is not None and len(items) > self.max_texts:
            return False
        chars = self.max_chars  # counting stops past it
        for item in items:
            chars -= len(item) if isinstance(item, str) else len(item[0]) + len(item[1])
            if chars < 0:
                return False
        return True


@dataclass(frozen=True)
class Backend:
    """What a deployment mode hands the serving core: its batcher, its engine's description, and how
    much tokenising it wants on the event loop."""
    batcher: Batcher
    engine: EngineInfo
    inline_tokenizing: InlineTokenizing


# A deployment mode: builds (or connects to) its engine once the app starts. `on_lost` is called if the
# engine goes away while serving (the app then answers 503).
StartBackend = Callable[["Settings", "Manifest", "TextTokenizer", "Metrics", Callable[[], None]], Awaitable[Backend]]
