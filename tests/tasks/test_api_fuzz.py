"""Property-based fuzzing of the API from its own OpenAPI document (schemathesis).

Every operation gets generated requests, valid and invalid, over real HTTP against a real store;
every response must be documented and match its schema, and none may be a 5xx (except /readyz,
whose documented 503 means "not ready"). `positive_data_acceptance` is off: some valid-by-schema
requests are refused on purpose (unknown pipelines, unsafe webhook URLs, formats that do not fit
the frame count), and those refusals are documented 422s.
"""

from __future__ import annotations

import os
import secrets
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, positive_data_acceptance

from storage.apikeys import ApiKeyStore
from storage.settings import StorageSettings
from tasks.api import build_context, create_app
from tasks.auth import hash_api_key, new_api_key
from tests.conftest import delete_namespace
from tests.tasks.helpers import ThreadServer, api_settings

MAX_EXAMPLES = int(os.environ.get("KILN_FUZZ_EXAMPLES", "60"))
CASES: Counter[str] = Counter()


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A running API on its own namespace with one admin key and one live node."""
    redis_url = os.environ.get("KILN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    namespace = f"kiln-test-fuzz-{secrets.token_hex(4)}"
    outputs = tmp_path_factory.mktemp("fuzz-outputs")
    storage = StorageSettings(
        redis_url=redis_url, redis_namespace=namespace, storage_url=f"file://{outputs}"
    )
    kiln = api_settings(max_queue_depth=None)
    ctx = build_context(kiln, storage)
    key = new_api_key()
    ApiKeyStore(ctx.store.redis, storage).create(hash_api_key(key), "fuzz", admin=True)
    ctx.store.publish_node("fuzz-node", {"pipelines": ["tiny"]}, ttl_s=3600)
    try:
        with ThreadServer(create_app(kiln, storage, context=ctx)) as server:
            yield server.url, key
    finally:
        total = sum(CASES.values())
        print(f"\nschemathesis: {total} cases over {len(CASES)} operations: {dict(CASES)}")
        _report(tmp_path_factory.getbasetemp(), total)
        delete_namespace(redis_url, namespace)


def _report(base: Path, total: int) -> None:
    (base / "fuzz-cases.txt").write_text(f"{total}\n")


def use_key(schema: Any, key: str) -> None:
    """Authenticate generated cases, except those that test missing credentials on purpose."""

    @schema.auth()
    class BearerKey:
        def get(self, case: Any, context: Any) -> str:
            return key

        def set(self, case: Any, data: str, context: Any) -> None:
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


def run_operation(operation: Any, mode: GenerationMode, url: str) -> None:
    """Hypothesis over one operation in one generation mode."""
    label = f"{operation.method.upper()} {operation.path}"
    excluded = [positive_data_acceptance]
    if operation.path == "/readyz":
        excluded.append(not_a_server_error)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        CASES[label] += 1
        case.call_and_validate(base_url=url, excluded_checks=excluded, timeout=30)

    try:
        check()
    except Unsatisfiable:
        # An operation with nothing to break (GET /healthz has no inputs) has no negative cases.
        assert mode is GenerationMode.NEGATIVE, label


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_api_conforms_to_its_openapi(fuzz_server: tuple[str, str], mode: GenerationMode) -> None:
    url, key = fuzz_server
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    use_key(schema, key)
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 9
    for operation in operations:
        run_operation(operation, mode, url)
