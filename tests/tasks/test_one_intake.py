"""One intake: the same requests through every entrance, and the same outcome at each.

Entrances: POST /v1/jobs over real HTTP (uvicorn); the direct entrance on Redis (the intake as
Python callers and `kiln submit` without --api use it); `kiln submit` as a process (a few rows);
a batch line (POST /v1/batches with skip_invalid: a refused line is an `invalid` result naming
the same code and field); and a retried line's job, as the feeder makes it from what the intake
accepted at upload. Each outcome is either a refusal (status, code, field path) or an accepted
request, equal at every entrance but for a drawn seed (the caller's seed is kept; a drawn one is
drawn once per job and kept by a retry of its line).

No node runs: a heartbeat announces what a node would (an image pipeline, a LoRA), real Redis,
a local object store holding real uploads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from kiln.common.limits import TINY_LIMITS
from kiln.common.request import DRAWN_SEED_LIMIT
from kiln.storage.object_streams import iter_lines
from kiln.storage.settings import StorageSettings
from kiln.storage.uploaded_inputs import new_upload_id, upload_key
from kiln.tasks.batches.intake import batch_job_id, parse_item
from kiln.tasks.client.client import KilnClient
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.intake.intake import Intake
from kiln.tasks.intake.refusal import Caller, Refused
from kiln.tasks.queue.submit import Submitter
from tests.e2e.image_server import CAT
from tests.tasks.helpers import Api, ApiFactory, drive_to_success, fake_dns
from tests.tasks.test_batches import feeder, get_batch, jsonl, post_batch, results
from tests.tasks.test_batches_control import control
from tests.tasks.test_uploads import PIPELINE as IMG
from tests.tasks.test_uploads import SCHEMA as IMAGE_SCHEMA

DNS = {
    "images.example": ["93.184.216.34"],
    "hooks.example": ["93.184.216.35"],
    "internal.example": ["10.0.0.8"],
}
# what the API and the direct entrance share (the CLI process gets the same as KILN_* variables)
SETTINGS: dict[str, Any] = {
    "input_allow_http": False,
    "input_allow_hosts": [],
    "webhook_allow_http": False,
    "webhook_allow_hosts": [],
    "upload_max_bytes": 64 * 1024,
}
TINY: dict[str, Any] = {"pipeline": "tiny", "prompt": "a fox", "width": 64, "height": 64}
ACCEPTED = ("accepted",)
# a PNG whose header declares 50000 x 50000 pixels: small on disk, a bomb once decoded
BOMB = CAT[:16] + (50000).to_bytes(4, "big") * 2 + CAT[24:]


def refused(status: int, code: str, *loc: str | int) -> tuple[Any, ...]:
    """The outcome of a refusal: HTTP status, error code, the field path from the request."""
    return ("refused", status, code, loc)


def img(image: str, **inputs: Any) -> dict[str, Any]:
    """An image-to-image request naming `image` (placeholders `<...>` are filled per run)."""
    return {"pipeline": IMG, "prompt": "a cat", "inputs": {"image": image, **inputs}}


BAD_FORM = refused(422, "pipeline_input", "inputs", "image")  # not a reference the node reads
BAD_UPLOAD = refused(422, "image_input", "inputs", "image")
BAD_URL = refused(422, "unsafe_url", "inputs", "image")


@dataclass(frozen=True)
class Row:
    """One request and the outcome every entrance must give it."""

    name: str
    body: dict[str, Any]
    expect: tuple[Any, ...]
    cli: list[str] | None = None  # `kiln submit` arguments, for the rows the CLI also sends


ROWS = [
    # valid: every entrance accepts the same request
    Row(
        "plain", TINY, ACCEPTED, ["a fox", "--pipeline", "tiny", "--width", "64", "--height", "64"]
    ),
    Row("own-seed", {**TINY, "seed": 7}, ACCEPTED),
    Row("metadata", {**TINY, "metadata": {"team": "kiln"}}, ACCEPTED),
    Row("lora", {**TINY, "loras": [{"name": "ember", "scale": 0.5}]}, ACCEPTED),
    Row("own-upload", img("<alice>"), ACCEPTED),
    Row("https-image", img("https://images.example/cat.png", strength=0.5), ACCEPTED),
    # within the upload limits: the node refuses its pixels when it decodes it, at every door
    Row("bomb-upload", img("<bomb>"), ACCEPTED),
    Row("https-webhook", {**TINY, "webhook": {"url": "https://hooks.example/h"}}, ACCEPTED),
    Row("far-start-by", {**TINY, "start_by": 4102444800.0}, ACCEPTED),
    Row("bulk-lane", {**TINY, "priority": "bulk"}, ACCEPTED),
    Row("own-checkpoints", {**TINY, "checkpoint": {"every_steps": 5}}, ACCEPTED),
    # 1. the schema
    Row("no-prompt", {"pipeline": "tiny", "width": 64}, refused(422, "missing", "prompt")),
    Row("zero-steps", {**TINY, "steps": 0}, refused(422, "greater_than_equal", "steps")),
    Row("unknown-field", {**TINY, "colour": "red"}, refused(422, "extra_forbidden", "colour")),
    Row(
        "lora-dotted",
        {**TINY, "loras": [{"name": "a.b"}]},
        refused(422, "string_pattern_mismatch", "loras", 0, "name"),
    ),
    Row(
        "lora-twice",
        {**TINY, "loras": [{"name": "ember"}, {"name": "ember"}]},
        refused(422, "value_error", "loras"),
    ),
    Row(
        "checkpoint-two-cadences",
        {**TINY, "checkpoint": {"every_steps": 5, "every_seconds": 60}},
        refused(422, "value_error", "checkpoint"),
    ),
    Row(
        "checkpoint-zero",
        {**TINY, "checkpoint": {"every_steps": 0}},
        refused(422, "greater_than_equal", "checkpoint", "every_steps"),
    ),
    # 2. the pipeline's declaration and limits, its inputs, LoRAs
    Row(
        "unknown-pipeline",
        {**TINY, "pipeline": "nope"},
        refused(422, "unknown_pipeline", "pipeline"),
        ["x", "--pipeline", "nope"],
    ),
    Row("too-wide", {**TINY, "width": 4096}, refused(422, "pipeline_limit", "width")),
    Row(
        "frames",
        {"pipeline": "tiny-video", "prompt": "waves", "num_frames": 16},
        refused(422, "pipeline_limit", "num_frames"),
    ),
    Row(
        "lora-unknown",
        {**TINY, "loras": [{"name": "smoke"}]},
        refused(422, "unknown_adapter", "loras", 0, "name"),
        ["a fox", "--pipeline", "tiny", "--width", "64", "--height", "64", "--lora", "smoke"],
    ),
    Row("input-unknown", img("<alice>", x=1), refused(422, "unknown_input", "inputs", "x")),
    Row(
        "input-range",
        img("<alice>", strength=2),
        refused(422, "pipeline_input", "inputs", "strength"),
    ),
    Row(
        "checkpoints-unsupported",  # its schema announces no x-kiln-checkpoints
        {**img("<alice>"), "checkpoint": {"every_seconds": 60}},
        refused(422, "checkpoints_unsupported", "checkpoint"),
    ),
    Row("image-plain-name", img("cat.png"), BAD_FORM),
    Row("image-bad-id", img("upload:../../etc"), BAD_FORM),
    Row("image-file-url", img("file:///etc/passwd"), BAD_FORM),
    # 3. image inputs: the upload is the caller's own and within limits, a URL passes the rules
    Row(
        "upload-missing",
        img("<missing>"),
        BAD_UPLOAD,
        ["a cat", "--pipeline", IMG, "--input", "image=<missing>"],
    ),
    Row("upload-of-bob", img("<bob>"), BAD_UPLOAD),
    Row("upload-too-big", img("<big>"), BAD_UPLOAD),
    Row("upload-not-image", img("<text>"), BAD_UPLOAD),
    Row(
        "metadata-address",
        img("https://169.254.169.254/latest/meta-data"),
        BAD_URL,
        ["a cat", "--pipeline", IMG, "--input", "image=https://169.254.169.254/latest/meta-data"],
    ),
    Row(
        "http-not-allowed",
        img("http://images.example/cat.png"),
        BAD_URL,
    ),
    Row("loopback", img("https://127.0.0.1/cat.png"), BAD_URL),
    Row("numeric-loopback", img("https://2130706433/x.png"), BAD_URL),
    Row("mapped-loopback", img("https://[::ffff:127.0.0.1]/x.png"), BAD_URL),
    Row("private-by-dns", img("https://internal.example/x.png"), BAD_URL),
    # 4. the webhook rule
    Row(
        "bad-webhook",
        {**TINY, "webhook": {"url": "not a url"}},
        refused(422, "unsafe_url", "webhook", "url"),
    ),
    Row(
        "webhook-metadata",
        {**TINY, "webhook": {"url": "https://169.254.169.254/h"}},
        refused(422, "unsafe_url", "webhook", "url"),
    ),
    Row(
        "webhook-http",
        {**TINY, "webhook": {"url": "http://hooks.example/h"}},
        refused(422, "unsafe_url", "webhook", "url"),
    ),
    Row(
        "webhook-private",
        {**TINY, "webhook": {"url": "https://internal.example/h"}},
        refused(422, "unsafe_url", "webhook", "url"),
    ),
]


@pytest.fixture
def api(make_api: ApiFactory) -> Api:
    """An API with strict URL rules, announcing an image pipeline and a LoRA as a node would."""
    made = make_api(resolve=fake_dns(DNS), **SETTINGS)
    announce(made)
    return made


def announce(api: Api) -> None:
    """A heartbeat of a node serving tiny (adapter `ember`) and the image pipeline."""
    adapters = {"tiny": {"available": ["ember"], "loaded": [], "fused": []}}
    info = {
        "pipelines": ["tiny", IMG],
        "limits": {"tiny": dict(TINY_LIMITS["tiny"])},
        "adapters": adapters,
        "inputs": {IMG: IMAGE_SCHEMA},
    }
    api.store.publish_node("node-a", info, ttl_s=300)


def placeholders(api: Api) -> dict[str, str]:
    """Upload references the rows name: alice's own, bob's, one never uploaded, bad ones."""
    objects = api.ctx.objects
    assert objects is not None
    refs: dict[str, str] = {}
    with (
        KilnClient(api.url, api.keys["alice"]) as alice,
        KilnClient(api.url, api.keys["bob"]) as bob,
    ):
        refs["<alice>"] = alice.upload(CAT).ref
        refs["<bob>"] = bob.upload(CAT).ref
    made = [
        ("<big>", CAT + bytes(64 * 1024), "image/png"),
        ("<text>", b"hi", "text/plain"),
        ("<bomb>", BOMB, "image/png"),
    ]
    for name, data, kind in made:
        upload_id = new_upload_id()  # put as a PUT through a slot would: under alice's folder
        objects.put(upload_key(objects.prefix, api.key_ids["alice"], upload_id), data, kind)
        refs[name] = f"upload:{upload_id}"
    refs["<missing>"] = f"upload:{new_upload_id()}"
    return refs


def filled(value: Any, refs: dict[str, str]) -> Any:
    """`value` with every placeholder string replaced by its reference."""
    if isinstance(value, dict):
        return {key: filled(item, refs) for key, item in value.items()}
    if isinstance(value, list):
        return [filled(item, refs) for item in value]
    return refs.get(value, value) if isinstance(value, str) else value


def through_api(api: Api, body: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """POST /v1/jobs as alice: the outcome, and the job's stored request when accepted."""
    answer = httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth("alice"))
    if answer.status_code == 201:
        return ACCEPTED, api.store.get(answer.json()["id"]).request
    detail = answer.json()["detail"]
    assert isinstance(detail, list), answer.text
    (error,) = detail
    assert error["loc"][0] == "body"
    return refused(answer.status_code, error["type"], *error["loc"][1:]), None


def through_direct(
    intake: Intake, caller: Caller, body: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """The direct entrance on Redis: the Python caller's parse (the schema), then the intake."""
    try:
        request = JobRequest.model_validate(body)
    except ValidationError as exc:
        (error,) = exc.errors()
        return refused(422, error["type"], *error["loc"]), None
    try:
        record, created = intake.submit(request, caller)
    except Refused as exc:
        refusal = exc.refusal
        return refused(refusal.status, refusal.code, *refusal.loc), None
    assert created
    return ACCEPTED, record.request


def through_batch(api: Api, bodies: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Every row as one line of one batch (skip_invalid); its id and each line's outcome."""
    lines = [{**body, "custom_id": name} for name, body in bodies.items()]
    answer = post_batch(api, jsonl(lines), skip_invalid="true", priority="interactive")
    assert answer.status_code == 201, answer.text
    batch_id = str(answer.json()["id"])
    outcomes: dict[str, Any] = {}
    for line in results(api, batch_id):
        if line.get("status") == "invalid":
            (error,) = line["error"]["errors"]
            outcomes[line["custom_id"]] = (refused(422, error["type"], *error["loc"]), None)
    objects = api.ctx.objects
    assert objects is not None
    assert get_batch(api, batch_id)["counts"]["total"] == len(lines)
    for raw in iter_lines(objects, input_key(api, batch_id)):  # one item per accepted line
        if raw:
            item = parse_item(raw)
            outcomes[item.custom_id] = (ACCEPTED, item.spec.encode())
    return batch_id, outcomes


def input_key(api: Api, batch_id: str) -> str:
    """The object key of a batch's stored (accepted, normalized) lines."""
    from kiln.storage.batch_store import BatchStore

    return BatchStore(api.store.redis, api.storage_settings).get_fed(batch_id).input_key


def through_retry(api: Api, batch_id: str) -> dict[str, dict[str, Any]]:
    """Cancel the batch before any line is fed, retry its lines: each retried line's job request."""
    assert control(api, batch_id, "cancel").status_code == 200
    feed, _ = feeder(api)
    feed.tick()  # ends every unfed line as canceled, then the batch
    assert get_batch(api, batch_id)["status"] == "canceled"
    made = control(api, batch_id, "retry", include="canceled")
    assert made.status_code == 201, made.text
    retry_id = str(made.json()["id"])
    feed.tick()
    jobs: dict[str, dict[str, Any]] = {}
    for custom_id in custom_ids(api, retry_id):
        jobs[custom_id] = api.store.get(batch_job_id(retry_id, custom_id)).request
    return jobs


def custom_ids(api: Api, batch_id: str) -> Iterator[str]:
    """The custom_ids of a batch's stored lines."""
    objects = api.ctx.objects
    assert objects is not None
    for raw in iter_lines(objects, input_key(api, batch_id)):
        if raw:
            yield parse_item(raw).custom_id


def same_request(a: dict[str, Any], b: dict[str, Any], own_seed: bool) -> bool:
    """Equal requests: with the caller's seed exactly; with a drawn one, but for the seed."""
    for request in (a, b):
        assert 0 <= request["seed"] < DRAWN_SEED_LIMIT or own_seed
    if own_seed:
        return a == b
    return {**a, "seed": None} == {**b, "seed": None}


def test_every_entrance_gives_every_request_the_same_outcome(api: Api) -> None:
    refs = placeholders(api)
    bodies = {row.name: filled(row.body, refs) for row in ROWS}
    submitter = Submitter(api.store, api.settings, publish=lambda *_a, **_k: None)
    # as the CLI's direct backend builds it, with the API's resolver (DNS is outside Kiln)
    intake = Intake(submitter, api.ctx.objects, resolve=fake_dns(DNS))
    alice = Caller(api.key_ids["alice"])
    batch_id, by_line = through_batch(api, bodies)
    differ: list[tuple[str, str, tuple[Any, ...]]] = []
    for row in ROWS:
        body = bodies[row.name]
        outcomes = {
            "api": through_api(api, body),
            "direct": through_direct(intake, alice, body),
            "batch line": by_line[row.name],
        }
        differ += [
            (row.name, door, got) for door, (got, _) in outcomes.items() if got != row.expect
        ]
        if row.expect == ACCEPTED and not differ:
            own_seed = "seed" in body
            stored = [request for _, request in outcomes.values()]
            assert all(r is not None for r in stored)
            assert same_request(stored[0], stored[1], own_seed), row.name
            assert same_request(stored[0], stored[2], own_seed), row.name
    assert differ == [], "\n".join(map(str, differ))  # where an entrance differs from the table
    retried = through_retry(api, batch_id)
    accepted = [row.name for row in ROWS if row.expect == ACCEPTED]
    assert sorted(retried) == sorted(accepted)  # no refused line ever becomes a job
    for name in accepted:
        assert retried[name] == by_line[name][1], name  # the line's request, its seed kept


def test_the_cli_process_gives_the_same_outcomes(
    api: Api, storage_settings: StorageSettings
) -> None:
    refs = placeholders(api)
    env = {
        **os.environ,
        "KILN_REDIS_URL": storage_settings.redis_url,
        "KILN_REDIS_NAMESPACE": storage_settings.redis_namespace,
        "KILN_STORAGE_URL": storage_settings.storage_url,
        "KILN_PIPELINES": ",".join(api.settings.pipelines),
        "KILN_UPLOAD_MAX_BYTES": str(SETTINGS["upload_max_bytes"]),
    }
    for row in ROWS:
        if row.cli is None:
            continue
        args = [filled(arg.split("=", 1)[0], refs) + ("=" + filled(arg.split("=", 1)[1], refs)
                if "=" in arg else "") for arg in row.cli]  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "kiln.tasks.cli", "submit", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if row.expect == ACCEPTED:
            assert done.returncode == 0, (row.name, done.stderr)
            job = api.store.get(done.stdout.strip())
            assert job.request["prompt"] == row.body["prompt"]
            continue
        _, _, code, loc = row.expect
        where = ".".join(str(part) for part in loc)
        assert f"kiln: invalid job: {where}: " in done.stderr or (
            code == "unknown_pipeline" and done.stderr.startswith(f"kiln: {where}: ")
        ), (row.name, done.stderr)
        assert done.returncode == (1 if code == "unknown_pipeline" else 2), (row.name, done.stderr)


def test_the_batch_file_and_the_job_share_the_webhook_rule(make_api: ApiFactory) -> None:
    api = make_api(resolve=fake_dns(DNS), webhook_secret=None, **SETTINGS)
    announce(api)
    body = {**TINY, "webhook": {"url": "https://hooks.example/h"}}
    outcome = refused(422, "webhooks_disabled", "webhook", "url")
    assert through_api(api, body)[0] == outcome
    submitter = Submitter(api.store, api.settings, publish=lambda *_a, **_k: None)
    assert through_direct(Intake(submitter, api.ctx.objects), Caller(), body)[0] == outcome
    line = {**body, "custom_id": "hook"}
    whole = post_batch(api, jsonl([line]))
    assert whole.status_code == 422
    (error,) = [e for e in whole.json()["detail"] if e.get("line") == 1]
    assert (error["type"], error["loc"]) == (
        "webhooks_disabled",
        ["body", "line", 1, "webhook", "url"],
    )
    as_option = post_batch(
        api, jsonl([TINY | {"custom_id": "a"}]), webhook_url="https://hooks.example/h"
    )
    (error,) = as_option.json()["detail"]
    assert (error["type"], error["loc"]) == ("webhooks_disabled", ["query", "webhook_url"])


def written_at_once(
    api: Api, body: dict[str, Any], intake: Intake, caller: Caller
) -> list[tuple[int, str, str | None]]:
    """A 429 at the API and at the direct entrance: (status, message, Retry-After) of each."""
    answer = httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth("alice"))
    with pytest.raises(Refused) as direct:
        intake.submit(JobRequest.model_validate(body), caller)
    refusal = direct.value.refusal
    after = None if refusal.retry_after_s is None else str(refusal.retry_after_s)
    return [
        (answer.status_code, answer.json()["detail"], answer.headers.get("Retry-After")),
        (refusal.status, refusal.message, after),
    ]


def test_quota_and_admission_refuse_alike_and_a_batch_line_waits_instead(
    make_api: ApiFactory,
) -> None:
    capped = make_api(resolve=fake_dns(DNS), max_queued_per_key=1, **SETTINGS)
    announce(capped)
    submitter = Submitter(capped.store, capped.settings, publish=lambda *_a, **_k: None)
    intake, alice = Intake(submitter, capped.ctx.objects), Caller(capped.key_ids["alice"])
    assert through_api(capped, TINY)[0] == ACCEPTED  # alice's one queued job
    api_answer, direct_answer = written_at_once(capped, TINY, intake, alice)
    assert api_answer == direct_answer
    assert api_answer[:2] == (429, "this API key has 1 queued jobs, its maximum; retry later")
    # a line is not refused for the cap: the feeder feeds it once the key has room
    line = post_batch(capped, jsonl([{**TINY, "custom_id": "later"}]))
    assert (line.status_code, line.json()["counts"]["total"]) == (201, 1)

    busy = make_api(resolve=fake_dns(DNS), **SETTINGS)
    announce(busy)
    submitter = Submitter(busy.store, busy.settings, publish=lambda *_a, **_k: None)
    intake, alice = Intake(submitter, busy.ctx.objects), Caller(busy.key_ids["alice"])
    for _ in range(2):  # two runs just ended
        assert through_api(busy, TINY)[0] == ACCEPTED
    for record in busy.store.list_jobs(owner=alice.key_id, limit=10)[0]:
        drive_to_success(busy.store, record.id)
    for _ in range(40):  # 40 jobs ahead at the rate two runs just ended: a wait past 5 s
        assert through_api(busy, TINY)[0] == ACCEPTED
    late = {**TINY, "start_by": time.time() + 5}
    api_answer, direct_answer = written_at_once(busy, late, intake, alice)
    assert (api_answer[0], direct_answer[0]) == (429, 429)
    for _, message, retry_after in (api_answer, direct_answer):
        assert "start_by" in message
        assert "'tiny'" in message
        assert retry_after is not None
        assert int(retry_after) >= 1
    assert through_api(busy, {**late, "start_by": time.time() + 3600})[0] == ACCEPTED
    # a batch line is never refused for latency (its lane may wait)
    line = post_batch(busy, jsonl([{**late, "custom_id": "late"}]), priority="interactive")
    assert line.status_code == 201, line.text


def test_an_upload_without_an_object_store_is_a_503_not_a_field_error(api: Api) -> None:
    submitter = Submitter(api.store, api.settings, publish=lambda *_a, **_k: None)
    no_store = Intake(submitter, None)
    with KilnClient(api.url, api.keys["alice"]) as alice:
        ref = alice.upload(CAT).ref
    outcome = through_direct(no_store, Caller(api.key_ids["alice"]), img(ref))[0]
    assert outcome == refused(503, "object_store_unavailable", "inputs", "image")
    assert through_direct(no_store, Caller(), TINY)[0] == ACCEPTED  # nothing to look up
