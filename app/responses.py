"""JSON responses serialised by orjson, numpy arrays included (no per-float Python objects)."""
from __future__ import annotations

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
