"""GET / (a page for meeting the model), /docs and /redoc, all from files installed with the package: app/static/
and the Swagger UI and ReDoc bundles of the `fastapi-offline` package, so nothing is loaded from a CDN."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.staticfiles import StaticFiles
from starlette.responses import FileResponse, HTMLResponse, Response
from starlette.types import Scope

from app.routes import get_and_head

STATIC = Path(__file__).resolve().parents[1] / "static"  # installed as package data (pyproject.toml)
# The browser itself keeps these pages from loading anything from another host: ReDoc, for one, always adds
# an <img> from cdn.redoc.ly. 'unsafe-inline': Swagger UI's page starts it with an inline script, ReDoc
# injects its styles; blob: ReDoc's search runs in a worker made from a blob.
_SAME_ORIGIN_ONLY = {"Content-Security-Policy": "default-src 'self'; script-src 'self' 'unsafe-inline'; "
                     "style-src 'self' 'unsafe-inline'; img-src 'self' data:; worker-src 'self' blob:"}

# A browser keeps a file that has no Cache-Control for a tenth of its age (Last-Modified) without asking:
# after an upgrade it would show the old page, or the new page with the old page.js. "no-cache": it asks
# each time, and is answered 304 while the file is unchanged.
_REVALIDATE = {"Cache-Control": "no-cache"}


class _RevalidatedFiles(StaticFiles):
    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(_REVALIDATE)
        return response


# No API key is needed to load these: the page asks for one and sends it with the API calls it makes.
# GET / is in the API schema (beside POST /, the TEI route); the documentation pages are not.
router = APIRouter(tags=["page"])
# Our files first, then fastapi-offline's swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png.
router.mount("/static", _RevalidatedFiles(directory=STATIC, packages=[("fastapi_offline", "static")]), name="static")


@get_and_head(router, "/", response_class=HTMLResponse)
async def page() -> FileResponse:
    """A page for meeting the model (HTML)."""
    return FileResponse(STATIC / "index.html", headers={**_SAME_ORIGIN_ONLY, **_REVALIDATE})


# Relative URLs, as the page's own: behind a proxy that serves the API under a path prefix (/bert/docs to
# /docs), the browser asks for /bert/static/... and /bert/openapi.json, which the proxy passes on.
_OPENAPI = "openapi.json"
# The API schema's one server, relative too: OpenAPI resolves a relative server URL against the document's
# own, so Swagger UI's "Try it out" (and ReDoc's endpoint URLs) put /bert in front of /v1/embeddings where the
# document came from /bert/openapi.json, and nothing where it came from /openapi.json. The proxy need not
# say its prefix (X-Forwarded-Prefix) nor the server be told it (uvicorn's root_path).
SERVERS = [{"url": ".", "description": "this server, at the path this document was read from"}]


def _static(name: str) -> str:
    return f"static/{name}"


def _same_origin_only(response: HTMLResponse) -> HTMLResponse:
    response.headers.update(_SAME_ORIGIN_ONLY)
    return response


@router.get("/docs", include_in_schema=False)
async def swagger_ui(request: Request) -> HTMLResponse:
    return _same_origin_only(get_swagger_ui_html(
        openapi_url=_OPENAPI, title=f"{request.app.title} - Swagger UI",
        swagger_js_url=_static("swagger-ui-bundle.js"), swagger_css_url=_static("swagger-ui.css"),
        swagger_favicon_url=_static("favicon.png"),
        swagger_ui_parameters={"validatorUrl": None}))  # no badge fetched from swagger.io


@router.get("/redoc", include_in_schema=False)
async def redoc(request: Request) -> HTMLResponse:
    return _same_origin_only(get_redoc_html(
        openapi_url=_OPENAPI, title=f"{request.app.title} - ReDoc", redoc_js_url=_static("redoc.standalone.js"),
        redoc_favicon_url=_static("favicon.png"), with_google_fonts=False))
