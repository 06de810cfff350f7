"""The HTTP API (FastAPI): `create_app` builds it, `serve_api` runs it under uvicorn (`kiln api`).

Routes live in `tasks.api_routes`; this module wires the parts they share (`ApiContext`), the error
translation (storage errors → 409/503, submit refusals → 422 in FastAPI's own error shape) and the
body size limit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import anyio
from celery import Celery
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from storage.apikeys import ApiKeyStore
from storage.errors import IdempotencyConflict, StorageUnavailable
from storage.objects import ObjectStore, open_object_store
from storage.settings import StorageSettings
from storage.status import JobStore
from tasks.app import make_celery_app
from tasks.auth import Authenticator
from tasks.http_limits import BodySizeLimit
from tasks.settings import KilnSettings
from tasks.ssrf import Resolver, UrlPolicy, policy_from, system_resolver
from tasks.submit import Submitter, celery_publisher

log = logging.getLogger(__name__)
API_VERSION = "1.0.0"
SSE_MAX_CONCURRENT_READS = 256


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
    resolve: Resolver = system_resolver
    sse_limiter: anyio.CapacityLimiter = field(
        default_factory=lambda: anyio.CapacityLimiter(SSE_MAX_CONCURRENT_READS)
    )


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
        resolve=resolve,
    )


async def _storage_unavailable(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(
        {"detail": f"job store unavailable: {exc}"}, status_code=503, headers={"Retry-After": "1"}
    )


async def _idempotency_conflict(request: Request, exc: Exception) -> JSONResponse:
    detail = "Idempotency-Key was already used with a different request body"
    return JSONResponse({"detail": detail}, status_code=409)


def create_app(
    settings: KilnSettings,
    storage_settings: StorageSettings,
    *,
    context: ApiContext | None = None,
) -> FastAPI:
    """The FastAPI app; pass `context` to supply prebuilt parts (tests: a resolver)."""
    from tasks.api_routes import router

    ctx = context or build_context(settings, storage_settings)
    if not settings.auth_enabled:
        log.warning("AUTH IS DISABLED (KILN_AUTH_ENABLED=false): every caller is an admin")
    app = FastAPI(
        title="Kiln",
        version=API_VERSION,
        description="Durable queue for GPU image and video generation jobs (DESIGN.md §3).",
    )
    app.state.kiln = ctx
    app.include_router(router)
    app.add_exception_handler(StorageUnavailable, _storage_unavailable)
    app.add_exception_handler(IdempotencyConflict, _idempotency_conflict)
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
    import uvicorn

    app = create_app(settings, storage_settings)
    uvicorn.run(
        app,
        host=host or settings.api_host,
        port=port if port is not None else settings.api_port,
        **uvicorn_options,
    )
