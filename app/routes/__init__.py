"""Routers per area (embeddings, NSP, OpenAI compatibility, system) and what they share."""
from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
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
    """Parses bodies with orjson, and turns an unexpected exception into a logged 500 in our error shape."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            try:
                return await handler(_OrjsonRequest(request.scope, request.receive))
            except (ServiceError, HTTPException, RequestValidationError):
                raise
            except Exception as e:  # noqa: BLE001 - anything else is our bug: log it, answer 500
                log.exception("unexpected error on %s", request.url.path)
                raise InternalError(f"internal error ({type(e).__name__}); see the server log") from e

        return route_handler


def get_service(request: Request) -> InferenceService:
    service = getattr(request.app.state, "service", None)
    if service is None:
        raise NotReady()
    return service


def require_api_key(request: Request) -> None:
    key = request.app.state.settings.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise Unauthorized("this server needs an API key: send `Authorization: Bearer <key>`")
    if not secrets.compare_digest(given.strip().encode(), key.get_secret_value().encode()):
        raise Unauthorized("the API key is wrong")
