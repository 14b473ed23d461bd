"""The FastAPI application: routes, error mapping, metrics and the background reaper."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, IntegrityError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Match

from planner.answers import error_response, planner_error_response
from planner.auth import Authenticator
from planner.contract.errors import PlannerError
from planner.contract.manifest import RankManifest
from planner.database_down import DatabaseDown
from planner.db import Database
from planner.docs_page import add_offline_docs
from planner.fleet import ProgressBoard, RefusalLog
from planner.guard import RequestGuard
from planner.heartbeats import HeartbeatBatcher
from planner.hotpath import HotPath
from planner.metrics import MetricsMiddleware, PlannerMetrics
from planner.protocol_guard import ProtocolGuard
from planner.routes import anchors, assignments, compile_caches, fleet, identities, instances, observe
from planner.selection import make_policy
from planner.service import Planner
from planner.service.reaper import reap
from planner.settings import PlannerSettings
from planner.writes import WriteBatcher

log = logging.getLogger(__name__)


class InsecureRefused(PlannerError):
    """No token is configured and --insecure was not given."""


PROBE_POLL_S = 0.2  # how soon a seed that reports asked about is probed


def create_app(settings: PlannerSettings, *, db: Database | None = None, run_reaper: bool = True) -> FastAPI:
    """The planner app over `settings.db_url` (the schema must already be migrated)."""
    if not settings.has_tokens() and not settings.insecure:
        raise InsecureRefused(
            "no token configured (RFORK_ADMIN_TOKEN, RFORK_REGISTER_TOKEN, RFORK_LOAD_TOKEN,"
            " RFORK_READER_TOKEN or the legacy RFORK_INSTANCE_TOKEN);"
            " refusing to start without auth; pass --insecure to run without it"
        )
    database = db or Database(settings.db_url, pool_size=settings.db_pool_size)
    planner = Planner(db=database, settings=settings, policy=make_policy(settings.selection_policy))
    metrics = PlannerMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # few worker threads: database work is short and (on SQLite) serialised, and dozens of threads
        # queueing on one lock under the GIL made a convoy (p99 > 1 s with anyio's default of 40)
        threads = settings.threadpool_size or (4 if database.sqlite else 8)
        anyio.to_thread.current_default_thread_limiter().total_tokens = threads
        if not settings.has_tokens():
            log.warning("planner running WITHOUT authentication (--insecure): every caller is admin")
        tasks = (
            [asyncio.create_task(_reaper_loop(planner, metrics)), asyncio.create_task(_prober_loop(planner))]
            if run_reaper
            else []
        )
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if db is None:
                database.close()

    app = FastAPI(
        title="rfork planner",
        version="1",
        lifespan=lifespan,
        description="Which running instance a new LLM instance should pull its weights from.",
        # FastAPI's native OpenTelemetry asks the environment for a provider on every request (4% of the
        # CPU per request in the profile); the planner's figures are its Prometheus /metrics
        telemetry={"tracing": False, "metrics": False, "logs": False},
        docs_url=None,  # served from local files below: FastAPI's own pages load a CDN
        redoc_url=None,
    )
    add_offline_docs(app)
    app.state.planner = planner
    app.state.metrics = metrics
    app.state.progress = ProgressBoard()  # the fleet page: bytes done of live pulls (this process)
    app.state.refusals = RefusalLog()  # and the latest refusals
    app.state.heartbeats = HeartbeatBatcher(planner, settings.heartbeat_batch_s)
    app.state.writes = (
        WriteBatcher(planner)
        if database.sqlite
        else WriteBatcher(planner, max_batch=1, concurrency=settings.threadpool_size or 8)
    )
    app.state.authenticator = (
        Authenticator(
            db=database,
            admin=settings.admin_token,
            register=settings.register_token,
            anchor=settings.anchor_token,
            load=settings.load_token,
            reader=settings.reader_token,
            instance=settings.instance_token,
        )
        if settings.has_tokens()
        else None
    )
    app.include_router(instances.router)
    app.include_router(assignments.router)
    app.include_router(compile_caches.router)
    app.include_router(observe.router)
    app.include_router(fleet.router)
    app.include_router(anchors.router)
    app.include_router(identities.router)
    _add_error_handlers(app)
    _add_manifest_schema(app)
    app.add_middleware(
        RequestGuard,
        state=app.state,
        body_limit=settings.max_body_bytes,
        manifest_limit=settings.max_manifest_bytes,
    )
    # heartbeat, assignment, report answered without FastAPI routing (anything else falls through)
    app.add_middleware(
        HotPath,
        state=app.state,
        batcher=app.state.heartbeats,
        writes=app.state.writes,
        body_limit=settings.max_body_bytes,
    )
    app.add_middleware(ProtocolGuard)  # outside the hot path: another protocol is refused everywhere
    app.add_middleware(DatabaseDown)  # around all of it: a database that went away is a 503 anywhere
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # added last: outermost, so it counts both
    return app


def app_from_env() -> FastAPI:
    """The app from RFORK_* environment variables (the factory `serve --workers N` gives uvicorn)."""
    logging.getLogger("planner").setLevel(logging.INFO)
    return create_app(PlannerSettings())


async def _reaper_loop(planner: Planner, metrics: PlannerMetrics) -> None:
    interval = planner.settings.reaper_interval_s
    while True:
        await asyncio.sleep(interval)
        try:
            res = await asyncio.to_thread(reap, planner.db, planner.settings, time.time())
            metrics.reaped.labels(kind="stale").inc(res.stale)
            metrics.reaped.labels(kind="expired").inc(res.expired)
        except Exception:  # noqa: BLE001 - a failed pass is retried next interval
            log.exception("reaper pass failed")


async def _prober_loop(planner: Planner) -> None:
    """Probe the seeds that reports asked about as they come (every PROBE_POLL_S), and the quarantined
    ones every probe_interval_s (planner.service.probes)."""
    last = time.monotonic()
    while True:
        await asyncio.sleep(PROBE_POLL_S)
        due = time.monotonic() - last >= planner.settings.probe_interval_s
        if not planner.suspects and not due:
            continue
        if due:
            last = time.monotonic()
        try:
            await asyncio.to_thread(functools.partial(planner.probe_pass, time.time(), quarantined=due))
        except Exception:  # noqa: BLE001 - a failed pass is retried next time
            log.exception("probe pass failed")


def _add_manifest_schema(app: FastAPI) -> None:
    """The manifest body is parsed by hand (to store it verbatim); publish its schema in the components."""
    plain = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = plain()
            defs = RankManifest.model_json_schema(ref_template="#/components/schemas/{model}")
            comps = doc.setdefault("components", {}).setdefault("schemas", {})
            comps.update(defs.pop("$defs", {}))
            comps["RankManifest"] = defs
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(PlannerError)
    async def _planner_error(_req: Request, exc: PlannerError) -> JSONResponse:
        return planner_error_response(exc)

    @app.exception_handler(DataError)
    async def _data_error(_req: Request, exc: DataError) -> JSONResponse:
        return error_response(422, f"a value does not fit its column: {str(exc.orig).splitlines()[0]}")

    @app.exception_handler(IntegrityError)
    async def _integrity_error(_req: Request, exc: IntegrityError) -> JSONResponse:
        return error_response(409, f"conflicts with stored data: {str(exc.orig).splitlines()[0]}")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code != 405:
            return await http_exception_handler(req, exc)
        # Starlette names only the methods of the first route whose path matched; a path served by
        # several routes (GET and PUT of a manifest) must list them all, as the OpenAPI document does
        allowed: set[str] = set()
        for route in req.app.routes:
            match, _ = route.matches(req.scope)
            if match is not Match.NONE:
                allowed |= set(getattr(route, "methods", None) or ())
        allowed.discard("HEAD")
        return JSONResponse(
            {"detail": f"method {req.method} is not allowed here"},
            status_code=405,
            headers={"Allow": ", ".join(sorted(allowed))},
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        fields = ", ".join(".".join(str(p) for p in e["loc"]) for e in errors)
        return error_response(422, errors, message=f"invalid request: {fields}")
