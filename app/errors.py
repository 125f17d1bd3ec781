"""Domain exceptions and the one place that maps them (and FastAPI's own errors) to HTTP responses.

Every error leaves the server as {"error": {"type": ..., "message": ...}} with the status code below.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from app.responses import json_response

log = logging.getLogger("app")


class ServiceError(Exception):
    """Base of every error a client can cause or meet; `status` and `type` say how it is answered."""

    status = 500
    type = "internal_error"

    def __init__(self, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class InvalidInput(ServiceError):
    status, type = 422, "invalid_request"


class TooManyInputs(ServiceError):
    status, type = 413, "too_many_inputs"


class InputTooLong(ServiceError):
    status, type = 413, "input_too_long"


class PayloadTooLarge(ServiceError):
    status, type = 413, "payload_too_large"


class UnsupportedMediaType(ServiceError):
    """A body in an encoding (Content-Encoding) the server does not decode."""
    status, type = 415, "unsupported_media_type"


class Unsupported(ServiceError):
    """The request is well formed but asks for something this model or endpoint cannot do."""
    status, type = 400, "unsupported"


class NotFound(ServiceError):
    status, type = 404, "not_found"


class Unauthorized(ServiceError):
    status, type = 401, "unauthorized"

    def __init__(self, message: str):
        super().__init__(message, {"WWW-Authenticate": "Bearer"})


class Overloaded(ServiceError):
    status, type = 429, "overloaded"

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message, {"Retry-After": str(retry_after_s)})


class NotReady(ServiceError):
    status, type = 503, "not_ready"

    def __init__(self, message: str = "the model is not loaded yet (or the server is shutting down)"):
        super().__init__(message, {"Retry-After": "1"})


class EngineLost(NotReady):
    """The engine can run nothing more in this process: a CUDA error that leaves the device's context
    unusable. The batch's requests are answered 503 (another replica can take them) and the server stops
    serving: the process has to be restarted."""


class ShuttingDown(ServiceError):
    """The server is draining after a stop signal: a request that came after it, or one still queued at
    the drain deadline. Another replica can answer it. `Connection: close`: a keep-alive client opens its
    next connection (to another replica) instead of sending it down one this server is about to close."""
    status, type = 503, "shutting_down"

    def __init__(self, message: str):
        super().__init__(message, {"Retry-After": "1", "Connection": "close"})


class ClientClosed(ServiceError):
    """The client went away before its answer was ready (nginx's 499); nobody reads this response."""
    status, type = 499, "client_closed_request"


class InternalError(ServiceError):
    status, type = 500, "internal_error"


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
_HTTP_TYPES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 415: "unsupported_media_type"}


def error_response(status: int, type_: str, message: str, headers: dict[str, str] | None = None,
                   request: Request | None = None) -> Response:
    if request is not None:  # read by ServingFront, which labels failures by type
        request.scope.setdefault("bertserve", {})["error_type"] = type_
    return json_response({"error": {"type": type_, "message": message}}, status, headers)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc) -> str:
    """A location as the request spells it (inputs[0].text), without pydantic's names of the members of a
    union it tried (str, list[...], a model's class name)."""
    path = ""
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in part or part in _TYPE_NAMES or part[:1].isupper():
            continue
        else:
            path += f".{part}" if path else part
    return path or "body"


def _describe_validation_error(exc: RequestValidationError) -> str:
    """One clause per field: the alternatives of a union a value matched none of are said together."""
    by_field: dict[str, list[str]] = {}
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", "")
            if "UTF-8" in detail:  # orjson's words for invalid bytes and for an escaped lone surrogate alike
                return ("the body is not valid UTF-8 JSON: it holds invalid bytes, or an escaped lone surrogate such "
                        "as \\ud800")
            return f"the body is not valid JSON ({detail})" if detail else "the body is not valid JSON"
        messages = by_field.setdefault(_field_path(err.get("loc", ())), [])
        message = err.get("msg", "invalid").removeprefix("Input ").removeprefix("Value error, ")
        if message not in messages:
            messages.append(message)
    parts = [f"{field}: " + " or ".join([messages[0], *(m.removeprefix("should be ") for m in messages[1:])])
             for field, messages in list(by_field.items())[:5]]
    more = len(by_field) - 5
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


async def handle_error(request: Request, exc: Exception) -> Response:
    """The response the app's exception handler for `exc` gives (as Starlette picks it: the nearest class);
    `exc` itself again when the app has none."""
    handlers = request.app.exception_handlers
    for cls in type(exc).__mro__:
        if cls in handlers:
            return await handlers[cls](request, exc)
    raise exc


def register_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> Response:
        return error_response(exc.status, exc.type, exc.message, exc.headers, request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(422, "invalid_request", _describe_validation_error(exc), request=request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        type_ = _HTTP_TYPES.get(exc.status_code, "invalid_request" if exc.status_code < 500 else "internal_error")
        headers = getattr(exc, "headers", None)
        allowed = _allowed_methods(request) if exc.status_code == 405 else ""
        if allowed:
            headers = {**(headers or {}), "Allow": allowed}
        return error_response(exc.status_code, type_, str(exc.detail), headers, request)


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at the request's path. Starlette's 405 names the first route's only,
    and `/` has two: GET (the page) and POST (the TEI route)."""
    routes = request.app.router.routes
    return ", ".join(method for method in _METHODS if any(
        route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes))
