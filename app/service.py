"""The inference layer: admission (429 past the concurrency limit), tokenisation, the batcher, and
waiting for results while watching for a client that goes away. Endpoints only shape the answer."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.requests import Request

from app.batcher import DynamicBatcher, EntryResult
from app.engine import OrtEngine
from app.errors import ClientClosed, InvalidInput, Overloaded, TooManyInputs
from app.metrics import Metrics
from app.settings import Settings
from app.tokenization import Encoded, Item, TextTokenizer
from artifact.manifest import Manifest

# Below this many characters a request is tokenised on the event loop: a thread hop costs more.
_INLINE_TOKENIZE_CHARS = 4096


@dataclass(slots=True)
class Timings:
    tokenize_s: float = 0.0
    queue_s: float = 0.0
    inference_s: float = 0.0

    def headers(self) -> dict[str, str]:
        return {"x-tokenize-ms": f"{self.tokenize_s * 1e3:.3f}", "x-queue-ms": f"{self.queue_s * 1e3:.3f}",
                "x-inference-ms": f"{self.inference_s * 1e3:.3f}"}


@dataclass(slots=True)
class Inference:
    encoded: list[Encoded]
    results: list[EntryResult]  # empty when no graph output was needed
    timings: Timings

    @property
    def tokens(self) -> int:
        return sum(e.length for e in self.encoded)


class InferenceService:
    def __init__(self, settings: Settings, manifest: Manifest, tokenizer: TextTokenizer, engine: OrtEngine,
                 batcher: DynamicBatcher, metrics: Metrics):
        self.settings, self.manifest, self.tokenizer = settings, manifest, tokenizer
        self.engine, self.batcher, self.metrics = engine, batcher, metrics
        self.model_name = settings.model_name or manifest.model_name
        self._inflight = 0

    @contextlib.contextmanager
    def admitted(self):
        """One request being served; past max_concurrent_requests the request is refused at once."""
        if self._inflight >= self.settings.max_concurrent_requests:
            raise Overloaded(f"{self._inflight} requests are being served (limit "
                             f"{self.settings.max_concurrent_requests}); retry later")
        self._inflight += 1
        self.metrics.inflight.inc()
        try:
            yield
        finally:
            self._inflight -= 1
            self.metrics.inflight.dec()

    async def tokenize(self, items: Sequence[Item], truncate: bool, field: str) -> tuple[list[Encoded], float]:
        if not items:
            raise InvalidInput(f"{field} is empty: send at least one text")
        limit = self.settings.max_inputs_per_request
        if len(items) > limit:
            raise TooManyInputs(f"{field} has {len(items)} items; the server accepts at most {limit} per request")
        started = time.perf_counter()
        chars = sum(len(x) if isinstance(x, str) else len(x[0]) + len(x[1]) for x in items)
        if chars <= _INLINE_TOKENIZE_CHARS:
            encoded = self.tokenizer.encode(items, truncate, field)
        else:  # encode_batch releases the GIL: the event loop keeps serving meanwhile
            encoded = await asyncio.to_thread(self.tokenizer.encode, items, truncate, field)
        seconds = time.perf_counter() - started
        self.metrics.tokenize_seconds.observe(seconds)
        return encoded, seconds

    async def infer(self, request: Request | None, items: Sequence[Item], truncate: bool,
                    outputs: frozenset[str], field: str) -> Inference:
        with self.admitted():
            encoded, tokenize_s = await self.tokenize(items, truncate, field)
            timings = Timings(tokenize_s=tokenize_s)
            if not outputs:  # e.g. pooling none without tokens: nothing to compute
                return Inference(encoded, [], timings)
            futures = self.batcher.submit([(e.ids, e.type_ids) for e in encoded], outputs)
            results = await self._wait(futures, request)
            timings.queue_s = max(r.queue_s for r in results)
            timings.inference_s = max(r.inference_s for r in results)
            for r in results:
                self.metrics.queue_seconds.observe(r.queue_s)
            return Inference(encoded, results, timings)

    async def _wait(self, futures: list[asyncio.Future], request: Request | None) -> list[EntryResult]:
        """All results, or ClientClosed as soon as the client disconnects; either way no entry of this
        request stays queued (cancelled futures are dropped by the batcher before inference)."""
        one = len(futures) == 1  # the common case needs no gather
        gathered = futures[0] if one else asyncio.gather(*futures)
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no asyncio warning
        watcher = asyncio.ensure_future(_disconnect(request)) if request is not None else None
        try:
            waiting = {gathered} if watcher is None else {gathered, watcher}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if gathered in done or watcher.exception() is not None:
                results = await gathered
                return [results] if one else results
            raise ClientClosed("the client closed the connection before its answer was ready")
        finally:
            if watcher is not None:
                watcher.cancel()
            for f in futures:
                f.cancel()  # no-op on finished ones
            if not gathered.done():
                gathered.cancel()


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body was read already, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
