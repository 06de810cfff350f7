"""Uploads: encoding options and storage retries.

The encoding options come from the job record (the contract's defaults, never the node's own);
a retryable storage error is retried on the doubling curve until the deadline.
"""

from __future__ import annotations

import time

import pytest

from kiln.gpu_worker.outputs import OutputSpec
from kiln.storage.errors import ObjectNotFound, ObjectStoreUnavailable
from kiln.tasks.contract.job_spec import JobSpec
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.node.output_uploads import output_spec, retry_storage


def test_a_video_is_encoded_at_the_recorded_fps_and_format() -> None:
    spec = JobSpec(prompt="waves", num_frames=5, fps=12, output_format="gif", seed=1)
    assert output_spec(spec) == OutputSpec(format="gif", fps=12)


def test_a_request_without_fps_or_format_gets_the_contracts_defaults() -> None:
    video = JobSpec.of(JobRequest(prompt="waves", num_frames=5, seed=1))
    image = JobSpec.of(JobRequest(prompt="a fox", seed=1))
    defaults = JobSpec.model_fields["fps"].default
    assert output_spec(video) == OutputSpec(format="mp4", fps=defaults)
    assert output_spec(image).format == "png"
    assert output_spec(video).quality is None  # the contract has no quality: each codec's own


def test_storage_retries_pause_on_the_doubling_curve(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("kiln.tasks.node.output_uploads.time.sleep", slept.append)
    failures = iter(range(7))
    retried: list[None] = []

    def flaky() -> str:
        if next(failures, None) is not None:
            raise ObjectStoreUnavailable("down")
        return "sha"

    deadline = time.monotonic() + 3600
    assert retry_storage(flaky, deadline=deadline, on_retry=lambda: retried.append(None)) == "sha"
    assert slept == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert len(retried) == 7


def test_storage_retries_stop_at_the_deadline_and_on_a_permanent_error() -> None:
    def down() -> str:
        raise ObjectStoreUnavailable("down")

    def missing() -> str:
        raise ObjectNotFound("gone")

    with pytest.raises(ObjectStoreUnavailable):
        retry_storage(down, deadline=time.monotonic() + 0.1)  # the first pause would pass it
    with pytest.raises(ObjectNotFound):
        retry_storage(missing, deadline=time.monotonic() + 3600)
