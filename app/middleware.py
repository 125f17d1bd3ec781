"""The one ASGI layer in front of FastAPI's: counts every request in the metrics, reads bodies up to a
size limit (413 past it) as JSON whatever the Content-Type says, and hands the service routes' requests
straight to their handlers."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import PayloadTooLarge, error_response, handle_error
from app.metrics import Metrics

_BODY_METHODS = ("POST", "PUT", "PATCH")


class ServingMiddleware:
    """One layer instead of several, each of which cost a few percent of a short request's CPU time:

    - metrics: requests by endpoint and status, failures also by error type (set by the error handlers);
    - bodies: read up to `max_bytes` (413 past it, without reading further); a `curl -d` without
      `-H 'Content-Type: application/json'` works;
    - `routes` ((method, path) -> the route's `serve(request, body)`) are answered here, their errors by
      the app's exception handlers: FastAPI's middleware, routing, request and exit-stack layers under
      this one cost a fifth of a one-text /embed's CPU time. Everything else goes on to FastAPI."""

    def __init__(self, app: ASGIApp, metrics: Metrics, endpoints: frozenset[str], routes: dict, max_bytes: int):
        self.app, self.metrics, self.endpoints, self.routes, self.max_bytes = app, metrics, endpoints, routes, max_bytes

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
            await self._serve(scope, receive, send_and_note)
        finally:
            self.metrics.request_answered(endpoint, status, time.perf_counter() - started, notes)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        body = b""
        if method in _BODY_METHODS:
            body = await self._read_body(scope, receive, send)
            if body is None:
                return
        serve = self.routes.get((method, scope["path"]))
        if serve is not None:
            request = Request(scope, receive)  # the body was read: receive() now only reports a disconnect
            try:
                response = await serve(request, body)
            except Exception as e:  # noqa: BLE001 - ours and FastAPI's only: serve() turns the rest into ours
                response = await handle_error(request, e)
            await response(scope, receive, send)
        elif method in _BODY_METHODS:
            await self.app(*_replayed(scope, receive, body), send)
        else:
            await self.app(scope, receive, send)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None once answered 413 or the client left before sending it."""
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"").decode("latin-1")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send, declared)
            return None
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await self._reject(scope, receive, send, f"more than {self.max_bytes}")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        err = PayloadTooLarge(f"the request body is {size} bytes; the server accepts at most {self.max_bytes}")
        scope["bertserve"]["error_type"] = err.type
        await error_response(err.status, err.type, err.message)(scope, receive, send)


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

    scope = dict(scope)
    scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    scope["headers"].append((b"content-type", b"application/json"))
    return scope, replay
