"""Prometheus metrics, one registry per app, and the ASGI middleware that counts every request.

With several server processes (`workers` > 1) prometheus_client's multiprocess mode is on: each process
writes its values to files under PROMETHEUS_MULTIPROC_DIR and `exposition()` sums them all."""
from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import multiprocess
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_LATENCY = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKENS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
MULTIPROC_DIR_VAR = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when it is imported


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series: they double the output for nothing we use
        r = self.registry = CollectorRegistry()
        self.requests = Counter("bertserve_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.failures = Counter("bertserve_request_failures", "HTTP requests answered with an error",
                                ["endpoint", "status", "type"], registry=r)
        self.request_seconds = Histogram("bertserve_request_duration_seconds", "time to answer a request",
                                         ["endpoint"], buckets=_LATENCY, registry=r)
        # Gauges summed over the live processes when there are several (ignored with one).
        self.inflight = Gauge("bertserve_inflight_requests", "requests being served", registry=r,
                              multiprocess_mode="livesum")
        self.queue_depth = Gauge("bertserve_queue_depth", "sequences waiting for a batch", registry=r,
                                 multiprocess_mode="livesum")
        self.sequences = Counter("bertserve_sequences", "sequences (texts or pairs) embedded", registry=r)
        self.dropped_sequences = Counter("bertserve_dropped_sequences", "queued sequences dropped before "
                                         "inference because their client went away", registry=r)
        self.batch_size = Histogram("bertserve_batch_size", "sequences per batch", buckets=_SIZES, registry=r)
        self.batch_tokens = Histogram("bertserve_batch_tokens", "tokens per batch, padded (size x longest)",
                                      buckets=_TOKENS, registry=r)
        self.tokenize_seconds = Histogram("bertserve_tokenize_duration_seconds", "tokenisation time per request",
                                          buckets=_LATENCY, registry=r)
        self.queue_seconds = Histogram("bertserve_queue_duration_seconds", "time a request waited for its "
                                       "batches (its longest-waiting sequence)", buckets=_LATENCY, registry=r)
        self.inference_seconds = Histogram("bertserve_inference_duration_seconds", "time per batch in the engine "
                                           "(collation and output copy included)", buckets=_LATENCY, registry=r)
        self.model = Gauge("bertserve_model_info", "the model served", ["model", "precision", "provider"], registry=r,
                           multiprocess_mode="max")
        self.multiprocess = bool(os.environ.get(MULTIPROC_DIR_VAR))
        if self.multiprocess:
            self._exposed = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._exposed)
        else:
            self._exposed = r

    def exposition(self) -> bytes:
        """Prometheus text format: this process's metrics, or every worker's summed."""
        return generate_latest(self._exposed)

    def process_exited(self) -> None:
        """Drop this process's live gauges from the sums (its counters and histograms stay counted)."""
        if self.multiprocess:
            multiprocess.mark_process_dead(os.getpid())

    def observe_batch(self, size: int, padded_tokens: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.batch_tokens.observe(padded_tokens)
        self.inference_seconds.observe(seconds)
        self.sequences.inc(size)


class MetricsMiddleware:
    """Counts requests by endpoint and status, failures also by error type (set by the error handlers)."""

    def __init__(self, app: ASGIApp, metrics: Metrics, endpoints: frozenset[str]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints
        self._cache: dict[tuple[str, int], tuple] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in self.endpoints else "other"  # bounded label values
        notes = scope.setdefault("bertserve", {})
        status = 500
        started = time.perf_counter()

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            seconds = time.perf_counter() - started
            requests, duration = self._children(endpoint, status)
            requests.inc()
            duration.observe(seconds)
            if status >= 400:
                self.metrics.failures.labels(endpoint, str(status), notes.get("error_type", "internal_error")).inc()

    def _children(self, endpoint: str, status: int) -> tuple:
        """The labelled counter and histogram of (endpoint, status), looked up once: `labels()` costs a
        lock and a dict lookup on every request otherwise. Both label sets are bounded."""
        key = (endpoint, status)
        children = self._cache.get(key)
        if children is None:
            m = self.metrics
            children = self._cache[key] = (m.requests.labels(endpoint, str(status)), m.request_seconds.labels(endpoint))
        return children
