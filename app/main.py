"""`create_app(settings, start_backend)` assembles the FastAPI app; its lifespan loads the tokenizer, starts
the deployment mode's Backend (by default this process's engine and batcher, after a real forward pass;
app.multiprocess hands its own) and on shutdown drains it. Nothing happens at import time."""
from __future__ import annotations

import gc
import logging
from contextlib import asynccontextmanager, contextmanager

from fastapi import FastAPI

from app.backend import StartBackend
from app.build import load_tokenizer, start_in_process
from app.errors import register_error_handlers
from app.metrics import Metrics
from app.middleware import ServingMiddleware
from app.routes import ServiceRoute, embed, nsp, openai, page, system
from app.service import InferenceService
from app.settings import Settings, configure_logging

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


class ServingApp(FastAPI):
    """FastAPI with `serving` (ServingMiddleware) in front of all of it, where add_middleware would put it
    inside FastAPI's own outer layers: their per-request checks (native OpenTelemetry's "is a provider
    configured?", error and body-limit middleware) cost a twentieth of a one-text /embed's CPU time. So
    the routes ServingMiddleware answers itself get no FastAPI telemetry; the others still do. Middleware
    added with add_middleware sits inside, and sees only the requests ServingMiddleware hands on."""

    serving: ServingMiddleware | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.serving is not None:
            scope["app"] = self  # as Starlette sets it: request.app
            await self.serving(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def create_app(settings: Settings, start_backend: StartBackend = start_in_process) -> FastAPI:
    """The app; `start_backend`: the deployment mode (default: the engine and batcher in this process)."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        manifest, tokenizer = load_tokenizer(settings)
        backend = await start_backend(settings, manifest, tokenizer, metrics,
                                      lambda: setattr(app.state, "service", None))  # engine lost: 503
        service = InferenceService(settings, manifest, tokenizer, backend, metrics)
        e = service.engine
        metrics.model.labels(service.model_name, e.precision, e.provider).set(1)
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

    app = ServingApp(title="bertserve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                     description="BERT embeddings, sentence-pair NSP scores and tokens over ONNX Runtime. "
                                 "Errors are always {\"error\": {\"type\", \"message\"}}.")
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.service = None
    routers = (embed.router, nsp.router, openai.router, system.router, page.router)  # page: /, /docs, /redoc
    for router in routers:
        app.include_router(router)
    register_error_handlers(app)
    endpoints = frozenset(r.path for router in routers for r in router.routes) | {"/docs", "/openapi.json"}
    # The routers are included as they are (no prefix, no added dependencies): their routes are the app's,
    # and those with a direct handler are answered by ServingMiddleware (HEAD goes on to FastAPI).
    direct = {(method, r.path): r.serve for router in routers for r in router.routes
              if isinstance(r, ServiceRoute) and r.serve is not None for method in r.methods if method != "HEAD"}
    app.serving = ServingMiddleware(super(ServingApp, app).__call__, metrics=metrics, endpoints=endpoints,
                                    routes=direct, max_bytes=settings.max_request_bytes)
    return app
