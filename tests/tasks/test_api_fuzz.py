"""Property-based fuzzing of the API: from its own OpenAPI document, and with hostile bytes.

Schemathesis: every operation gets generated requests, valid and invalid, over real HTTP against
a real store; every response must be documented and match its schema, and none may be a 5xx
(except /readyz, whose documented 503 means "not ready"); an invalid request's rejection may also be
the body limit's 413 (a generated body over it). `positive_data_acceptance` is off: some
valid-by-schema requests are refused on purpose (unknown pipelines, unsafe webhook URLs, formats
that do not fit the frame count), and those refusals are documented 422s.

Hostile bytes (hypothesis, `tests.tasks.hostile`): what a schema never generates (NaN, Infinity,
huge integers, lone surrogates, NUL, deep nesting, odd query strings, headers and path ids) sent
as raw bytes on one keep-alive connection: each must be refused with a 4xx, and the same
connection must then serve a valid request.
"""

from __future__ import annotations

import json
import os
import secrets
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    negative_data_rejection,
    not_a_server_error,
    positive_data_acceptance,
)
from schemathesis.config import ChecksConfig, SchemathesisConfig

from kiln.storage.apikeys import ApiKeyStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.api.app import create_app
from kiln.tasks.api.auth import hash_api_key, new_api_key
from kiln.tasks.api.context import build_context
from tests.conftest import TEST_REDIS_URL, delete_namespace
from tests.tasks import hostile
from tests.tasks.helpers import ThreadServer, api_settings, drive_to_success, queued_job
from tests.tasks.raw_http import RawConnection

MAX_EXAMPLES = int(os.environ.get("KILN_FUZZ_EXAMPLES", "60"))
HOSTILE_EXAMPLES = int(os.environ.get("KILN_HOSTILE_EXAMPLES", "150"))
CASES: Counter[str] = Counter()
HOSTILE_CASES: Counter[str] = Counter()
SERVER_ERRORS: Counter[str] = Counter()


@dataclass(frozen=True)
class FuzzTarget:
    """The running API: its URL and port, an admin key, and a finished job to ask about."""

    url: str
    port: int
    key: str
    job_id: str


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzTarget]:
    """A running API on its own namespace with one admin key, one live node, one finished job."""
    redis_url = TEST_REDIS_URL
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
    job_id = queued_job(ctx.store)
    drive_to_success(ctx.store, job_id)  # finished: its event stream ends at once
    try:
        with ThreadServer(create_app(kiln, storage, context=ctx)) as server:
            yield FuzzTarget(server.url, server.port, key, job_id)
    finally:
        total = sum(CASES.values())
        print(f"\nschemathesis: {total} cases over {len(CASES)} operations: {dict(CASES)}")
        hostile_total = sum(HOSTILE_CASES.values())
        errors = sum(SERVER_ERRORS.values())
        print(f"hostile: {hostile_total} cases {dict(HOSTILE_CASES)}, {errors} server errors")
        _report(tmp_path_factory.getbasetemp(), total, hostile_total, errors)
        delete_namespace(redis_url, namespace)


def _report(base: Path, total: int, hostile_total: int, errors: int) -> None:
    (base / "fuzz-cases.txt").write_text(
        f"schemathesis {total}\nhostile {hostile_total}\nserver_errors {errors}\n"
    )


@schemathesis.serializer("application/x-ndjson")
def ndjson_lines(ctx: Any, value: Any) -> bytes:
    """A batch body (POST /v1/batches): each generated item one JSON line."""
    del ctx  # schemathesis's serializer signature
    items = value if isinstance(value, list) else [value]
    return b"".join(json.dumps(item).encode() + b"\n" for item in items)


def use_key(schema: Any, key: str) -> None:
    """Authenticate generated cases, except those that test missing credentials on purpose."""

    @schema.auth()
    class BearerKey:
        def get(self, case: Any, context: Any) -> str:
            del case, context  # schemathesis's AuthProvider signature
            return key

        def set(self, case: Any, data: str, context: Any) -> None:
            del context
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
        skipped = excluded
        if _skips_invalid_lines(case):
            # skip_invalid=true accepts a file with invalid lines by contract (they become
            # results); OpenAPI cannot tie the body's schema to a query parameter
            skipped = [*excluded, negative_data_rejection]
        case.call_and_validate(base_url=url, excluded_checks=skipped, timeout=30)

    try:
        check()
    except Unsatisfiable:
        # An operation with nothing to break (GET /healthz has no inputs) has no negative cases.
        assert mode is GenerationMode.NEGATIVE, label


def _skips_invalid_lines(case: Any) -> bool:
    return str((case.query or {}).get("skip_invalid", "")).lower() == "true"


# schemathesis's rejections of invalid data, plus 413: a negative body may be over the body limit
FUZZ_CONFIG = SchemathesisConfig.from_dict(
    {
        "checks": {
            "negative_data_rejection": {
                "expected-statuses": [
                    *ChecksConfig().negative_data_rejection.expected_statuses,
                    "413",
                ]
            }
        }
    }
)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_api_conforms_to_its_openapi(fuzz_server: FuzzTarget, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", config=FUZZ_CONFIG)
    use_key(schema, fuzz_server.key)
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 9
    for operation in operations:
        run_operation(operation, mode, fuzz_server.url)


HOSTILE_SETTINGS = settings(
    max_examples=HOSTILE_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck)
)


def refused_then_served(
    target: FuzzTarget, label: str, request: hostile.RawRequest, *, exact: int | None = None
) -> None:
    """Send `request` on a fresh connection, check its answer, then a valid request on it."""
    HOSTILE_CASES[label] += 1
    auth = (b"Authorization", f"Bearer {target.key}".encode())
    with RawConnection(target.port) as conn:
        response = conn.request(
            request.method, request.target, [auth, *request.headers], request.body
        )
        if response.status >= 500:
            SERVER_ERRORS[label] += 1
        assert response.status < 500, (request, response)
        if exact is not None:
            assert response.status == exact, (request, response)
            hostile.assert_names_a_field(response.body)
        assert not response.will_close, (request, response)
        after = conn.request("GET", f"/v1/jobs/{target.job_id}".encode(), [auth])
        assert after.status == 200, (request, after)


def test_hostile_json_bodies_are_refused_naming_the_field(fuzz_server: FuzzTarget) -> None:
    @given(body=hostile.job_bodies())
    @HOSTILE_SETTINGS
    def check(body: bytes) -> None:
        request = hostile.RawRequest("POST", b"/v1/jobs", [hostile.JSON_TYPE], body)
        refused_then_served(fuzz_server, "json body", request, exact=422)

    check()


def test_hostile_headers_queries_and_ids_are_never_5xx(fuzz_server: FuzzTarget) -> None:
    @given(request=hostile.requests(fuzz_server.job_id))
    @HOSTILE_SETTINGS
    def check(request: hostile.RawRequest) -> None:
        refused_then_served(fuzz_server, "header/query/path", request)

    check()
