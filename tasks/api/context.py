"""What every route shares (`ApiContext`), built once per app, and the start-up budget check."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import anyio
from celery import Celery

from kiln.storage.async_creation import AsyncCreation
from kiln.storage.base import async_redis_client
from kiln.storage.job_store import JobStore
from kiln.storage.objects import ObjectStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.api.auth import Authenticator
from kiln.tasks.api.sse import StreamSlots
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.intake.intake import Intake
from kiln.tasks.queue.backlog import BacklogCache
from kiln.tasks.queue.process import ProcessParts
from kiln.tasks.queue.submit import Submitter
from kiln.tasks.webhooks.ssrf import Resolver, UrlPolicy, policy_from, system_resolver

# Sync routes and dependencies run in anyio's default thread pool (40 threads); each may hold a
# Redis connection while it runs, so that many must stay free of event streams.
API_THREADS = 40
# The submit route's own Redis connections (an asyncio pool, beside the threads' pool): past them
# a submission waits its turn for one.
SUBMIT_CONNECTIONS = 32


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
    # the event loop's job creation (the submit route's), built in the loop that first asks
    _creation: tuple[asyncio.AbstractEventLoop, AsyncCreation] | None = field(
        default=None, init=False
    )

    # the backlogs admission control reads (tasks/queue/backlog.py), each kept for a moment
    backlogs: BacklogCache = field(init=False)
    # the one way in (tasks/intake): POST /v1/jobs and batch lines run its checks
    intake: Intake = field(init=False)

    def __post_init__(self) -> None:
        self.sse_limiter = anyio.CapacityLimiter(self.sse_slots.total)
        self.backlogs = BacklogCache(self.store, self.settings)
        self.intake = Intake(
            self.submitter,
            self.objects,
            resolve=self.resolve,
            webhook_policy=self.policy,
            backlogs=self.backlogs,
        )

    def creation(self) -> AsyncCreation:
        """Job creation for the running event loop (a client's connections serve one loop)."""
        loop = asyncio.get_running_loop()
        if self._creation is None or self._creation[0] is not loop:
            client = async_redis_client(self.store.settings, SUBMIT_CONNECTIONS)
            self._creation = (loop, AsyncCreation(self.store, client))
        return self._creation[1]

    async def aclose(self) -> None:
        """Close what the running loop opened (at the app's shutdown)."""
        if self._creation is not None and self._creation[0] is asyncio.get_running_loop():
            creation, self._creation = self._creation[1], None
            await creation.aclose()


def build_context(
    settings: KilnSettings,
    storage_settings: StorageSettings,
    *,
    resolve: Resolver = system_resolver,
) -> ApiContext:
    """Connect the stores and the Celery producer the API uses (`kiln api`: the process's own)."""
    parts = ProcessParts(settings, storage_settings)
    store, celery = parts.store, parts.celery_app
    return ApiContext(
        settings=settings,
        store=store,
        objects=parts.objects,
        submitter=parts.submitter,  # each job's message in its creation script, where it can
        auth=Authenticator(
            parts.api_keys,
            enabled=settings.auth_enabled,
            pepper=settings.api_key_pepper.get_secret_value(),
            cache_s=settings.api_key_cache_s,
        ),
        celery=celery,
        policy=policy_from(settings.webhook_allow_http, settings.webhook_allow_hosts),
        sse_slots=StreamSlots(
            settings.sse_max_streams_per_key,
            settings.sse_max_streams_total,
            settings.sse_max_lifetime_s,
        ),
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
