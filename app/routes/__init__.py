"""Routers per area (embeddings, NSP, OpenAI compatibility, system) and what they share."""
from __future__ import annotations

import inspect
import logging
import secrets
from collections.abc import Callable

import orjson
from fastapi import Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from app.errors import InternalError, NotReady, ServiceError, Unauthorized
from app.service import InferenceService

log = logging.getLogger("app")


class _OrjsonRequest(Request):
    async def json(self):
        # orjson rejects non-UTF-8 bytes and lone surrogates with a JSONDecodeError (a subclass of json's),
        # which FastAPI turns into a validation error: 422, like any other malformed body.
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class ServiceRoute(APIRoute):
    """Parses bodies with orjson, and turns an unexpected exception into a logged 500 in our error shape.

    Endpoints whose parameters are only a JSON body model, the request, and dependencies that take
    only the request (ours all are) are called directly: FastAPI's general dependency solving cost
    more per request than the rest of the Python path together. The signature still makes the docs.
    `serve(request, body)` is that direct call; ServingMiddleware sends the route's requests to it, past
    FastAPI's routing layers (None: the endpoint needs FastAPI's own handling)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.serve = _direct_handler(self.dependant, self.body_field)

    def get_route_handler(self) -> Callable:
        handler = _direct_handler(self.dependant, self.body_field)
        if handler is None:
            handler = _guarded(super().get_route_handler())

        async def route_handler(request: Request) -> Response:
            return await handler(_OrjsonRequest(request.scope, request.receive))

        return route_handler


def _guarded(handler: Callable) -> Callable:
    """`handler`, with any exception but ours and FastAPI's turned into a logged InternalError (500)."""

    async def guarded(request: Request, *body: bytes) -> Response:
        try:
            return await handler(request, *body)
        except (ServiceError, HTTPException, RequestValidationError):
            raise
        except Exception as e:  # noqa: BLE001 - anything else is our bug: log it, answer 500
            log.exception("unexpected error on %s", request.url.path)
            raise InternalError(f"internal error ({type(e).__name__}); see the server log") from e

    return guarded


def _takes_only_request(dep: Dependant) -> bool:
    return (dep.request_param_name is not None and not dep.dependencies and inspect.iscoroutinefunction(dep.call)
            and not (dep.path_params or dep.query_params or dep.header_params or dep.cookie_params or dep.body_params)
            and len(inspect.signature(dep.call).parameters) == 1)


def _direct_handler(dependant: Dependant, body_field) -> Callable | None:
    """A handler doing what FastAPI's does for this endpoint, in its order (JSON parse errors, then the
    dependencies, then body validation errors), or None when the endpoint needs more than that. It is
    called as `handler(request)`, or `handler(request, body)` once the body was read."""
    if (not inspect.iscoroutinefunction(dependant.call) or len(dependant.body_params) > 1
            or dependant.path_params or dependant.query_params or dependant.header_params or dependant.cookie_params
            or not all(_takes_only_request(d) for d in dependant.dependencies)):
        return None
    body_name = body_field.name if body_field is not None else None
    adapter = TypeAdapter(body_field.field_info.annotation) if body_field is not None else None
    if adapter is not None and not (isinstance(body_field.field_info.annotation, type)
                                    and issubclass(body_field.field_info.annotation, BaseModel)):
        return None  # only whole-body models are handled here
    dependencies = [(d.name, d.call) for d in dependant.dependencies]
    endpoint, request_name = dependant.call, dependant.request_param_name

    async def handler(request: Request, body: bytes | None = None) -> Response:
        data = _json_body(await request.body() if body is None else body) if adapter is not None else None
        kwargs = {}
        for name, call in dependencies:
            value = await call(request)
            if name is not None:
                kwargs[name] = value
        if adapter is not None:
            kwargs[body_name] = _validate(adapter, data)
        if request_name is not None:
            kwargs[request_name] = request
        return await endpoint(**kwargs)

    return _guarded(handler)


def _json_body(raw: bytes):
    """The parsed body; None when empty. A decode error reads as FastAPI's own json_invalid error."""
    if not raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}], body=e.doc) from e


def _validate(adapter: TypeAdapter, data):
    if data is None:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        return adapter.validate_python(data)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                      for err in e.errors(include_url=False)], body=data) from None


# The dependencies are `async def` on purpose: FastAPI runs a plain `def` dependency in a worker thread,
# two thread hops per request for a few attribute reads.
async def get_service(request: Request) -> InferenceService:
    service = getattr(request.app.state, "service", None)
    if service is None:
        raise NotReady()
    return service


async def require_api_key(request: Request) -> None:
    key = request.app.state.settings.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise Unauthorized("this server needs an API key: send `Authorization: Bearer <key>`")
    if not secrets.compare_digest(given.strip().encode(), key.get_secret_value().encode()):
        raise Unauthorized("the API key is wrong")
