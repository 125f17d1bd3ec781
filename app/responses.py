"""JSON responses serialised by orjson, numpy arrays included (no per-float Python objects)."""
from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.responses import Response

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


class JSONBytesResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=_OPTIONS)


def json_response(content: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return JSONBytesResponse(content, status_code=status, headers=headers)


async def json_response_off_loop(content: Any, headers: dict[str, str] | None = None) -> Response:
    """json_response for an answer of token vectors (up to hundreds of MB): rendered in a worker thread,
    so that the event loop goes on answering other connections meanwhile (orjson holds the GIL, which
    Python hands over every few milliseconds), not after the whole render."""
    body = await asyncio.to_thread(orjson.dumps, content, option=_OPTIONS)
    return Response(body, headers=headers, media_type="application/json")
