"""Pause and resume one job: the one step the API, `kiln pause|resume` and a batch's pause take.

A pause moves a queued job to `paused` at once and asks a running one's node to stop it at its
next step (the job's stop request, which the node reads as it reads a cancel; it replaces a
pending priority preemption); the node takes a step checkpoint there and moves the job to
`paused` (tasks/node/attempt.py). A resume queues a paused job again at the back of its lane
and publishes it; its next attempt starts from its newest step checkpoint. A finished job is
refused (`PauseRefused`, the API's 409), and so is a pause of a running job whose cancel is
pending. docs/contract.md §4a is the user's account.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.common.states import JobState, is_terminal
from kiln.common.stops import StopReason
from kiln.storage.job_store import JobRecord, JobStore
from kiln.tasks.contract.responses import PauseEffect, ResumeEffect
from kiln.tasks.queue.submit import Submitter
from kiln.tasks.webhooks.event_sink import EventSink


class PauseRefused(Exception):
    """The job cannot be paused or resumed in the state it is in (the message says which)."""

    def __init__(self, record: JobRecord, action: str, why: str) -> None:
        super().__init__(f"job {record.id} is {record.state}: {why}; it cannot be {action}")
        self.record = record


@dataclass(frozen=True)
class JobPausing:
    """Pause and resume jobs: their transitions, the resumed job's message and their events."""

    store: JobStore
    submitter: Submitter
    events: EventSink

    def pause(self, record: JobRecord) -> tuple[PauseEffect, JobRecord]:
        """Pause the job `record` is (read by the caller, who checked its owner)."""
        if is_terminal(record.state):
            raise PauseRefused(record, "paused", "it has finished")
        if record.state == JobState.RUNNING and self.store.cancel_requested(record.id):
            raise PauseRefused(record, "paused", "its cancel is pending")
        after = self.store.pause(record.id)
        if after.state == JobState.RUNNING:
            return "pause_requested", after
        if after.state != JobState.PAUSED:  # it ended, or its cancel came, since it was read
            raise PauseRefused(after, "paused", "it changed meanwhile")
        if record.state == JobState.PAUSED:
            return "already_paused", after
        self.events.changed(after)  # `paused`: its listeners and webhooks
        return "paused", after

    def resume(self, record: JobRecord) -> tuple[ResumeEffect, JobRecord]:
        """Resume the job `record` is: queued again and published (a pending pause withdrawn)."""
        if is_terminal(record.state):
            raise PauseRefused(record, "resumed", "it has finished")
        asked = record.state == JobState.RUNNING and self._pause_pending(record.id)
        after = self.store.resume(record.id)
        if record.state != JobState.PAUSED or after.state != JobState.QUEUED:
            withdrawn = asked and after.state == JobState.RUNNING
            return ("pause_withdrawn" if withdrawn else "not_paused"), after
        self.submitter.publish(after)  # at the back of its lane; the sweeper retries a failure
        self.events.tell(after.id, "resumed", webhooks=True, record=after)
        return "resumed", after

    def _pause_pending(self, job_id: str) -> bool:
        request = self.store.stop_requested(job_id)
        return request is not None and request.reason == StopReason.PAUSED
