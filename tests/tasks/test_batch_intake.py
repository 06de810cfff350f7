"""Accepting a batch file: the strict-JSON screen, repeated custom_ids found after the file ends.

The screen (`batches.intake.plain_text`) lets most lines skip the API's strict-JSON walk; it must
never wave through a line `json_guard.body_errors` refuses. Repeated custom_ids are found at the end
of the file (`batches.unique_ids`, spilled to temporary files), so their errors must still come out
in line order beside the others, and with skip_invalid the repeated lines must not run.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.storage.object_streams import batch_object_key, iter_lines, open_writer
from kiln.storage.objects import ObjectStore, open_object_store
from kiln.storage.settings import StorageSettings
from kiln.tasks.api.json_guard import body_errors
from kiln.tasks.batches.intake import drop_repeats, item_line, parse_item, plain_text
from kiln.tasks.batches.unique_ids import CustomIds, Repeat
from kiln.tasks.contract.job_spec import JobSpec
from kiln.tasks.contract.schemas import JobRequest
from tests.tasks.helpers import Api
from tests.tasks.hostile import hostile_values, job_bodies
from tests.tasks.test_batches import (
    LINE,
    feeder,
    finish_queued,
    get_batch,
    jsonl,
    post_batch,
    results,
)

DEPTH = 32
_json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=12),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
lines = st.one_of(
    job_bodies(),
    hostile_values,
    st.tuples(_json_values, st.booleans()).map(
        lambda pair: json.dumps(pair[0], ensure_ascii=pair[1]).encode("utf-8", "surrogatepass")
    ),
    st.binary(max_size=64),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines)
def test_the_screen_passes_no_line_the_strict_check_refuses(raw: bytes) -> None:
    text = plain_text(raw, DEPTH)
    if text is None:
        return
    try:
        parsed = json.loads(text)
    except ValueError:
        return  # not JSON: the intake then asks body_errors, which says where
    assert body_errors(raw, DEPTH) == []
    assert parsed == json.loads(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": NaN}',
        b'{"a": -Infinity}',
        b'{"a": 1e999}',
        b'{"a": 1.5E+400}',
        b'{"a": "x\\uDBFF"}',
        b'{"a": 18446744073709551616}',
        b'{"a": "\\ud800"}',
        b'{"a": "\\u0000"}',
        b'{"a": "\xff"}',
        b"[" * 33 + b"]" * 33,
    ],
)
def test_the_screen_sends_every_refusable_line_to_the_strict_check(raw: bytes) -> None:
    assert plain_text(raw, DEPTH) is None


@pytest.mark.parametrize("ascii_only", [True, False])
def test_a_plain_line_passes_the_screen(ascii_only: bool) -> None:
    line = {**LINE, "custom_id": "a-1", "seed": 2**63, "metadata": {"k": "é ü"}}
    raw = json.dumps(line, ensure_ascii=ascii_only)
    assert plain_text(raw.encode(), DEPTH) == raw


def _repeats(ids: CustomIds, names: list[str]) -> list[Repeat]:
    for number, name in enumerate(names, start=1):
        ids.add(number, name, valid=number != 2)
    try:
        return list(ids.repeats())
    finally:
        ids.close()


def test_repeated_custom_ids_are_found_with_their_lines_across_spills() -> None:
    names = [f"id-{n % 150}" for n in range(400)]  # each id 2 or 3 times, far apart
    found = _repeats(CustomIds(spill_at=3), names)
    expected = [
        Repeat(line, name, names.index(name) + 1, line != 2)
        for line, name in enumerate(names, start=1)
        if names.index(name) + 1 != line
    ]
    assert found == expected


def test_a_hash_collision_is_no_repeat() -> None:
    # every id hashes alike: only the exact second pass tells them apart
    found = _repeats(CustomIds(hash_of=lambda _name: 7, spill_at=2), ["a", "b", "c", "b", "d"])
    assert found == [Repeat(4, "b", 2, True)]


def test_a_file_without_repeats_has_none() -> None:
    assert _repeats(CustomIds(spill_at=5), [f"u{n}" for n in range(300)]) == []


def test_a_repeat_found_at_the_end_is_refused_in_line_order_among_the_first_errors(
    api: Api,
) -> None:
    wide = [{**LINE, "custom_id": f"wide-{n}", "width": 4000} for n in range(30)]
    body = jsonl(
        [{**LINE, "custom_id": "a"}, {**LINE, "custom_id": "b"}, {**LINE, "custom_id": "a"}, *wide]
    )
    refused = post_batch(api, body, pipeline="tiny")
    assert refused.status_code == 422
    answer = refused.json()
    assert answer["invalid_lines"] == 31
    assert answer["lines"] == 33
    errors = answer["detail"][1:]
    assert len(errors) == 20
    assert errors[0]["line"] == 3
    assert errors[0]["type"] == "duplicate_custom_id"
    assert "first used on line 1" in errors[0]["msg"]
    assert [e["line"] for e in errors[1:]] == list(range(4, 23))
    assert {e["type"] for e in errors[1:]} == {"pipeline_limit"}


def test_a_repeated_line_invalid_on_its_own_counts_once_with_both_reasons(api: Api) -> None:
    body = jsonl([{**LINE, "custom_id": "a"}, {**LINE, "custom_id": "a", "steps": 0}])
    refused = post_batch(api, body, pipeline="tiny")
    assert refused.status_code == 422
    answer = refused.json()
    assert answer["invalid_lines"] == 1
    assert [(e["line"], e["loc"][-1]) for e in answer["detail"][1:]] == [
        (2, "steps"),
        (2, "custom_id"),
    ]


def test_skip_invalid_runs_a_repeated_custom_id_once_and_reports_the_repeat(api: Api) -> None:
    body = jsonl([{**LINE, "custom_id": f"c{n}"} for n in range(4)] + [{**LINE, "custom_id": "c1"}])
    created = post_batch(api, body, pipeline="tiny", skip_invalid="true")
    assert created.status_code == 201, created.text
    view = created.json()
    assert view["counts"]["total"] == 5
    assert view["counts"]["invalid"] == 1
    feed, published = feeder(api)
    feed.tick()
    assert len(published.calls) == 4
    finish_queued(api, view["id"])
    feed.tick()
    assert get_batch(api, view["id"])["status"] == "completed"
    lines = results(api, view["id"])[:-1]
    assert len(lines) == 5
    by_line = {line["line"]: line for line in lines}
    assert by_line[5]["status"] == "invalid"
    assert by_line[5]["custom_id"] == "c1"
    assert "duplicate custom_id 'c1': first used on line 2" in by_line[5]["error"]["message"]
    assert sorted(line["line"] for line in lines if line["status"] == "succeeded") == [1, 2, 3, 4]


@pytest.fixture(params=["local", "s3"])
def objects(
    request: pytest.FixtureRequest, storage_settings: StorageSettings, s3_settings: StorageSettings
) -> ObjectStore:
    return open_object_store(storage_settings if request.param == "local" else s3_settings)


def test_repeated_lines_are_dropped_from_the_committed_input_in_place(objects: ObjectStore) -> None:
    key = batch_object_key(objects.prefix, "b1", "input.jsonl")
    written = [
        item_line(n, f"c{n}", JobSpec.of(JobRequest(prompt=f"p{n}", seed=n))) for n in range(1, 8)
    ]
    writer = open_writer(objects, key, "application/x-ndjson")
    writer.write(b"".join(written))
    kept = drop_repeats(objects, writer.commit(), {2, 5})
    left = b"".join(line for n, line in enumerate(written, start=1) if n not in {2, 5})
    assert kept.key == key
    assert (kept.size, kept.sha256) == (len(left), hashlib.sha256(left).hexdigest())
    items = [parse_item(raw) for raw in iter_lines(objects, key)]
    assert [(item.line, item.custom_id) for item in items] == [
        (1, "c1"),
        (3, "c3"),
        (4, "c4"),
        (6, "c6"),
        (7, "c7"),
    ]
