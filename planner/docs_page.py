"""The API docs (/docs: Swagger UI, /redoc: ReDoc) served from the planner itself, for air-gapped fleets.

FastAPI's own pages load their scripts and styles from a CDN, so on a machine without the internet
/docs is blank. The assets come from the `fastapi-offline` package (Swagger UI and ReDoc bundles,
nothing else is used from it) and are served under /docs-static; the pages are FastAPI's own HTML
pointed at them, with no favicon or font fetched from elsewhere.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse, PlainTextResponse

_BUNDLES = importlib.util.find_spec("fastapi_offline")  # a dependency; an environment without it still serves
STATIC = None if _BUNDLES is None or _BUNDLES.origin is None else Path(_BUNDLES.origin).parent / "static"
PREFIX = "/docs-static"


def add_offline_docs(app: FastAPI) -> None:
    """/docs, /redoc and their assets under /docs-static (the app is built with docs_url=None)."""
    if STATIC is None:

        @app.get("/docs", include_in_schema=False)
        @app.get("/redoc", include_in_schema=False)
        async def no_bundles() -> PlainTextResponse:
            why = "the API docs need the package fastapi-offline (pip install it); see /openapi.json"
            return PlainTextResponse(why, status_code=503)

        return
    app.mount(PREFIX, StaticFiles(directory=STATIC), name="docs-static")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - API docs",
            swagger_js_url=f"{PREFIX}/swagger-ui-bundle.js",
            swagger_css_url=f"{PREFIX}/swagger-ui.css",
            swagger_favicon_url=f"{PREFIX}/favicon.png",
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{PREFIX}/redoc.standalone.js",
            redoc_favicon_url=f"{PREFIX}/favicon.png",
            with_google_fonts=False,
        )
