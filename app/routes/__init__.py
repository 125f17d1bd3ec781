"""Routers per area (embeddings, NSP, OpenAI compatibility, system) and what they share: the
dependencies, the route class, and `DirectRoute`, the fast path of the service endpoints."""
from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from pydantic import BaseModel, RootModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from app.errors import InternalError, NotReady, ServiceError, Unauthorized
from app.service import InferenceService

log = logging.getLogger("app")


# The dependencies are `async def` on purpose: FastAPI runs a plain `def` dependency in a worker thread,
# two thread hops per request for a few attribute reads. DirectRoute calls their checks directly.
async def get_service(request: Request) -> InferenceService:
    return service_of(request)


def service_of(request: Request) -> InferenceService:
    service = getattr(request.app.state, "service", None)
    if service is None:
        reason = getattr(request.app.state, "not_ready_reason", None)
        raise NotReady(reason) if reason else NotReady()
    return service


# Declares the scheme in the OpenAPI schema (so /docs has an Authorize button); the check is ours, below.
_BEARER = HTTPBearer(auto_error=False, description="the server's API key (BERTSERVE_API_KEY), when it has one")


async def require_api_key(request: Request, _declared: object = Security(_BEARER)) -> None:
    check_api_key(request)


def check_api_key(request: Request) -> None:
    key = request.app.state.settings.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise Unauthorized("this server needs an API key: send `Authorization: Bearer <key>`")
    if not secrets.compare_digest(given.strip().encode(), key.get_secret_value().encode()):
        raise Unauthorized("the API key is wrong")


def as_service_error(exc: Exception, request: Request) -> Exception:
    """`exc` if it is ours or FastAPI's; anything else is our bug: logged, and answered as a 500."""
    if isinstance(exc, (ServiceError, HTTPException, RequestValidationError)):
        return exc
    log.error("unexpected error on %s", request.url.path, exc_info=exc)
    return InternalError(f"internal error ({type(exc).__name__}); see the server log")


class ServiceRoute(APIRoute):
    """FastAPI's route (FastAPI's documented custom-route-class extension point) with bodies parsed by
    orjson and unexpected exceptions answered as a logged 500 in our error shape."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            try:
                return await handler(_OrjsonRequest(request.scope, request.receive))
            except Exception as e:  # noqa: BLE001 - see as_service_error
                raise as_service_error(e, request) from e

        return route_handler


class _OrjsonRequest(Request):
    async def json(self):
        # orjson rejects non-UTF-8 bytes and lone surrogates with a JSONDecodeError (a subclass of json's),
        # which FastAPI turns into a validation error: 422, like any other malformed body.
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


ServiceEndpoint = Callable[..., Awaitable[Response]]  # endpoint(body, request, service)


class JsonObject(RootModel[dict[str, Any]]):
    """A body read as a JSON object only, for a route that answers several contracts at one path: the
    route picks the contract (by the model served, or by the fields present) and validates the body as
    that contract's (validate_body)."""


@dataclass(frozen=True, slots=True)
class DirectRoute:
    """A service endpoint `endpoint(body, request, service)` called straight from the body the front read,
    doing what FastAPI does for it in FastAPI's order: JSON parse errors, then the dependencies (API key,
    a loaded model), then body validation. Its FastAPI route stays for the docs and for HEAD."""

    endpoint: ServiceEndpoint
    body: type[BaseModel]

    async def __call__(self, request: Request, raw: bytes) -> Response:
        data = _json_body(raw)
        check_api_key(request)
        service = service_of(request)
        return await self.endpoint(validate_body(self.body, data), request, service)


def loads(raw: bytes):
    """orjson's parse. A number past a double's range (10**400), which orjson refuses as "number is infinity",
    is read by the standard library instead, so that validation names the field that holds it; NaN and
    Infinity, which are not JSON, stay refused."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "number is infinity" not in e.msg:
            raise
        try:
            return json.loads(raw, parse_constant=_not_json)
        except ValueError:
            raise e from None


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _json_body(raw: bytes):
    """The parsed body; None when empty. A decode error reads as FastAPI's own json_invalid error. A UTF-8
    byte order mark (which Windows tools write) is skipped, as RFC 8259 lets a parser do."""
    if not raw:
        return None
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        return loads(raw)
    except orjson.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}], body=e.doc) from e


def validate_body(model: type[BaseModel], data) -> BaseModel:
    """`data` (a parsed JSON body; None when there was none) as `model`; else FastAPI's 422 for a body."""
    if data is None:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                      for err in e.errors(include_url=False)], body=data) from None


def get_and_head(router: APIRouter, path: str, **kwargs: Any) -> Callable[[Callable], Callable]:
    """GET, and HEAD beside it: load balancers' health checks and uptime monitors often send HEAD (uvicorn
    sends HEAD answers bodiless). The schema lists the GET only, as FastAPI's `get` does: one route for
    both would give both operations the same operationId."""
    def register(endpoint: Callable) -> Callable:
        router.head(path, include_in_schema=False, **kwargs)(endpoint)
        return router.get(path, **kwargs)(endpoint)
    return register
