"""Fixtures of the API, client and webhook tests (helpers live in tests/tasks/helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kiln.storage.settings import StorageSettings
from kiln.tasks.api.app import create_app
from kiln.tasks.api.context import build_context
from kiln.tasks.webhooks.ssrf import Resolver, system_resolver
from tests.tasks.helpers import Api, ApiFactory, Receiver, ThreadServer, api_settings


@pytest.fixture
def make_api(storage_settings: StorageSettings) -> Iterator[ApiFactory]:
    """Start APIs with settings overrides (`storage`: StorageSettings); keys alice, bob, admin."""
    servers: list[ThreadServer] = []
    apis: list[Api] = []

    def make(
        resolve: Resolver = system_resolver, storage: dict[str, Any] | None = None, **overrides: Any
    ) -> Api:
        settings = api_settings(**overrides)
        stored = storage_settings.model_copy(update=storage or {})
        ctx = build_context(settings, stored, resolve=resolve)
        server = ThreadServer(create_app(settings, stored, context=ctx)).__enter__()
        servers.append(server)
        api = Api(server.url, ctx, settings, stored)
        api.add_key("alice")
        api.add_key("bob")
        api.add_key("admin", admin=True)
        apis.append(api)
        return api

    yield make
    for server in servers:
        server.__exit__()
    for api in apis:
        if api.ctx.celery is not None:
            api.ctx.celery.close()
        api.store.redis.close()


@pytest.fixture
def api(make_api: ApiFactory) -> Api:
    """A running API with default test settings."""
    return make_api()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A receiver that answers 200 to everything (tests may set `script`)."""
    r = Receiver()
    yield r
    r.close()
