"""The inference layer: admission (429 past the concurrency limit), tokenisation, the batcher, and
waiting for results while watching for a client that goes away. Endpoints only shape the answer."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from starlette.requests import Request

from app.backend import Backend
from app.batcher import GroupResult
from app.errors import ClientClosed, InvalidInput, Overloaded, ShuttingDown, TooManyInputs, Unsupported
from app.metrics import Metrics
from app.pooling import POOLING_OUTPUT, l2_normalize
from app.sentence_dense import SentenceDense
from app.settings import Settings
from app.tokenization import Item, TextTokenizer, Tokenized
from artifact.manifest import Manifest

# A request still waiting after this long starts watching for its client going away. Watching costs a
# task per request (a large share of a one-text /embed's event-loop time), and many answers come sooner;
# a client that leaves is noticed this much later, and its queued work is still dropped before inference.
_WATCH_AFTER_S = 0.02


ST_DEFAULT_PROMPTS = {"query": "", "document": ""}  # SentenceTransformer's own, for every embedding model
TIMING_HEADERS = ("x-tokenize-ms", "x-queue-ms", "x-inference-ms")  # Timings.headers(), in its order


@dataclass(slots=True)
class Timings:
    tokenize_s: float = 0.0
    queue_s: float = 0.0
    inference_s: float = 0.0

    def headers(self) -> dict[str, str]:
        tokenize, queue, inference = TIMING_HEADERS
        return {tokenize: f"{self.tokenize_s * 1e3:.3f}", queue: f"{self.queue_s * 1e3:.3f}",
                inference: f"{self.inference_s * 1e3:.3f}"}


@dataclass(slots=True)
class Inference:
    tokenized: Tokenized
    result: GroupResult | None  # None when no graph output was needed
    timings: Timings

    @property
    def outputs(self) -> dict:
        """Graph output name -> row i for input i ([n, H] vectors, [n, 2] logits, list of [len_i, H])."""
        return self.result.outputs

    @property
    def tokens(self) -> int:
        return self.tokenized.tokens


class InferenceService:
    def __init__(self, settings: Settings, manifest: Manifest, tokenizer: TextTokenizer, backend: Backend,
                 metrics: Metrics, sentence_dense: SentenceDense | None = None):
        self.settings, self.manifest, self.tokenizer, self.metrics = settings, manifest, tokenizer, metrics
        self.engine, self.batcher = backend.engine, backend.batcher
        self._inline = backend.inline_tokenizing.applies  # tokenise on the event loop, else in a thread
        self.model_name = settings.model_name or manifest.model_name
        # /v1/embeddings: the settings' pooling and normalisation, else the model's defaults.
        self.openai_pooling = settings.openai_pooling or manifest.default_pooling
        self.openai_normalize = (manifest.default_normalize if settings.openai_normalize is None
                                 else settings.openai_normalize)
        self.sentence_dense = sentence_dense  # the checkpoint's Dense modules, after its own pooling
        # The prompts a request may name. sentence-transformers gives every embedding model "query" and
        # "document", empty unless its config sets them, so encode(prompt_name="query") works on any model
        # (and encode_query uses it).
        self._prompts = manifest.prompts if manifest.classifier_labels else {**ST_DEFAULT_PROMPTS, **manifest.prompts}
        self._inflight = 0
        self.draining = False  # a stop signal came: new requests are refused
        self._expired = False  # the drain deadline passed: waiting requests are answered 503
        self._waiting: set[asyncio.Future] = set()
        self._admission = _Admission(self)

    def sentence_vectors(self, outputs: dict[str, np.ndarray], pooling: str, normalize: bool,
                         dimensions: int | None = None) -> np.ndarray:
        """The texts' vectors by `pooling`; the model's own pooling is followed by its Dense modules, as
        sentence-transformers runs the checkpoint (another pooling gives the encoder's vectors as they are).
        `dimensions` (checked by check_dimensions) keeps the first that many, before normalising, as OpenAI
        shortens its embeddings."""
        vectors = outputs[POOLING_OUTPUT[pooling]]  # [n, H]: pooled where the batch ran
        if self.sentence_dense is not None and pooling == self.manifest.default_pooling:
            vectors = self.sentence_dense(vectors)
        if dimensions is not None:
            vectors = vectors[:, :dimensions]
        return l2_normalize(vectors) if normalize else vectors

    def prompt_for(self, items: Sequence[Item], prompt_name: str | None) -> str:
        """The prompt the tokenizer puts before each text (pairs stay as they are), as sentence-transformers
        encodes them: the named one; unnamed, the model's default prompt, if it has one; named "", none."""
        prompts = self._prompts
        if prompt_name == "":  # no prompt, the default's too (sentence-transformers' prompt="")
            return ""
        if prompt_name is not None:
            if prompt_name not in prompts:
                raise Unsupported(f"prompt_name {prompt_name!r} is not one of this model's prompts "
                                  f"({', '.join(sorted(prompts))})" if prompts else
                                  f"prompt_name {prompt_name!r}: this model has no prompts")
            if any(not isinstance(x, str) for x in items):
                raise Unsupported("prompt_name applies to texts, not to [text_a, text_b] pairs")
        return prompts.get(prompt_name or self.manifest.default_prompt_name or "", "")

    def width(self, pooling: str) -> int:
        """The width of the vectors `pooling` gives."""
        return self.manifest.sentence_width if pooling == self.manifest.default_pooling else self.manifest.hidden_size

    def check_dimensions(self, dimensions: int | None, pooling: str) -> None:
        """A request's `dimensions` (how many of each vector's first values to keep) fits `pooling`'s width."""
        width = self.width(pooling)
        if dimensions is not None and not 1 <= dimensions <= width:  # the value itself may be 300 digits long
            raise InvalidInput(f"dimensions must be between 1 and {width} (the model's width)")

    @property
    def inflight(self) -> int:
        """Requests admitted and not yet answered."""
        return self._inflight

    def drain(self, seconds: float) -> None:
        """Refuse new requests from now on; answer those still waiting after `seconds` with 503."""
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        self._expired = True
        for future in list(self._waiting):
            future.cancel()  # the batcher drops it before inference; _wait answers 503

    def admitted(self) -> _Admission:
        """`with service.admitted():` one request being served; past max_concurrent_requests the request is
        refused at once."""
        return self._admission

    def _admit(self) -> None:
        if self.draining:
            raise ShuttingDown("the server is shutting down; send the request again (to another replica)")
        if self._inflight >= self.settings.max_concurrent_requests:
            raise Overloaded(f"{self._inflight} requests are being served (limit "
                             f"{self.settings.max_concurrent_requests}); retry later")
        self._inflight += 1
        self.metrics.inflight.inc()

    def _release(self) -> None:
        self._inflight -= 1
        self.metrics.inflight.dec()

    async def tokenize(self, items: Sequence[Item], truncate: bool, field: str, offsets: bool = True,
                       direction: str | None = None, prompt: str = "") -> tuple[Tokenized, float]:
        """offsets=False: every token's offsets are (0, 0) (cheaper), for callers that never describe tokens.
        direction: which end truncation cuts (app.tokenization.DIRECTIONS; None: the model's, as transformers'
        tokenizer of its folder cuts); prompt: put before each text (prompt_for)."""
        direction = direction or self.manifest.truncation_direction
        if not items:
            raise InvalidInput(f"{field} is empty: send at least one {'pair' if field == 'pairs' else 'text'}")
        limit = self.settings.max_inputs_per_request
        if len(items) > limit:
            raise TooManyInputs(f"{field} has {len(items)} items; the server accepts at most {limit} per request")
        started = time.perf_counter()
        if self._inline(items):
            tokenized = self.tokenizer.encode_batch(items, truncate, field, offsets, direction, prompt)
        else:  # the event loop keeps serving meanwhile
            tokenized = await asyncio.to_thread(self.tokenizer.encode_batch, items, truncate, field, offsets,
                                                direction, prompt)
        seconds = time.perf_counter() - started
        self.metrics.observe_tokenize(seconds)
        return tokenized, seconds

    async def infer(self, request: Request | None, items: Sequence[Item], truncate: bool, outputs: frozenset[str],
                    field: str, offsets: bool = False, direction: str | None = None, prompt: str = "",
                    answers_token_vectors: bool = False) -> Inference:
        """offsets: whether the answer describes tokens (describe_tokens reads their offsets); direction:
        which end truncation cuts; prompt: put before each text (prompt_for); answers_token_vectors: whether
        the answer carries the token vectors (max_token_vectors bounds those, not the ones a mean or max
        pooling reads)."""
        with self.admitted():
            self.batcher.check_admission()  # before the tokenising it would waste
            tokenized, tokenize_s = await self.tokenize(items, truncate, field, offsets, direction, prompt)
            limit = self.settings.max_token_vectors
            if answers_token_vectors and tokenized.tokens > limit:
                raise TooManyInputs(f"{field} asks for the vectors of {tokenized.tokens} tokens; the server returns "
                                    f"at most {limit} token vectors a request (max_token_vectors): send fewer texts a "
                                    f"request")
            timings = Timings(tokenize_s=tokenize_s)
            if not outputs:  # e.g. pooling none without tokens: nothing to compute
                return Inference(tokenized, None, timings)
            if self._expired:
                raise _past_drain_deadline()
            future = self.batcher.submit_group(tokenized.sequences, outputs)
            result = await self._wait(future, request)
            timings.queue_s, timings.inference_s = result.queue_s, result.inference_s
            self.metrics.observe_queue(result.queue_s)
            return Inference(tokenized, result, timings)

    async def _wait(self, future: asyncio.Future, request: Request | None) -> GroupResult:
        """The result, or ClientClosed once the client is seen gone; either way nothing of this request
        stays queued (a cancelled group is dropped by the batcher before inference). Past the drain
        deadline: ShuttingDown."""
        self._waiting.add(future)
        try:
            return await self._wait_watching(future, request)
        except asyncio.CancelledError:
            if self._expired and future.cancelled():
                raise _past_drain_deadline() from None
            raise
        finally:
            self._waiting.discard(future)

    async def _wait_watching(self, future: asyncio.Future, request: Request | None) -> GroupResult:
        if request is None:
            try:
                return await future
            finally:
                future.cancel()  # no-op when finished
        closed = False
        watcher: asyncio.Task | None = None

        def on_disconnect(w: asyncio.Future) -> None:
            nonlocal closed
            if not w.cancelled() and w.exception() is None:  # a receive() error is not a disconnect
                closed = True
                future.cancel()

        def watch() -> None:
            nonlocal watcher
            if not future.done():
                watcher = asyncio.ensure_future(_disconnect(request))
                watcher.add_done_callback(on_disconnect)

        timer = asyncio.get_running_loop().call_later(_WATCH_AFTER_S, watch)
        try:
            return await future
        except asyncio.CancelledError:
            if closed:
                raise ClientClosed("the client closed the connection before its answer was ready") from None
            raise
        finally:
            timer.cancel()
            if watcher is not None:
                watcher.cancel()
            future.cancel()


class _Admission:
    """InferenceService.admitted(): a plain context manager, not a contextlib generator, which cost every
    request 0.6 µs more (a generator and its wrapper made and run each time)."""

    __slots__ = ("_service",)

    def __init__(self, service: InferenceService):
        self._service = service

    def __enter__(self) -> None:
        self._service._admit()

    def __exit__(self, *exc_info) -> None:
        self._service._release()


def _past_drain_deadline() -> ShuttingDown:
    return ShuttingDown("the server is shutting down and this request was still queued at its drain deadline; "
                        "send it again (to another replica)")


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body was read already, so receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
