"""The HTTP API (FastAPI): `create_app` builds it, `serve_api` runs it under uvicorn (`kiln api`).

Routes live in `tasks.api_routes`; this module wires the parts they share (`ApiContext`), the error
translation (`tasks.api_errors`: storage errors → 409/503, refusals → 422 in FastAPI's own error
shape), the body size limit, and checks at start-up that event streams leave Redis connections
for everything else. `tasks.http_guard` holds the connection-level limits uvicorn runs with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import anyio
import uvicorn
from celery import Celery
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from storage.apikeys import ApiKeyStore
from storage.errors import IdempotencyConflict, StorageUnavailable
from storage.objects import ObjectStore, open_object_store
from storage.settings import StorageSettings
from storage.status import JobStore
from tasks.api_errors import idempotency_conflict, storage_unavailable, validation_error
from tasks.app import make_celery_app
from tasks.auth import Authenticator
from tasks.http_guard import uvicorn_config
from tasks.http_limits import BodySizeLimit
from tasks.settings import KilnSettings
from tasks.sse import StreamSlots
from tasks.ssrf import Resolver, UrlPolicy, policy_from, system_resolver
from tasks.submit import Submitter, celery_publisher

log = logging.getLogger(__name__)
API_VERSION = "1.0.0"
# Sync routes and dependencies run in anyio's default thread pool (40 threads); each may hold a
# Redis connection while it runs, so that many must stay free of event streams.
API_THREADS = 40


@dataclass
class ApiContext:
    """Everything the routes share, built once per app."""

    settings: KilnSettings
    store: JobStore
    objects: ObjectStore | None
    submitter: Submitter
    auth: Authenticator
    celery: Celery | None
    policy: UrlPolicy
    sse_slots: StreamSlots
    resolve: Resolver = system_resolver
    # threads for the streams' blocking reads; a stream has one read at a time, so one per slot
    sse_limiter: anyio.CapacityLimiter = field(init=False)

    def __post_init__(self) -> None:
        self.sse_limiter = anyio.CapacityLimiter(self.sse_slots.total)


def build_context(
    settings: KilnSettings,
    storage_settings: StorageSettings,
    *,
    resolve: Resolver = system_resolver,
) -> ApiContext:
    """Connect the stores and the Celery producer the API uses."""
    store = JobStore.from_settings(storage_settings)
    celery = make_celery_app(settings, storage_settings)
    return ApiContext(
        settings=settings,
        store=store,
        objects=open_object_store(storage_settings),
        submitter=Submitter(store, settings, publish=celery_publisher(celery)),
        auth=Authenticator(
            ApiKeyStore(store.redis, storage_settings),
            enabled=settings.auth_enabled,
            pepper=settings.api_key_pepper.get_secret_value(),
        ),
        celery=celery,
        policy=policy_from(settings.webhook_allow_http, settings.webhook_allow_hosts),
        sse_slots=StreamSlots(settings.sse_max_streams_per_key, settings.sse_max_streams_total),
        resolve=resolve,
    )


def check_connection_budget(settings: KilnSettings, storage_settings: StorageSettings) -> None:
    """Refuse to start when event streams could take the Redis connections requests need."""
    per_key, total = settings.sse_max_streams_per_key, settings.sse_max_streams_total
    pool = storage_settings.redis_max_connections
    if per_key > total:
        raise ValueError(
            f"KILN_SSE_MAX_STREAMS_PER_KEY ({per_key}) is above "
            f"KILN_SSE_MAX_STREAMS_TOTAL ({total})"
        )
    if total + API_THREADS > pool:
        raise ValueError(
            f"KILN_SSE_MAX_STREAMS_TOTAL ({total}) plus the API's {API_THREADS} request threads "
            f"is above KILN_REDIS_MAX_CONNECTIONS ({pool}): streams could starve requests"
        )


def create_app(
    settings: KilnSettings,
    storage_settings: StorageSettings,
    *,
    context: ApiContext | None = None,
) -> FastAPI:
    """The FastAPI app; pass `context` to supply prebuilt parts (tests: a resolver)."""
    from tasks.api_routes import router

    check_connection_budget(settings, storage_settings)
    ctx = context or build_context(settings, storage_settings)
    if not settings.auth_enabled:
        log.warning("AUTH IS DISABLED (KILN_AUTH_ENABLED=false): every caller is an admin")
    app = FastAPI(
        title="Kiln",
        version=API_VERSION,
        description="Durable queue for GPU image and video generation jobs.",
    )
    app.state.kiln = ctx
    app.include_router(router)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StorageUnavailable, storage_unavailable)
    app.add_exception_handler(IdempotencyConflict, idempotency_conflict)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    return app


def serve_api(
    settings: KilnSettings,
    storage_settings: StorageSettings,
    host: str | None = None,
    port: int | None = None,
    **uvicorn_options: Any,
) -> None:
    """Run the API under uvicorn until interrupted (what `kiln api` calls)."""
    app = create_app(settings, storage_settings)
    if host:
        uvicorn_options["host"] = host
    if port is not None:
        uvicorn_options["port"] = port
    uvicorn.Server(uvicorn_config(app, settings, **uvicorn_options)).run()
