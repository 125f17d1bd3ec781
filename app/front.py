"""The ASGI app uvicorn runs: one plain ASGI layer in front of the FastAPI app. It counts every request in
the metrics, reads bodies up to a size limit (413 past it) as JSON whatever the Content-Type says, calls
the service endpoints' DirectRoutes itself, and hands everything else (docs, system routes, HEAD,
lifespan) to FastAPI."""
from __future__ import annotations

import time

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from app.body_encoding import decoded
from app.errors import ClientClosed, PayloadTooLarge, ServiceError, error_response, handle_error
from app.metrics import Metrics
from app.routes import DirectRoute, as_service_error
from app.service import TIMING_HEADERS

_BODY_METHODS = ("POST", "PUT", "PATCH")


class ServingFront:
    """One layer in front of FastAPI's own, rather than middleware inside them:

    - metrics: requests by endpoint and status, failures also by error type (set by the error handlers);
    - bodies: read up to `max_bytes` (413 past it, without reading further), decoded when sent with
      Content-Encoding gzip or deflate (app/body_encoding.py); a `curl -d` without
      `-H 'Content-Type: application/json'` works;
    - `direct` (POST path -> DirectRoute) is answered here, with a trailing slash too, errors by the app's
      exception handlers;
    - CORS for `cors_origins` (preflights answered, Access-Control-* headers added), when given.
      FastAPI's middleware stack, routing and dependency solving under this layer cost 29% of a one-text
      /embed's HTTP-worker CPU (bench/http_worker_load.py, bench/results/cpu2-http-worker-direct-routes-ab.txt).

    `api` is the FastAPI app (routes, docs, exception handlers, lifespan); `state` is its state."""

    def __init__(self, api: FastAPI, metrics: Metrics, endpoints: frozenset[str], direct: dict[str, DirectRoute],
                 max_bytes: int, cors_origins: list[str] | None = None):
        self.api, self.metrics, self.direct, self.max_bytes = api, metrics, direct, max_bytes
        self.endpoints = endpoints  # the paths metrics name; any other is "other" (bounded label values)
        # a path of a templated route (/v1/models/{model_id:path}) is named by its template
        self._templated = [(e.split("{", 1)[0], e) for e in endpoints if "{" in e]
        self._handle = self._serve
        if cors_origins:  # Starlette's CORS middleware around what answers, inside the metrics
            self._handle = _Cors(self._serve, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                                          allow_headers=["*"], expose_headers=[*TIMING_HEADERS, "retry-after"],
                                          max_age=600)

    def _template_of(self, path: str) -> str:
        return next((template for prefix, template in self._templated
                     if path.startswith(prefix) and len(path) > len(prefix)), "other")

    @property
    def state(self):
        return self.api.state

    def drain(self) -> None:
        """A stop signal came (uvicorn stops accepting and closes idle connections): new requests are
        answered 503 from now on, queued ones are served until the drain deadline, then answered 503."""
        service = self.api.state.service
        if service is not None:
            service.drain(self.api.state.settings.drain_seconds)

    def _draining(self) -> bool:
        service = self.api.state.service
        return service is not None and service.draining

    def busy(self) -> bool:
        """Whether requests are being served (the stop waits for them with the connections open)."""
        service = self.api.state.service
        return service is not None and service.inflight > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.api(scope, receive, self._startup_failure_in_one_line(send))
            return
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        scope["app"] = self.api  # as Starlette sets it: request.app
        path = scope["path"]
        if path.endswith("/") and scope["method"] == "POST" and path.rstrip("/") in self.direct:
            # /embed/ is /embed: Starlette would answer 307, which httpx and the openai client do not follow for a POST
            path = path.rstrip("/")
            scope = {**scope, "path": path}
        endpoint = path if path in self.endpoints else self._template_of(path)
        notes = scope.setdefault("bertserve", {})
        status = 500
        started = time.perf_counter()

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if self._draining() and not _closes(message):
                    # Answered while the server stops: the client's next request goes on a new connection
                    # (to another replica), never into this one as the server closes it.
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            await self._handle(scope, receive, send_and_note)
        finally:
            self.metrics.request_answered(endpoint, status, time.perf_counter() - started, notes)

    def _startup_failure_in_one_line(self, send: Send) -> Send:
        """Starlette reports a lifespan that failed with the exception's traceback, which uvicorn logs; a
        model the server cannot serve (a cause the lifespan names in `startup_error`) gets its one line."""
        async def send_one_line(message: Message) -> None:
            reason = getattr(self.api.state, "startup_error", None)
            if message["type"] == "lifespan.startup.failed" and reason:
                message = {**message, "message": reason}
            await send(message)
        return send_one_line

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        body = b""
        if method in _BODY_METHODS:
            body = await self._read_body(scope, receive, send)
            if body is None:  # answered already (413, 415, 422, or 499 to a client that left)
                return
        route = self.direct.get(scope["path"]) if method == "POST" else None
        if route is not None:
            request = Request(scope, receive)  # the body was read: receive() now only reports a disconnect
            try:
                response = await route(request, body)
            except Exception as e:  # noqa: BLE001 - answered as FastAPI's exception handlers answer it
                response = await handle_error(request, as_service_error(e, request))
            await response(scope, receive, send)
        elif method in _BODY_METHODS:
            await self.api(*_replayed(scope, receive, body), send)
        else:
            await self.api(scope, receive, send)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, decoded; None once answered (413, 415, 422; 499 when the client left before sending it)."""
        declared, encoding = b"", None
        for k, v in scope["headers"]:
            if k == b"content-length":
                declared = v
            elif k == b"content-encoding":
                encoding = v
        declared = declared.decode("latin-1")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send, declared)
            return None
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":  # answered to nobody, so that metrics count a 499
                answered = scope["bertserve"].get("answered")  # or what the connection limits answered (408, 400)
                err = (_AnsweredByConnection(*answered) if answered else
                       ClientClosed("the client closed the connection before it sent the whole body"))
                await self._answer_error(scope, receive, send, err)
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await self._reject(scope, receive, send, f"more than {self.max_bytes}")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if encoding is None:
            return body
        try:
            return decoded(body, encoding.decode("latin-1"), self.max_bytes)
        except ServiceError as err:
            await self._answer_error(scope, receive, send, err)
            return None

    async def _reject(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        err = PayloadTooLarge(f"the request body is {size} bytes; the server accepts at most {self.max_bytes}")
        await self._answer_error(scope, receive, send, err)

    @staticmethod
    async def _answer_error(scope: Scope, receive: Receive, send: Send, err: ServiceError) -> None:
        scope["bertserve"]["error_type"] = err.type
        await error_response(err.status, err.type, err.message)(scope, receive, send)


class _AnsweredByConnection(ServiceError):
    """What app/http_limits.py told the client itself (a body timeout's 408), sent to nobody here: for the metrics."""

    def __init__(self, status: int, type_: str, message: str):
        super().__init__(message)
        self.status, self.type = status, type_


def _replayed(scope: Scope, receive: Receive, body: bytes) -> tuple[Scope, Receive]:
    """The request as FastAPI reads it: the body already read, replayed once (later `receive()` calls
    reach the server, so a disconnect is still seen), and declared JSON."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    scope = dict(scope)  # the body as read: decoded already (Content-Encoding), and JSON
    scope["headers"] = [(k, v) for k, v in scope["headers"] if k not in (b"content-type", b"content-encoding")]
    scope["headers"].append((b"content-type", b"application/json"))
    return scope, replay


def _closes(start: Message) -> bool:
    """Whether a response's headers already say `Connection: close` (a 503 `shutting_down` does)."""
    return any(k.lower() == b"connection" and v.lower() == b"close" for k, v in start.get("headers", []))


class _Cors(CORSMiddleware):
    """Starlette's CORS handling, its refused preflight (an origin, method or header not allowed) answered
    in the error shape every other error has, not as plain text."""

    def preflight_response(self, request_headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        cors = {k: v for k, v in response.headers.items() if k.startswith("access-control-")}
        what = response.body.decode().removeprefix("Disallowed CORS ")  # origin, method, headers
        setting = " (cors_allow_origins)" if "origin" in what else ""
        return error_response(400, "invalid_request", f"CORS preflight refused: {what} not allowed{setting}", cors)
