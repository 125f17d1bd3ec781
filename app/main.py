"""`create_app(settings)` assembles the FastAPI app; its lifespan loads the artifact, runs a real forward
pass, starts the batcher, and on shutdown drains it. Nothing happens at import time."""
from __future__ import annotations

import gc
import logging
import os
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from fastapi import FastAPI

from app.batcher import DynamicBatcher
from app.engine import CPU, EngineError, OrtEngine, resolve_device_precision
from app.errors import register_error_handlers
from app.metrics import Metrics, MetricsMiddleware
from app.middleware import RequestBodyMiddleware
from app.routes import embed, nsp, openai, system
from app.service import InferenceService
from app.settings import Settings
from app.tokenization import TextTokenizer
from artifact.manifest import TOKENIZER_FILE, read_manifest

log = logging.getLogger("app")


def batch_token_budget(settings: Settings, device: str) -> int:
    """The configured budget, else the device's default (see Settings.max_batch_tokens)."""
    if settings.max_batch_tokens is not None:
        return settings.max_batch_tokens
    return 16384 if device == "cuda" else 512


def inference_threads(settings: Settings, device: str) -> tuple[int, int | None]:
    """(batches at once, ONNX Runtime threads per batch): the configured values, else the device's
    default. On the CPU one single-threaded batch per core beat one batch over both cores by about 20%
    (all-MiniLM-L6-v2, 2 cores, see BENCHMARKS.md): no thread hand-offs inside small matrix products."""
    if device == "cuda":
        return settings.inference_workers or 1, settings.intra_op_threads
    cores = usable_cores()
    workers = settings.inference_workers or cores
    return workers, settings.intra_op_threads or max(1, cores // workers)


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota (`docker run --cpus`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def build_service(settings: Settings, metrics: Metrics) -> InferenceService:
    """Wire tokenizer, engine and batcher from one Settings object; raise if the model is unusable."""
    import onnxruntime as ort

    manifest = read_manifest(settings.model_dir)
    tokenizer = TextTokenizer(settings.model_dir / TOKENIZER_FILE, manifest.max_length, settings.max_input_chars,
                              manifest.special_tokens)
    device, precision = resolve_device_precision(settings.device, settings.precision, manifest,
                                                 ort.get_available_providers())
    workers, threads = inference_threads(settings, device)
    try:
        engine = OrtEngine(settings.model_dir, manifest, device, precision, threads, settings.cuda_device_id)
    except EngineError as e:
        if settings.device != "auto" or device != "cuda":
            raise
        # onnxruntime-gpu lists the CUDA provider even where no GPU or CUDA library is found.
        log.warning("CUDA did not start (%s); serving on the CPU instead", e)
        device, precision = resolve_device_precision("cpu", settings.precision, manifest, [CPU])
        workers, threads = inference_threads(settings, device)
        engine = OrtEngine(settings.model_dir, manifest, device, precision, threads)
    probe = tokenizer.encode([("warm-up forward pass", "checks every output")], truncate=True)[0]
    engine.health(probe.ids, probe.type_ids)
    batcher = DynamicBatcher(engine.run, pad_id=engine.pad_id, max_batch_tokens=batch_token_budget(settings, device),
                             max_batch_size=settings.max_batch_size, max_wait_ms=settings.max_wait_ms,
                             max_queued=settings.max_queued_sequences, workers=workers,
                             metrics=metrics)
    service = InferenceService(settings, manifest, tokenizer, engine, batcher, metrics)
    metrics.model.labels(service.model_name, precision, engine.provider).set(1)
    log.info("serving %s (%s, %s on %s) from %s", service.model_name, precision, engine.provider, device,
             settings.model_dir)
    return service


# Young-generation GC threshold while serving (Python's default: 700 allocations). Each request makes a
# few hundred short-lived objects; at the default, collections (and the gen-2 passes they trigger over
# everything the model load left behind) took about a third of the event loop's time per one-text /embed
# (in-process A/B on a 2-core CPU box).
_GC_GEN0_THRESHOLD = 20_000


@contextmanager
def serving_gc():
    """Freeze what startup allocated out of the collector's view and collect the young generation less
    often; restored on shutdown (tests run several apps in one process)."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_GEN0_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def create_app_from_env() -> FastAPI:
    """The app of one of several worker processes: settings from BERTSERVE_* variables (see __main__)."""
    settings = Settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return create_app(settings)


def create_app(settings: Settings) -> FastAPI:
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service = build_service(settings, metrics)
        service.batcher.start()
        app.state.service = service  # from here on /ready answers 200
        try:
            with serving_gc():
                yield
        finally:
            app.state.service = None
            await service.batcher.stop()
            metrics.process_exited()

    app = FastAPI(title="bertserve", version="0.1.0", lifespan=lifespan,
                  description="BERT embeddings, sentence-pair NSP scores and tokens over ONNX Runtime. "
                              "Errors are always {\"error\": {\"type\", \"message\"}}.")
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.service = None
    routers = (embed.router, nsp.router, openai.router, system.router)
    for router in routers:
        app.include_router(router)
    register_error_handlers(app)
    endpoints = frozenset(r.path for router in routers for r in router.routes) | {"/docs", "/openapi.json"}
    app.add_middleware(RequestBodyMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics, endpoints=endpoints)  # outermost: sees every answer
    return app
