"""The end of a batch, for its feeder: winding down after a cancel, expiry or failure; the summary.

Winding down cancels (or expires) the batch's open queued jobs, cancels its running ones (cancel
only: an expired batch lets them finish; a failed one, whose input could not be read, lets its
open jobs run to their end) and ends the lines never fed as result lines of that reason, a chunk
per visit. Lines of an input that could not be read end all at once, without result lines (their
custom_ids cannot be read either): the counts and the batch's `error` say what became of them.
A line whose job exists although the cursor did not pass it (made by a feeder that died, or
refused by a cancel while being fed) ends as a job. Once every line has its result the summary is
written and the batch ends.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from celery import Celery

from kiln.storage.batch_feeding import FedWrite
from kiln.storage.batch_records import FedBatch
from kiln.storage.errors import IllegalTransition, StorageError
from kiln.storage.status import TERMINAL_STATES, JobState
from kiln.tasks.batches.lines import batch_job_id
from kiln.tasks.batches.reporting import FeederLostLease, Lease
from kiln.tasks.batches.results import summary_line, unfed_line
from kiln.tasks.batches.views import batch_view
from kiln.tasks.webhooks.enqueue import enqueue_webhook_events

if TYPE_CHECKING:
    from kiln.tasks.batches.feeder import BatchFeeder

log = logging.getLogger(__name__)


class WindDown:
    """Stops a batch's jobs and ends its lines; ends a batch whose every line has its result."""

    def __init__(self, feeder: BatchFeeder, app: Celery | None) -> None:
        self.feeder = feeder
        self.app = app  # the Celery app job webhooks go out through (None: the current one)

    def wind_down(self, batch: FedBatch, lease: Lease) -> None:
        """Stop the open jobs, then end the next chunk of unfed lines (fenced)."""
        f = self.feeder
        reason = batch.stop or "canceled"
        if reason != "failed":  # a failed batch's open jobs run to their end
            self._stop_open_jobs(batch.id, reason)
        if batch.unfed <= 0:
            return
        if batch.error is not None:  # the input could not be read: nothing more will be
            self._end_unreadable(batch, lease, reason)
            return
        read = f.read_input(batch, min(f.settings.batch_feed_chunk, batch.unfed))
        if read is None or not read[0]:
            return
        items, ends = read
        offset = ends[-1]
        ids = [batch_job_id(batch.id, item.custom_id) for item in items]
        states = f.feeding.job_states(ids)
        opened: list[tuple[str, int]] = []
        ended: list[bytes] = []
        for job_id, item, state in zip(ids, items, states, strict=True):
            if state is None:
                ended.append(unfed_line(item.line, item.custom_id, reason))
            else:  # made by a feeder that died or was stopped before moving the cursor
                opened.append((job_id, item.line))
                if state in (JobState.QUEUED, JobState.RUNNING):
                    self._stop_job(job_id, reason)
        part = f.results.put_part(batch, lease, b"".join(ended), "unfed") if ended else ""
        cursor = (batch.fed + len(items), offset)
        ending = (len(ended), reason, part)
        if f.feeding.record_fed(batch.id, lease, batch.fed, cursor, opened, ending) is not (
            FedWrite.applied
        ):
            if part:
                f.results.drop(part)
            raise FeederLostLease(batch.id)

    def _stop_open_jobs(self, batch_id: str, reason: str) -> None:
        feeding = self.feeder.feeding
        open_ids = [job_id for job_id, _ in feeding.open_items(batch_id)]
        for job_id, state in zip(open_ids, feeding.job_states(open_ids), strict=True):
            if state in (JobState.QUEUED, JobState.RUNNING):
                self._stop_job(job_id, reason)

    def _end_unreadable(self, batch: FedBatch, lease: Lease, reason: str) -> None:
        """End every line not fed yet under `reason`, without result lines (fenced)."""
        cursor = (batch.items, batch.offset)
        ending = (batch.unfed, reason, "")
        written = self.feeder.feeding.record_fed(batch.id, lease, batch.fed, cursor, [], ending)
        if written is not FedWrite.applied:
            raise FeederLostLease(batch.id)
        log.info("batch %s: %d unread lines ended (%s)", batch.id, batch.unfed, reason)

    def _stop_job(self, job_id: str, reason: str) -> None:
        store = self.feeder.store
        try:
            # cancel: queued ones at once, running ones at their next step; expiry: queued only
            # (running jobs may finish)
            stop = store.cancel if reason == "canceled" else store.expire
            after = stop(job_id)
        except IllegalTransition:
            return
        except StorageError as exc:
            log.info("batch job %s: could not stop it (%s)", job_id, exc)
            return
        if after.state in TERMINAL_STATES and after.request.get("webhook"):
            event = str(after.state)
            enqueue_webhook_events(store, job_id, event, record=after, app=self.app)

    def finish_if_done(self, batch: FedBatch, lease: Lease) -> bool:
        """End the batch if every line has its result (summary, status, webhook); True if so."""
        f = self.feeder
        if batch.fed < batch.items or f.feeding.open_items(batch.id):
            return False
        status = batch.stop or "completed"
        ended = dataclasses.replace(batch, status=status, finished_at=time.time())
        part = f.results.put_part(batch, lease, summary_line(batch_view(ended)), "summary")
        if not f.feeding.finish_fed(batch.id, lease, status, part):
            f.results.drop(part)
            raise FeederLostLease(batch.id)
        log.info("batch %s %s", batch.id, status)
        f.notifier.finished(f.batches.get_fed(batch.id))
        return True
