"""The job contract: every range check names its field, per-format rules, fingerprints, views."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from kiln.common.request import Lane
from kiln.common.states import JobState
from kiln.storage.job_store import request_fingerprint
from kiln.storage.records import JobRecord
from kiln.tasks.contract.schemas import JobRequest, WebhookSpec
from kiln.tasks.contract.views import JobView, job_view


def error_fields(body: dict[str, Any]) -> set[str]:
    """Fields named by the validation errors of a request body."""
    with pytest.raises(ValidationError) as caught:
        JobRequest.model_validate(body)
    return {".".join(str(p) for p in e["loc"]) for e in caught.value.errors()}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt", ""),
        ("prompt", "x" * 4001),
        ("negative_prompt", "x" * 4001),
        ("width", 63),
        ("width", 4104),
        ("width", 100),  # not a multiple of 8
        ("height", 56),
        ("num_frames", 0),
        ("fps", 0),
        ("steps", 0),
        ("steps", 501),
        ("guidance_scale", -0.1),
        ("guidance_scale", 50.5),
        ("guidance_scale", float("nan")),
        ("seed", -1),
        ("num_outputs", 0),
        ("num_outputs", 17),
        ("output_format", "bmp"),
        ("priority", "urgent"),
        ("start_by", 0),
        ("max_run_seconds", 0),
        ("pipeline", "../etc"),
        ("metadata", {f"k{i}": "v" for i in range(17)}),
        ("metadata", {"k": "v" * 513}),
        ("metadata", {"": "v"}),
        ("surprise", 1),
    ],
)
def test_out_of_range_fields_are_named(field: str, value: Any) -> None:
    named = error_fields({"prompt": "p", field: value})
    assert named
    assert all(name.split(".")[0] == field for name in named)


NUMBER_FIELDS = [
    "width",
    "height",
    "num_frames",
    "fps",
    "steps",
    "guidance_scale",
    "seed",
    "num_outputs",
    "start_by",
    "max_run_seconds",
]


@pytest.mark.parametrize("field", NUMBER_FIELDS)
@pytest.mark.parametrize("value", [True, False, "64"])
def test_numbers_are_not_booleans_or_strings(field: str, value: Any) -> None:
    # pydantic's lax mode would take JSON true as 1 and "64" as 64: a client bug passed as valid
    with pytest.raises(ValidationError) as caught:
        JobRequest.model_validate_json(json.dumps({"prompt": "p", field: value}))
    assert caught.value.errors()[0]["loc"] == (field,)


def test_formats_follow_frames() -> None:
    assert JobRequest(prompt="p").output_format == "png"
    assert JobRequest(prompt="p", num_frames=8).output_format == "mp4"
    for image_format in ("png", "jpeg", "webp"):
        assert JobRequest(prompt="p", output_format=image_format).output_format == image_format
    for video_format in ("mp4", "webm", "gif"):
        request = JobRequest(prompt="p", num_frames=2, output_format=video_format)
        assert request.output_format == video_format
        assert request.is_video
    assert error_fields({"prompt": "p", "num_frames": 4, "output_format": "png"}) == {
        "output_format"
    }
    assert error_fields({"prompt": "p", "output_format": "mp4"}) == {"output_format"}


def test_webhook_spec_rules() -> None:
    assert WebhookSpec(url="https://example.com/h").events == ["completed"]
    assert error_fields({"prompt": "p", "webhook": {"url": "https://x", "events": []}}) == {
        "webhook.events"
    }
    bad = {"url": "https://x", "events": ["completed", "completed"]}
    assert error_fields({"prompt": "p", "webhook": bad}) == {"webhook.events"}
    unknown = {"url": "https://x", "events": ["finished"]}
    assert error_fields({"prompt": "p", "webhook": unknown}) == {"webhook.events.0"}


def fingerprint(request: JobRequest) -> str:
    """The idempotency fingerprint the Submitter binds: storage's, of the request as sent."""
    return request_fingerprint(request.to_record())


def test_fingerprint_is_canonical() -> None:
    explicit = JobRequest(prompt="p", width=512, steps=25, priority=Lane.interactive)
    implicit = JobRequest.model_validate({"steps": 25, "prompt": "p"})
    assert fingerprint(explicit) == fingerprint(implicit)
    assert fingerprint(JobRequest(prompt="p", seed=1)) != fingerprint(JobRequest(prompt="p"))
    assert len(fingerprint(explicit)) == 64


def test_job_view_from_record_presigns_outputs() -> None:
    class Urls:
        prefix = ""

        def url(self, key: str, expires_s: int | None = None) -> str:
            del expires_s  # the ObjectStore signature
            return f"https://signed.example/{key}?sig=now"

    request = JobRequest(prompt="p", seed=7, metadata={"a": "b"}).to_record()
    record = JobRecord(
        id="j1",
        state=JobState.SUCCEEDED,
        request=request,
        lane="interactive",
        owner=None,
        created_at=1.0,
        started_at=2.0,
        finished_at=3.0,
        attempts=1,
        progress={"stage": "uploading", "step": 25, "total": 25},
        outputs=[
            {
                "key": "out/j1/0.png",
                "content_type": "image/png",
                "bytes": 5,
                "sha256": "00",
                "width": 512,
                "height": 512,
                "frames": 1,
            }
        ],
        error=None,
        metrics={"run_s": 1.5, "batch_size": 2},
        batch_id=None,
        metadata={"a": "b"},
        published=True,
    )
    view = job_view(record, Urls())  # type: ignore[arg-type]
    assert isinstance(view, JobView)
    assert view.outputs[0].url == "https://signed.example/out/j1/0.png?sig=now"
    assert view.parameters.seed == 7
    assert view.metadata == {"a": "b"}
    assert view.metrics.run_s == 1.5
    assert view.model_dump()["metrics"]["batch_size"] == 2
