"""Request body handling before FastAPI: a size limit (413) and JSON whatever the Content-Type says."""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import PayloadTooLarge, error_response


class RequestBodyMiddleware:
    """Reads a request body up to `max_bytes` (answering 413 past it, without reading further), then
    replays it to the app; later `receive()` calls reach the server, so a disconnect is still seen.
    Every body is parsed as JSON: a `curl -d` without `-H 'Content-Type: application/json'` works."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def _reject(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        err = PayloadTooLarge(f"the request body is {size} bytes; the server accepts at most {self.max_bytes}")
        scope.setdefault("bertserve", {})["error_type"] = err.type
        await error_response(err.status, err.type, err.message)(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"").decode("latin-1")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send, declared)
            return
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await self._reject(scope, receive, send, f"more than {self.max_bytes}")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
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
        await self.app(scope, replay, send)
