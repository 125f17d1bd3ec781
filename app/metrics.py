"""Prometheus metrics, one registry per app.

With several server processes (`workers` > 1) prometheus_client's multiprocess mode is on: each process
writes its values to files under PROMETHEUS_MULTIPROC_DIR and `exposition()` sums them all. The metrics
updated on every request keep files of their own there, cheaper to write (app/shared_metrics.py)."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import multiprocess

from app.shared_metrics import SUFFIX as SHARED_SUFFIX, SharedMetrics, remove_gauges

_LATENCY = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKENS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)  # 512: the CPU's default batch
MULTIPROC_DIR_VAR = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when it is imported


def use_metrics_folder(folder: Path) -> None:
    """Makes `folder` (created if missing) the one this run's processes write their metrics to, emptied
    first: values of an earlier run must not count."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob("*.db"), *folder.glob(f"*{SHARED_SUFFIX}")]:
        stale.unlink()
    os.environ[MULTIPROC_DIR_VAR] = str(folder)


def process_ended(pid: int) -> None:
    """A server process that has ended, cleanly (`Metrics.process_exited`) or killed (the HTTP workers'
    supervisor calls this for it): its gauges stop counting in the sums; its counters and histograms stay
    counted."""
    directory = os.environ.get(MULTIPROC_DIR_VAR)
    if directory:
        multiprocess.mark_process_dead(pid, directory)
        remove_gauges(Path(directory), pid)


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series: they double the output for nothing we use
        r = self.registry = CollectorRegistry()
        self.multiprocess = bool(os.environ.get(MULTIPROC_DIR_VAR))
        # The metrics updated on every request: in files of their own, summed at scrape time (app/shared_metrics.py)
        self._shared = SharedMetrics(Path(os.environ[MULTIPROC_DIR_VAR]) if self.multiprocess else None)
        self.requests = Counter("bertserve_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.failures = Counter("bertserve_request_failures", "HTTP requests answered with an error",
                                ["endpoint", "status", "type"], registry=r)
        self._request_seconds: dict[str, Callable[[float], None]] = {}  # by endpoint, from serve_endpoints
        # Gauges summed over the live processes when there are several (ignored with one).
        self.inflight = self._shared.gauge("bertserve_inflight_requests", "requests being served")
        self.queue_depth = Gauge("bertserve_queue_depth", "sequences waiting for a batch", registry=r,
                                 multiprocess_mode="livesum")
        self.sequences = Counter("bertserve_sequences", "sequences (texts or pairs) embedded", registry=r)
        self.dropped_sequences = Counter("bertserve_dropped_sequences", "queued sequences dropped before "
                                         "inference because their client went away", registry=r)
        self.batch_size = Histogram("bertserve_batch_size", "sequences per batch", buckets=_SIZES, registry=r)
        self.batch_tokens = Histogram("bertserve_batch_tokens", "tokens per batch, padded (size x longest)",
                                      buckets=_TOKENS, registry=r)
        self.observe_tokenize = self._shared.histogram(
            "bertserve_tokenize_duration_seconds", "tokenisation time per request", _LATENCY).observer()
        self.observe_queue = self._shared.histogram(
            "bertserve_queue_duration_seconds", "time a request waited for its batches (its longest-waiting "
            "sequence)", _LATENCY).observer()
        self.inference_seconds = Histogram("bertserve_inference_duration_seconds", "time per batch in the engine "
                                           "(collation and output copy included)", buckets=_LATENCY, registry=r)
        self.engine_busy_seconds = Counter("bertserve_engine_busy_seconds", "time the engine's threads spent on "
                                           "batches (collation, the run, its copies), by path: cuda_graph (on a "
                                           "CUDA-graph session's thread, where batches replay) or session; its "
                                           "rate is how busy that path is (summed over its threads: up to "
                                           "cuda_graph_lanes, or inference_workers)", ["path"], registry=r)
        self._busy_paths = {path: self.engine_busy_seconds.labels(path) for path in ("cuda_graph", "session")}
        ways = ("to_engine", "in_engine", "from_engine")
        link = self._shared.histogram("bertserve_engine_link_duration_seconds", "with HTTP workers, per group of "
                                      "requests a worker sent together: its time on the way to the engine process "
                                      "(to_engine), there, queue and batches included (in_engine), and back "
                                      "(from_engine)", _LATENCY, ["way"], [(way,) for way in ways])
        self._link_ways = tuple(link.observer(way) for way in ways)
        self.model = Gauge("bertserve_model_info", "the model served", ["model", "precision", "provider"], registry=r,
                           multiprocess_mode="max")
        self._children: dict[tuple[str, int], tuple] = {}
        r.register(self._shared)
        if self.multiprocess:
            self._exposed = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._exposed)
            self._exposed.register(self._shared)
        else:
            self._exposed = r

    def serve_endpoints(self, endpoints: Iterable[str]) -> None:
        """The paths requests are counted by (any other is "other"): before the first request is answered."""
        names = sorted(set(endpoints) | {"other"})
        family = self._shared.histogram("bertserve_request_duration_seconds", "time to answer a request", _LATENCY,
                                        ["endpoint"], [(name,) for name in names], unused_shown=False)
        self._request_seconds = {name: family.observer(name) for name in names}

    def exposition(self) -> bytes:
        """Prometheus text format: this process's metrics, or every worker's summed."""
        return generate_latest(self._exposed)

    def process_exited(self) -> None:
        """Drop this process's live gauges from the sums (its counters and histograms stay counted)."""
        process_ended(os.getpid())

    def observe_batch(self, size: int, padded_tokens: int, seconds: float, busy_seconds: float,
                      replayed: bool) -> None:
        """One batch: `seconds` from its hand-off to its answer on the event loop, `busy_seconds` of them on
        its thread, replayed from a CUDA graph or not."""
        self._busy_paths["cuda_graph" if replayed else "session"].inc(busy_seconds)
        self.batch_size.observe(size)
        self.batch_tokens.observe(padded_tokens)
        self.inference_seconds.observe(seconds)
        self.sequences.inc(size)

    def model_loaded(self, model: str, precision: str, provider: str) -> None:
        self.model.labels(model, precision, provider).set(1)

    def observe_link(self, to_engine_s: float, in_engine_s: float, from_engine_s: float) -> None:
        to_engine, in_engine, from_engine = self._link_ways
        to_engine(to_engine_s)
        in_engine(in_engine_s)
        from_engine(from_engine_s)

    def request_answered(self, endpoint: str, status: int, seconds: float, notes: dict) -> None:
        """One HTTP request answered; failures also by error type (`notes["error_type"]`, set by the
        error handlers)."""
        requests, duration = self._request_children(endpoint, status)
        requests.inc()
        duration(seconds)
        if status >= 400:
            self.failures.labels(endpoint, str(status), notes.get("error_type", "internal_error")).inc()

    def _request_children(self, endpoint: str, status: int) -> tuple:
        """The labelled counter and histogram of (endpoint, status), looked up once: `labels()` costs a
        lock and a dict lookup on every request otherwise. Both label sets are bounded."""
        key = (endpoint, status)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (self.requests.labels(endpoint, str(status)),
                                              self._request_seconds[endpoint])
        return children
