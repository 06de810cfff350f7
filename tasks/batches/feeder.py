"""The batch feeder: jobs created and published only as capacity frees up, results as they finish.

Every node runs one (`node.maintenance`), and the feeder lease makes one the feeder of each batch
at a time.

One pass (`tick`) visits the active batches round-robin (each pass starts one batch further on),
and for each batch whose lease it holds or can take:

1. writes the result lines of its finished jobs as one part (at least every
   `batch_results_flush_s`), then drops them from the open set;
2. if the batch is running: reads the next lines from the stored input at the cursor and creates
   and publishes their jobs, at most `batch_window` of the batch's jobs queued or running and at
   most `batch_feed_chunk` lines per visit, then moves the cursor;
3. if it was canceled or its completion window ran out: cancels (expires) its open queued jobs,
   cancels its running ones (cancel only) and ends unfed lines as result lines of that reason;
4. once every line has its result: writes the summary and ends the batch.

Exactly once per line: a line's job id is derived from the batch and its custom_id, and the cursor
moves (fenced by the lease token, and only from where it was read) after the jobs exist. A feeder
that dies between creating and moving the cursor leaves jobs that the next feeder creates again as
a no-op (and publishes if their publish was never confirmed); one that lost its lease moves
nothing. The lease lapses `KILN_LEASE_TTL_S` after its holder stops renewing it (each visit
renews it), so another node takes over within that.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid

from celery import Celery

from kiln.storage.batch_store import BatchStore, FedBatch
from kiln.storage.errors import IllegalTransition, StorageError
from kiln.storage.object_streams import batch_object_key, read_range
from kiln.storage.objects import ObjectStore
from kiln.storage.status import TERMINAL_STATES, JobState, JobStore, NewJob
from kiln.tasks.batches.lines import Item, batch_job_id, custom_id_of, parse_item
from kiln.tasks.batches.results import (
    RESULTS_CONTENT_TYPE,
    job_line,
    summary_line,
    unfed_line,
)
from kiln.tasks.batches.views import batch_view
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.lanes import queue_name
from kiln.tasks.queue.submit import Submitter
from kiln.tasks.webhooks.enqueue import enqueue_webhook_events

log = logging.getLogger(__name__)

READ_SIZE = 256 * 1024
Lease = tuple[int, str]


class FeederLostLease(Exception):
    """A fenced write was refused: another feeder holds the batch now."""


class BatchFeeder:
    """Feeds every active batch whose feeder lease this process holds (or takes)."""

    def __init__(
        self,
        store: JobStore,
        objects: ObjectStore,
        submitter: Submitter,
        settings: KilnSettings,
        owner: str,
        app: Celery | None = None,
    ) -> None:
        self.store = store
        self.batches = BatchStore(store.redis, store.settings)
        self.objects = objects
        self.submitter = submitter
        self.settings = settings
        self.owner = owner
        self.app = app  # the Celery app job webhooks go out through (None: the current one)
        self._turn = 0
        self._flushed_at: dict[str, float] = {}

    # --- the pass ----------------------------------------------------------------------------
    def tick(self) -> int:
        """Visit the active batches once, round-robin; returns how many this feeder stepped."""
        ids = self.batches.active_batch_ids()
        if not ids:
            return 0
        start = self._turn % len(ids)
        self._turn += 1
        active = set(ids)
        self._flushed_at = {b: t for b, t in self._flushed_at.items() if b in active}
        stepped = 0
        for batch_id in ids[start:] + ids[:start]:
            try:
                stepped += self._visit(batch_id)
            except FeederLostLease:
                log.info("batch %s: feeder lease lost to another node", batch_id)
            except StorageError as exc:
                log.warning("batch %s: storage error (%s); will retry", batch_id, exc)
            except Exception:  # one bad batch must not stop the others
                log.exception("batch %s: feeding failed; will retry", batch_id)
        return stepped

    def _visit(self, batch_id: str) -> int:
        token = self.batches.take_feeder(batch_id, self.owner)
        if token == -1:
            if self.batches.get_fed_many([batch_id])[0] is None:
                self.batches.drop_active(batch_id)  # its record expired: nothing left to do
            return 0
        if token == 0:
            return 0
        self.step(batch_id, (token, self.owner))
        return 1

    def step(self, batch_id: str, lease: Lease) -> None:
        """One visit of one batch under `lease`: results, then feeding or winding down, then end."""
        batch = self.batches.get_fed(batch_id)
        if batch.final:
            return
        self._report(batch, lease)
        if batch.stop is None and time.time() > batch.deadline:
            self.batches.stop_batch(batch_id, "expired")
            log.info("batch %s: completion window ended; expiring what is left", batch_id)
        batch = self.batches.get_fed(batch_id)
        if batch.stop is not None:
            self._wind_down(batch, lease)
        else:
            self._feed(batch, lease)
        self._finish_if_done(self.batches.get_fed(batch_id), lease)

    # --- feeding -----------------------------------------------------------------------------
    def _feed(self, batch: FedBatch, lease: Lease) -> None:
        live = batch.counts[JobState.QUEUED] + batch.counts[JobState.RUNNING]
        room = min(self.settings.batch_window - live, self.settings.batch_feed_chunk, batch.unfed)
        if room <= 0:
            return
        items, offset = self._read_items(batch, room)
        if not items:
            return
        news = [self._new_job(batch, item) for item in items]
        self.store.create_jobs(news)  # existing ids (a line fed before a crash) are skipped
        self._publish_unconfirmed([new.id for new in news])
        opened = [(new.id, item.line) for new, item in zip(news, items, strict=True)]
        cursor = (batch.fed + len(items), offset)
        if not self.batches.record_fed(batch.id, lease, batch.fed, cursor, opened):
            raise FeederLostLease(batch.id)

    def _new_job(self, batch: FedBatch, item: Item) -> NewJob:
        request = item.request
        lane = str(request.get("priority", batch.priority))
        return NewJob(
            id=batch_job_id(batch.id, item.custom_id),
            request=request,
            batch_id=batch.id,
            metadata=dict(request.get("metadata") or {}),
            owner=batch.owner,
            lane=lane,
            queue=queue_name(lane, str(request.get("pipeline", "default"))),
        )

    def _publish_unconfirmed(self, job_ids: list[str]) -> None:
        for record in self.store.get_many(job_ids):
            if record is not None and record.state == JobState.QUEUED and not record.published:
                self.submitter.publish(record)

    def _read_items(self, batch: FedBatch, count: int) -> tuple[list[Item], int]:
        """Up to `count` items from the cursor on, and the byte offset after the last one."""
        items: list[Item] = []
        offset = position = batch.offset
        pending = b""
        while len(items) < count:
            chunk = read_range(self.objects, batch.input_key, position, READ_SIZE)
            if not chunk:
                break
            position += len(chunk)
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            for raw in lines:
                if len(items) == count:
                    break
                offset += len(raw) + 1
                if raw.strip():
                    items.append(parse_item(raw))
        return items, offset

    # --- results -----------------------------------------------------------------------------
    def _report(self, batch: FedBatch, lease: Lease) -> None:
        open_items = self.batches.open_items(batch.id)
        if not open_items:
            return
        due = time.monotonic() - self._flushed_at.get(batch.id, 0.0)
        if batch.status == "running" and due < self.settings.batch_results_flush_s:
            return
        states = self.batches.job_states([job_id for job_id, _ in open_items])
        done = [
            (job_id, line)
            for (job_id, line), state in zip(open_items, states, strict=True)
            if state is None or state in TERMINAL_STATES
        ]
        if not done:
            return
        records = self.store.get_many([job_id for job_id, _ in done])
        data = b"".join(
            job_line(line, custom_id_of(batch.id, job_id), job_id, record, self.objects)
            for (job_id, line), record in zip(done, records, strict=True)
        )
        part = self._put_part(batch, lease, data)
        if not self.batches.record_reported(batch.id, lease, part, [j for j, _ in done]):
            self._drop(part)
            raise FeederLostLease(batch.id)
        self._flushed_at[batch.id] = time.monotonic()

    def _put_part(self, batch: FedBatch, lease: Lease, data: bytes, name: str = "part") -> str:
        # named by the lease token and a nonce: a part a stale feeder writes late never replaces
        # a committed one; only the parts listed in Redis are results
        token, _ = lease
        nonce = uuid.uuid4().hex[:8]
        key = batch_object_key(
            self.objects.prefix, batch.id, "results", f"{name}-{token}-{nonce}.jsonl"
        )
        self.objects.put(key, data, RESULTS_CONTENT_TYPE)
        return key

    def _drop(self, key: str) -> None:
        try:
            self.objects.delete(key)
        except StorageError as exc:  # an orphan part is never listed: harmless
            log.info("could not delete orphan result part %s: %s", key, exc)

    # --- cancel and expiry -------------------------------------------------------------------
    def _wind_down(self, batch: FedBatch, lease: Lease) -> None:
        reason = batch.stop or "canceled"
        open_ids = [job_id for job_id, _ in self.batches.open_items(batch.id)]
        for job_id, state in zip(open_ids, self.batches.job_states(open_ids), strict=True):
            if state in (JobState.QUEUED, JobState.RUNNING):
                self._stop_job(job_id, reason)
        if batch.unfed <= 0:
            return
        items, offset = self._read_items(batch, min(self.settings.batch_feed_chunk, batch.unfed))
        if not items:
            return
        ids = [batch_job_id(batch.id, item.custom_id) for item in items]
        states = self.batches.job_states(ids)
        opened: list[tuple[str, int]] = []
        ended: list[bytes] = []
        for job_id, item, state in zip(ids, items, states, strict=True):
            if state is None:
                ended.append(unfed_line(item.line, item.custom_id, reason))
            else:  # made by a feeder that died before moving the cursor: it ends as a job
                opened.append((job_id, item.line))
                if state in (JobState.QUEUED, JobState.RUNNING):
                    self._stop_job(job_id, reason)
        part = self._put_part(batch, lease, b"".join(ended), "unfed") if ended else ""
        cursor = (batch.fed + len(items), offset)
        if not self.batches.record_fed(
            batch.id, lease, batch.fed, cursor, opened, (len(ended), reason, part)
        ):
            if part:
                self._drop(part)
            raise FeederLostLease(batch.id)

    def _stop_job(self, job_id: str, reason: str) -> None:
        try:
            # cancel: queued ones at once, running ones at their next step; expiry: queued only
            # (running jobs may finish)
            stop = self.store.cancel if reason == "canceled" else self.store.expire
            after = stop(job_id)
        except IllegalTransition:
            return
        except StorageError as exc:
            log.info("batch job %s: could not stop it (%s)", job_id, exc)
            return
        if after.state in TERMINAL_STATES and after.request.get("webhook"):
            event = str(after.state)
            enqueue_webhook_events(self.store, job_id, event, record=after, app=self.app)

    # --- the end -----------------------------------------------------------------------------
    def _finish_if_done(self, batch: FedBatch, lease: Lease) -> None:
        if batch.fed < batch.items or self.batches.open_items(batch.id):
            return
        status = batch.stop or "completed"
        ended = dataclasses.replace(batch, status=status, finished_at=time.time())
        part = self._put_part(batch, lease, summary_line(batch_view(ended)), "summary")
        if not self.batches.finish_fed(batch.id, lease, status, part):
            self._drop(part)
            raise FeederLostLease(batch.id)
        self._flushed_at.pop(batch.id, None)
        log.info("batch %s %s", batch.id, status)
