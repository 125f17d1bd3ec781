"""`create_app(settings, start_backend)` assembles the app: the FastAPI app behind ServingFront. Its
lifespan loads the tokenizer, starts the deployment mode's Backend (by default this process's engine and
batcher, after a real forward pass; app.multiprocess hands its own) and on shutdown drains it. Nothing
happens at import time."""
from __future__ import annotations

import gc
import logging
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from fastapi import FastAPI

from app.backend import StartBackend
from app.build import UNSERVABLE, cannot_serve, load_tokenizer, start_in_process
from app.errors import register_error_handlers
from app.metrics import Metrics
from app.front import ServingFront
from app.routes import classify, embed, nsp, openai, page, system, tei
from app.sentence_dense import SentenceDense
from app.service import InferenceService
from app.settings import Settings

log = logging.getLogger("app")


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


def engine_lost(app: FastAPI) -> None:
    """The engine can run nothing more (its process ended, or a CUDA error left its device unusable):
    every request is answered 503 from now on, saying so."""
    app.state.service = None
    app.state.not_ready_reason = ("the engine is gone (its process ended, or its GPU failed); the server must be "
                                  "restarted")


def create_app(settings: Settings, start_backend: StartBackend = start_in_process,
               artifact_files: Path | None = None) -> ServingFront:
    """The ASGI app; `start_backend`: the deployment mode (default: the engine and batcher in this process);
    `artifact_files`: where the manifest, tokenizer and Dense layers are read (default settings.model_dir)."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        folder = artifact_files or settings.model_dir
        try:
            manifest, tokenizer = load_tokenizer(settings, folder)
            sentence_dense = SentenceDense.load(folder, manifest)
            backend = await start_backend(settings, manifest, tokenizer, metrics, lambda: engine_lost(app))
        except UNSERVABLE as e:  # said in one line (ServingFront), not as a traceback
            app.state.startup_error = cannot_serve(settings.model_dir, e)
            raise
        service = InferenceService(settings, manifest, tokenizer, backend, metrics, sentence_dense)
        e = service.engine
        metrics.model_loaded(service.model_name, e.precision, e.provider)
        log.info("serving %s (%s, %s on %s) from %s", service.model_name, e.precision, e.provider, e.device,
                 settings.model_dir)
        app.state.service = service  # from here on /ready answers 200
        try:
            with serving_gc():
                yield
        finally:
            app.state.service = None
            await service.batcher.stop()
            metrics.process_exited()

    api = FastAPI(title="bertserve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  servers=page.SERVERS,
                  description="BERT embeddings, sentence-pair NSP scores and tokens over ONNX Runtime. "
                              "Errors are always {\"error\": {\"type\", \"message\"}}.")
    api.state.settings = settings
    api.state.metrics = metrics
    api.state.service = None
    areas = (embed, nsp, classify, openai, tei, system, page)  # tei: POST /; page: GET /, /docs, /redoc, /static (no CDN)
    for area in areas:
        api.include_router(area.router)
    register_error_handlers(api)
    endpoints = frozenset(r.path for area in areas for r in area.router.routes) | {api.openapi_url}
    direct = {**embed.DIRECT_ROUTES, **nsp.DIRECT_ROUTES, **classify.DIRECT_ROUTES, **openai.DIRECT_ROUTES,
              **tei.DIRECT_ROUTES}
    metrics.serve_endpoints(endpoints)
    return ServingFront(api, metrics=metrics, endpoints=endpoints, direct=direct, max_bytes=settings.max_request_bytes,
                        cors_origins=settings.cors_origins)
