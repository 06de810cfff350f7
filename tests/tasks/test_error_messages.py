"""A job's `error.message` is one line without a traceback or a server path.

The ranks' traceback reaches the coordinator as text (`gpu_worker.failures`): the job gets the
exception raised, the node's log the whole traceback; `error_dict` makes any message one line.
"""

from __future__ import annotations

import logging
import traceback

import pytest

from kiln.gpu_worker.errors import JobFailed, WorkerGroupDied
from kiln.gpu_worker.failures import failure_error
from kiln.gpu_worker.protocol import FailureKind, GenerationRequest
from kiln.tasks.queue.policy import error_dict, public_message


def _traceback_text() -> str:
    try:
        import torch

        torch.zeros(0).reshape(-1, 0)
    except RuntimeError as exc:
        return "".join(traceback.format_exception(exc))
    raise AssertionError("torch reshaped a tensor of 0 elements")


def test_a_failed_forward_fails_the_job_with_the_exception_and_logs_the_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    text = _traceback_text()
    assert "Traceback" in text
    assert 'File "/' in text
    request = GenerationRequest("j", "img", "a", 64, 64, 1, 0, guidance_scale=5.0)
    with caplog.at_level(logging.WARNING, logger="kiln.gpu_worker.failures"):
        failure = failure_error(FailureKind.ERROR, text, request)
    assert isinstance(failure, JobFailed)
    message = error_dict(failure)["message"]
    assert message.startswith("the pipeline failed: RuntimeError: cannot reshape tensor of 0")
    assert "\n" not in message
    assert "Traceback" not in message
    assert "File " not in message
    assert text in caplog.text  # the node keeps the whole traceback
    broke = failure_error(FailureKind.COLLECTIVE, text, request)
    assert isinstance(broke, WorkerGroupDied)
    assert "\n" not in str(broke)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "the worker group died: rank 1 exited\nrank 1: boom",
            "the worker group died: rank 1 exited rank 1: boom",
        ),
        (
            "storage error: [Errno 2] No such file: '/srv/kiln/outputs/ab/0.png'",
            "storage error: [Errno 2] No such file: '0.png'",
        ),
        (
            "could not fetch https://example.com/img/a.png (404); key batches/b1/input.jsonl",
            "could not fetch https://example.com/img/a.png (404); key batches/b1/input.jsonl",
        ),
        (
            'failed:\nTraceback (most recent call last):\n  File "/usr/lib/x.py", line 3, in f\n'
            "    g()\nValueError: in /home/kiln/.cache/models/sd/unet.bin",
            "failed: ValueError: in unet.bin",
        ),
    ],
)
def test_public_messages_are_one_line_without_server_paths(text: str, expected: str) -> None:
    assert public_message(text) == expected


def test_a_long_message_is_cut() -> None:
    assert len(public_message("x" * 5000)) == 1000
