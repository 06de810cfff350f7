"""The HTTP API (FastAPI): `create_app` builds it, `serve_api` runs it under uvicorn (`kiln api`).

Routes live in `api.job_routes`, `api.event_routes` (server-sent events) and `api.system_routes`
(nodes, pipelines, health); what they share is `api.context.ApiContext`, through `api.deps`. This
module wires the error translation (`api.errors`: storage errors → 409/503, refusals → 422 in
FastAPI's own error shape) and the body size limit, and checks at start-up that event streams leave
Redis connections for everything else. `api.http_guard` holds the connection-level limits uvicorn
runs with.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from kiln.common.logs import configure_logging, start_json_logging
from kiln.common.tracing import start_tracing
from kiln.storage.errors import IdempotencyConflict, StorageUnavailable
from kiln.storage.settings import StorageSettings
from kiln.tasks.api.admin_routes import router as admin_routes
from kiln.tasks.api.batch_control_routes import router as batch_control_routes
from kiln.tasks.api.batch_event_routes import router as batch_event_routes
from kiln.tasks.api.batch_routes import router as batch_routes
from kiln.tasks.api.body_limit import BodySizeLimit, document_too_large
from kiln.tasks.api.console import mount_console
from kiln.tasks.api.context import ApiContext, build_context, check_connection_budget
from kiln.tasks.api.dead_letter_routes import router as dead_letter_routes
from kiln.tasks.api.errors import (
    DescriptorExhaustion,
    idempotency_conflict,
    storage_unavailable,
    validation_error,
)
from kiln.tasks.api.event_routes import router as event_routes
from kiln.tasks.api.http_guard import uvicorn_config
from kiln.tasks.api.job_routes import router as job_routes
from kiln.tasks.api.metrics import install_metrics
from kiln.tasks.api.output_routes import router as output_routes
from kiln.tasks.api.pause_routes import router as pause_routes
from kiln.tasks.api.pipeline_routes import router as pipeline_routes
from kiln.tasks.api.system_routes import router as system_routes
from kiln.tasks.api.upload_routes import router as upload_routes
from kiln.tasks.api.usage_routes import router as usage_routes
from kiln.tasks.contract.batches import BATCHES_PATH
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.contract.upload_slots import LOCAL_PUT_PATH

log = logging.getLogger(__name__)
API_VERSION = "1.0.0"


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    ctx: ApiContext = app.state.kiln
    await ctx.aclose()  # the event loop's Redis connections (the submit route's)


def create_app(
    settings: KilnSettings,
    storage_settings: StorageSettings,
    *,
    context: ApiContext | None = None,
) -> FastAPI:
    """The FastAPI app; pass `context` to supply prebuilt parts (tests: a resolver)."""
    check_connection_budget(settings, storage_settings)
    ctx = context or build_context(settings, storage_settings)
    if not settings.auth_enabled:
        log.warning("AUTH IS DISABLED (KILN_AUTH_ENABLED=false): every caller is an admin")
    app = FastAPI(
        title="Kiln",
        version=API_VERSION,
        description="Durable queue for GPU image and video generation jobs.",
        lifespan=_lifespan,
        # no 307 to the path without its trailing slash: `/v1/batches/..%2f` decodes to
        # `/v1/batches/../`, whose redirect names `..` as a batch id; an unknown path is a 404
        redirect_slashes=False,
        # Any route: the server itself refuses a malformed or oversized request line or headers
        # before routing (api.http_guard), as plain text.
        responses={400: {"description": "Malformed or oversized request line or headers."}},
    )
    app.state.kiln = ctx
    for routes in (
        job_routes,
        pause_routes,
        output_routes,
        event_routes,
        system_routes,
        pipeline_routes,
        batch_routes,
        batch_control_routes,
        batch_event_routes,
        admin_routes,
        upload_routes,
        dead_letter_routes,
        usage_routes,
    ):
        app.include_router(routes)
    document_too_large(app)
    mount_console(app)  # /console: the static page, which calls the routes above
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StorageUnavailable, storage_unavailable)
    app.add_exception_handler(IdempotencyConflict, idempotency_conflict)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_body_bytes,
        streamed={  # read as a stream by their routes
            BATCHES_PATH: settings.max_batch_bytes,
            LOCAL_PUT_PATH: max(settings.upload_max_bytes, settings.max_batch_bytes),
        },
    )
    # out of file descriptors anywhere under it (a route, the body limit): 503, never a 500
    app.add_middleware(DescriptorExhaustion)
    install_metrics(app, ctx)  # GET /metrics; outermost, so a 413 is counted too
    return app


def serve_api(
    settings: KilnSettings,
    storage_settings: StorageSettings,
    host: str | None = None,
    port: int | None = None,
    *,
    fd: int | None = None,
    **uvicorn_options: Any,
) -> None:
    """Run the API under uvicorn until interrupted (what `kiln api` calls).

    With `fd`, serve on that inherited listening socket instead of binding host:port (a child of
    `api.supervisor`, one of `kiln api --workers N`).
    """
    # Logging first (KILN_LOG_FORMAT): in JSON, uvicorn's loggers propagate to Kiln's handler.
    capture = start_json_logging("INFO") if settings.log_format == "json" else None
    if capture is None:
        configure_logging("text", "INFO")
    else:
        uvicorn_options.setdefault("log_config", None)
    log.info("kiln api: %s", storage_settings.describe())  # which Redis, namespace, store
    start_tracing("kiln-api")  # spans only where the OTEL_* variables ask (off by default)
    try:
        app = create_app(settings, storage_settings)
        if host:
            uvicorn_options["host"] = host
        if port is not None:
            uvicorn_options["port"] = port
        server = uvicorn.Server(uvicorn_config(app, settings, **uvicorn_options))
        # socket(fileno=) reads the family (IPv4/6) from the fd; uvicorn's `fd=` assumes AF_UNIX
        server.run(sockets=None if fd is None else [socket.socket(fileno=fd)])
    finally:
        if capture is not None:
            capture.stop()
