"""`run_job` messages built by Celery itself, for the job's creation script to push.

Publishing through kombu costs each job another Redis round trip after its record is written
(and one more to mark it published), and a window in which the record exists
but its message does not (closed later by the sweeper). `CeleryMessages` instead lets Celery
build the message exactly as `send_task` would (headers, properties, body encoding, priority
and the list key the Redis transport would push to), but on a channel whose `_put` hands the
serialized message back instead of sending it (tasks/queue/kombu_redis.py `PushCapture`): the
creation script (storage/lua/create.lua) then pushes it in the same step that writes the
record. Workers see the very message kombu would have sent (tests/tasks/test_submit_messages.py
runs a real `celery worker` on them).

Only where the broker is the Redis that holds Kiln's records and task events are off: otherwise
the ordinary publish (`usable_for`).
"""

from __future__ import annotations

import base64
import json
import re
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from celery import Celery

from kiln.common.tracing import TRACEPARENT
from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.app import RUN_JOB_TASK
from kiln.tasks.queue.kombu_redis import PushCapture, envelope_parts


class CeleryMessages:
    """Builds `kiln.run_job` messages: (Redis list key, message) as kombu would push them.

    Celery builds each queue's message once (`celery_built`, a placeholder job and task id);
    every job's message is that one with its own ids put in: letting Celery build every message
    costs ~300 us of CPU per job, a third of the API's whole budget at 1,000 jobs/s. What
    depends on the job is the task id (header `id` and `root_id`, property `correlation_id`),
    the argument (the base64 JSON body and header `argsrepr`) and kombu's delivery tag;
    tests/tasks/test_submit_messages.py holds the result equal to Celery's own message.
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._capture = PushCapture(app)
        self._lock = threading.Lock()  # a kombu channel is one thread's at a time
        # by queue, and whether its messages carry a `traceparent` header
        self._templates: dict[tuple[str, bool], _Template] = {}

    @staticmethod
    def usable_for(settings: KilnSettings, storage_settings: StorageSettings) -> bool:
        """Whether jobs' messages may go with their records (else kombu publishes them).

        The broker must be the Redis that holds the records, and task events off: a producer
        sends each message's `task-sent` event for Flower, which only Celery's publish does.
        """
        same_redis = settings.broker_url in (None, "", storage_settings.redis_url)
        return same_redis and not settings.task_events

    def run_job(
        self,
        job_id: str,
        queue: str,
        task_id: str | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> tuple[str, str]:
        """The list key and serialized message of `run_job(job_id)` on `queue`, sent now.

        `trace`: the job's W3C carrier, sent as the message's `traceparent` (and `tracestate`)
        headers, which the node's delivery continues (kiln/common/tracing.py).
        """
        task_id = task_id or str(uuid.uuid4())
        traceparent = (trace or {}).get(TRACEPARENT)
        if not _PLAIN_ID.fullmatch(job_id) or (trace and not _templated_trace(trace)):
            return self.celery_built(job_id, queue, task_id, headers=dict(trace or {}))
        traced = traceparent is not None
        template = self._templates.get((queue, traced))
        if template is None:
            headers = {TRACEPARENT: _PLACEHOLDER_TRACE} if traced else {}
            template = self._templates[(queue, traced)] = _Template.of(
                self.celery_built(_PLACEHOLDER_JOB, queue, _PLACEHOLDER_TASK, headers=headers),
                traced=traced,
            )
        return template.key, template.fill(job_id, task_id, traceparent)

    def is_ready(self, job_id: str, queue: str, trace: Mapping[str, str] | None = None) -> bool:
        """Whether `run_job(job_id, queue, trace=trace)` is built from a template (no broker)."""
        if trace and not _templated_trace(trace):
            return False
        traced = bool(trace)
        return (queue, traced) in self._templates and _PLAIN_ID.fullmatch(job_id) is not None

    def celery_built(
        self,
        job_id: str,
        queue: str,
        task_id: str,
        countdown: float = 0.0,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[str, str]:
        """The message as Celery's `send_task` builds it, captured before it is pushed."""
        with self._lock:
            try:
                self.app.send_task(
                    RUN_JOB_TASK,
                    args=[job_id],
                    task_id=task_id,
                    queue=queue,
                    countdown=countdown or None,
                    headers=dict(headers or {}) or None,
                    producer=self._capture.producer(),
                )
            finally:
                captured = self._capture.take()
        (message,) = captured  # the queue's own exchange routes to it alone
        return message

    def close(self) -> None:
        """Release the channel's Redis connections."""
        self._capture.close()


# job ids the template takes as they are: nothing in them needs escaping in JSON or a repr
_PLAIN_ID = re.compile(r"[0-9A-Za-z_-]{1,128}")
_PLACEHOLDER_JOB = "kilnjobplaceholder"
_PLACEHOLDER_TASK = "00000000-0000-4000-8000-00000000cafe"
_PLACEHOLDER_TRACE = "kilntraceparentplaceholder"


def _templated_trace(trace: Mapping[str, str]) -> bool:
    """Whether a template takes this carrier: a `traceparent` alone, nothing to escape in it."""
    traceparent = trace.get(TRACEPARENT)
    return (
        set(trace) == {TRACEPARENT}
        and traceparent is not None
        and bool(_PLAIN_TRACE.fullmatch(traceparent))
    )


_PLAIN_TRACE = re.compile(r"[0-9a-f-]{1,128}")


@dataclass(frozen=True)
class _Template:
    """One queue's Celery-built message with the placeholders' positions known."""

    key: str
    message: str  # serialized, with _PLACEHOLDER_TASK, _PLACEHOLDER_JOB (argsrepr) and the tag
    body_json: str  # the decoded body, with _PLACEHOLDER_JOB as the one argument
    body: str  # as it stands in `message` (base64)
    delivery_tag: str

    @classmethod
    def of(cls, built: tuple[str, str], traced: bool = False) -> _Template:
        key, message = built
        body, tag = envelope_parts(json.loads(message))
        # where each placeholder stands must be unambiguous, else a fill would put ids elsewhere
        expected = {_PLACEHOLDER_TASK: 3, _PLACEHOLDER_JOB: 1, body: 1, tag: 1}
        if traced:
            expected[_PLACEHOLDER_TRACE] = 1
        found = {text: message.count(text) for text in expected}
        if found != expected:
            raise ValueError(f"unexpected Celery message layout: {found} != {expected}")
        body_json = base64.b64decode(body).decode()
        if body_json.count(f'"{_PLACEHOLDER_JOB}"') != 1:
            raise ValueError("unexpected Celery message body")
        return cls(key, message, body_json, body, tag)

    def fill(self, job_id: str, task_id: str, traceparent: str | None = None) -> str:
        body_json = self.body_json.replace(f'"{_PLACEHOLDER_JOB}"', f'"{job_id}"')
        body = base64.b64encode(body_json.encode()).decode()
        message = self.message
        if traceparent is not None:
            message = message.replace(_PLACEHOLDER_TRACE, traceparent)
        return (
            message.replace(_PLACEHOLDER_TASK, task_id)
            .replace(self.body, body)
            .replace(self.delivery_tag, str(uuid.uuid4()))
            .replace(_PLACEHOLDER_JOB, job_id)
        )
