"""The batch feeder: jobs created and published only as capacity frees up, results as they finish.

Every node runs one (tasks/control/room.py), or `kiln control` does, and the feeder lease makes
one the feeder of each batch at a time.

One pass (`tick`) plans its visits (`fairness`: API keys round-robin, each key's window shared
between its batches, the window sized from the live nodes and from how fast the batches' jobs
finish between two passes, `fairness.Pace`) and, for each batch whose lease it holds or can take:

1. writes the result lines of its finished jobs as one part (at least every
   `batch_results_flush_s`), then drops them from the open set (`reporting`);
2. if the batch is running: reads the next lines from the stored input at the cursor and creates
   its jobs within its budget (at most `batch_feed_chunk` lines per visit, and no more than its
   owner's queued cap leaves room for: the lines wait, none is refused), moves the cursor, and
   only then publishes them; a paused batch feeds nothing;
3. if it was canceled, its completion window ran out or its input could not be read: winds it
   down (below);
4. once every line has its result: writes the summary and ends the batch; batch webhooks go out
   (`notify`).

Winding down cancels (or expires) the batch's open queued jobs, cancels its running ones (cancel
only: an expired batch lets them finish; a failed one, whose input could not be read, lets its
open jobs run to their end) and ends the lines never fed as result lines of that reason, a chunk
per visit. Lines of an input that could not be read end all at once, without result lines (their
custom_ids cannot be read either): the counts and the batch's `error` say what became of them.
A line whose job exists although the cursor did not pass it (made by a feeder that died, or
refused by a cancel while being fed) ends as a job. Once every line has its result the summary is
written and the batch ends.

Exactly once per line: a line's job id is derived from the batch and its custom_id, and the cursor
moves (fenced by the lease token, and only from where it was read) after the jobs exist. A feeder
that dies between creating and moving the cursor leaves jobs that the next feeder creates again as
a no-op (and publishes); one that dies after moving it leaves unpublished jobs that the sweeper
publishes. A cancel that lands while a chunk is being fed refuses the cursor move, so those jobs
are never published: the wind-down finds and ends them. One that lost its lease moves nothing.
The lease lapses `KILN_LEASE_TTL_S` after its holder stops renewing it (each visit renews it), so
another node takes over within that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

from celery import Celery

from kiln.common.states import TERMINAL_STATES, JobState
from kiln.storage.apikeys import ApiKeyStore
from kiln.storage.batch_records import BatchConflict, FedBatch
from kiln.storage.batch_store import BatchFeeding, BatchStore, FedWrite
from kiln.storage.errors import (
    IllegalTransition,
    ObjectStoreError,
    QuotaExceeded,
    StorageError,
)
from kiln.storage.job_store import JobStore, NewJob
from kiln.storage.object_streams import read_range
from kiln.storage.objects import ObjectStore, StoresByUrl
from kiln.tasks.batches.fairness import Pace, capacities, plan_pass, window_size
from kiln.tasks.batches.intake import Item, batch_job_id, parse_item
from kiln.tasks.batches.notify import BatchNotifier
from kiln.tasks.batches.reporting import FeederLostLease, Lease, ResultWriter
from kiln.tasks.batches.results import summary_line, unfed_line
from kiln.tasks.batches.views import batch_view
from kiln.tasks.contract.job_spec import JobSpecRefused
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.intake.intake import line_job, line_trace
from kiln.tasks.queue.policy import public_message
from kiln.tasks.queue.quotas import QueuedCaps
from kiln.tasks.queue.submit import Submitter
from kiln.tasks.webhooks.event_sink import EventSink

log = logging.getLogger(__name__)

READ_SIZE = 256 * 1024
# The live nodes' capacities, read from every heartbeat by one process per heartbeat interval for
# all feeders (storage/backlog.py `shared_view`): each of n feeders reading n heartbeats every
# pass would cost the cluster n² reads per pass while any batch is active.
CAPACITY_VIEW = "feeding:capacity"


# a fed line's job that a batch's stop ends: a paused one too, or the batch would wait for it
_OPEN_STATES = frozenset({JobState.QUEUED, JobState.RUNNING, JobState.PAUSED})


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
        self.feeding = BatchFeeding(store.redis, store.settings)
        self.objects = objects
        # a batch's input and results live in the store its record names
        self.stores = StoresByUrl(objects, store.settings)
        self.submitter = submitter
        self.settings = settings
        self.owner = owner
        # the Celery app job and batch webhooks go out through (None: the current one)
        self.app = app
        self.events = EventSink(store, app)  # the jobs it stops end through it (`_stop_job`)
        self.results = ResultWriter(store, self.stores, self.feeding, settings)
        self.notifier = BatchNotifier(settings, app)
        self.pace = Pace(settings.batch_feed_interval_s)
        keys = ApiKeyStore(store.redis, store.settings)
        self.queued_caps = QueuedCaps(keys, settings.max_queued_per_key)
        self._turn = 0

    # --- the pass ----------------------------------------------------------------------------
    def tick(self) -> int:
        """Visit the active batches once, fairly; returns how many this feeder stepped."""
        ids = self.batches.active_batch_ids()
        if not ids:
            self.pace.observe([])
            return 0
        found = self.batches.get_fed_many(ids)
        for batch_id, batch in zip(ids, found, strict=True):
            if batch is None:
                self.batches.drop_active(batch_id)  # its record expired: nothing left to do
        live = [batch for batch in found if batch is not None]
        active = {batch.id for batch in live}
        self.results.forget_except(active)
        self.notifier.forget_except(active)
        plan = plan_pass(live, self._windows(live), self._turn)
        self._turn += 1
        stepped = 0
        for visit in plan:
            batch_id = visit.batch.id
            try:
                stepped += self._visit(batch_id, visit.budget)
            except FeederLostLease:
                log.info("batch %s: feeder lease lost to another node", batch_id)
            except StorageError as exc:
                log.warning("batch %s: storage error (%s); will retry", batch_id, exc)
            except Exception:  # one bad batch must not stop the others
                log.exception("batch %s: feeding failed; will retry", batch_id)
        return stepped

    def _windows(self, live: list[FedBatch]) -> dict[str, int]:
        """Each batch's window: its nodes' capacity, plus what they finish in a pass or two."""
        self.pace.observe(live)
        capacity = self.store.shared_view(
            CAPACITY_VIEW,
            self.owner,
            self.settings.heartbeat_interval_s,
            lambda: capacities(self.store.live_nodes()),
        )
        return {
            b.id: window_size(
                capacity, b.pipeline, self.settings, self.pace.refill_jobs(live, b.pipeline)
            )
            for b in live
        }

    def _visit(self, batch_id: str, budget: int) -> int:
        token = self.feeding.take_feeder(batch_id, self.owner)
        if token <= 0:
            return 0
        self.step(batch_id, (token, self.owner), budget)
        return 1

    def step(self, batch_id: str, lease: Lease, budget: int) -> None:
        """One visit of one batch under `lease`: results, then feeding or winding down, then end."""
        batch = self.batches.get_fed(batch_id)
        if batch.final:
            return
        self.results.report(batch, lease)
        if batch.stop is None and time.time() > batch.deadline:
            try:
                self.batches.stop_batch(batch_id, "expired")
                log.info("batch %s: completion window ended; expiring what is left", batch_id)
            except BatchConflict:
                pass  # canceled meanwhile: the cancel stands
        batch = self.batches.get_fed(batch_id)
        if batch.stop is not None:
            self._wind_down(batch, lease)
        elif not batch.paused:
            self._feed(batch, lease, budget)
        batch = self.batches.get_fed(batch_id)
        if not self._finish_if_done(batch, lease):
            self.notifier.progress(batch)

    # --- feeding -----------------------------------------------------------------------------
    def _feed(self, batch: FedBatch, lease: Lease, budget: int) -> None:
        room = min(budget, self.settings.batch_feed_chunk, batch.unfed)
        cap = self.queued_caps.cap(batch.owner)
        if cap is not None and batch.owner is not None:
            room = min(room, cap - self.feeding.owner_queued(batch.owner))
        if room <= 0:
            return
        read = self.read_input(batch, room)
        if read is None:
            return
        items, ends = read
        news = [self._new_job(batch, item) for item in items]
        if cap is None:
            self.store.create_jobs(news)  # existing ids (a line fed before a crash) are skipped
        else:
            news = self._create_within(news, cap)
            items = items[: len(news)]
        if not items:
            return
        opened = [(new.id, item.line) for new, item in zip(news, items, strict=True)]
        cursor = (batch.fed + len(items), ends[len(items) - 1])
        written = self.feeding.record_fed(batch.id, lease, batch.fed, cursor, opened)
        if written is FedWrite.stale:
            raise FeederLostLease(batch.id)
        if written is FedWrite.stopping:
            log.info("batch %s: stopped while feeding; its new jobs end unpublished", batch.id)
            return
        self._publish_unconfirmed([new.id for new in news])

    def _create_within(self, news: list[NewJob], cap: int) -> list[NewJob]:
        """Create jobs in order while their owner is under `cap` queued jobs; those created.

        Each is checked and counted in the step that writes it (as POST /v1/jobs is), so the cap
        holds against the owner's other submissions; the lines after a refusal wait.
        """
        created: list[NewJob] = []
        for new in news:
            try:
                self.store.create_job(new, max_queued=cap)
            except QuotaExceeded:
                break
            created.append(new)
        return created

    def _new_job(self, batch: FedBatch, item: Item) -> NewJob:
        """The line's job, from the request the intake accepted at upload (its seed drawn)."""
        job_id = batch_job_id(batch.id, item.custom_id)
        trace = line_trace(job_id, batch.id, item.trace, batch.trace)
        return line_job(item.spec, job_id, batch.id, batch.owner, batch.priority, trace)

    def _publish_unconfirmed(self, job_ids: list[str]) -> None:
        for record in self.store.get_many(job_ids):
            if record is not None and record.state == JobState.QUEUED and not record.published:
                self.submitter.publish(record)

    def read_input(self, batch: FedBatch, count: int) -> tuple[list[Item], list[int]] | None:
        """`read_items`, or None while the input cannot be read (the batch fails if it stays so).

        Each visit reads again; once the input has been unreadable for `batch_input_retry_s`
        (and at least twice), the batch is stopped as failed with the reason in its view.
        """
        try:
            found = self.read_items(batch, count)
        except ObjectStoreError as exc:
            self._input_unreadable(batch, exc)
            return None
        except JobSpecRefused as exc:  # a newer release wrote its lines: no visit can read them
            self._stop_failed(batch, f"a line of the batch's input cannot be read: {exc}")
            return None
        if batch.input_failures:
            self.feeding.input_read(batch.id)
        return found

    def _input_unreadable(self, batch: FedBatch, exc: ObjectStoreError) -> None:
        now = time.time()
        failures, since = self.feeding.input_failed(batch.id, now)
        patience = self.settings.batch_input_retry_s
        if failures < 2 or now - since < patience:
            if failures == 1:
                log.warning(
                    "batch %s: its input cannot be read (%s); trying again for %gs",
                    batch.id,
                    exc,
                    patience,
                )
            return
        cause = f"{type(exc).__name__}: {public_message(str(exc))}"
        reason = (
            f"the batch's input cannot be read ({cause}) after {failures} attempts over "
            f"{now - since:.0f}s"
        )
        self._stop_failed(batch, reason)

    def _stop_failed(self, batch: FedBatch, reason: str) -> None:
        log.error("batch %s failed: %s", batch.id, reason)
        # stopping already (canceled or expired): that stop stands, the reason is kept
        with contextlib.suppress(BatchConflict):
            self.batches.stop_batch(batch.id, "failed", reason)

    def read_items(self, batch: FedBatch, count: int) -> tuple[list[Item], list[int]]:
        """Up to `count` items from the cursor on, and the byte offset after each of them."""
        items: list[Item] = []
        ends: list[int] = []
        offset = position = batch.offset
        pending = b""
        while len(items) < count:
            chunk = read_range(
                self.stores.at(batch.storage_url), batch.input_key, position, READ_SIZE
            )
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
                    ends.append(offset)
        return items, ends

    # --- winding down and the end -------------------------------------------------------------
    def _wind_down(self, batch: FedBatch, lease: Lease) -> None:
        """Stop the open jobs, then end the next chunk of unfed lines (fenced)."""
        reason = batch.stop or "canceled"
        if reason != "failed":  # a failed batch's open jobs run to their end
            self._stop_open_jobs(batch.id, reason)
        if batch.unfed <= 0:
            return
        if batch.error is not None:  # the input could not be read: nothing more will be
            self._end_unreadable(batch, lease, reason)
            return
        read = self.read_input(batch, min(self.settings.batch_feed_chunk, batch.unfed))
        if read is None or not read[0]:
            return
        items, ends = read
        offset = ends[-1]
        ids = [batch_job_id(batch.id, item.custom_id) for item in items]
        states = self.feeding.job_states(ids)
        opened: list[tuple[str, int]] = []
        ended: list[bytes] = []
        for job_id, item, state in zip(ids, items, states, strict=True):
            if state is None:
                ended.append(unfed_line(item.line, item.custom_id, reason))
            else:  # made by a feeder that died or was stopped before moving the cursor
                opened.append((job_id, item.line))
                if state in _OPEN_STATES:
                    self._stop_job(job_id, reason, state)
        part = self.results.put_part(batch, lease, b"".join(ended), "unfed") if ended else ""
        cursor = (batch.fed + len(items), offset)
        ending = (len(ended), reason, part)
        if self.feeding.record_fed(batch.id, lease, batch.fed, cursor, opened, ending) is not (
            FedWrite.applied
        ):
            if part:
                self.results.drop(batch, part)
            raise FeederLostLease(batch.id)

    def _stop_open_jobs(self, batch_id: str, reason: str) -> None:
        feeding = self.feeding
        open_ids = [job_id for job_id, _ in feeding.open_items(batch_id)]
        for job_id, state in zip(open_ids, feeding.job_states(open_ids), strict=True):
            if state in _OPEN_STATES:
                self._stop_job(job_id, reason, state)

    def _end_unreadable(self, batch: FedBatch, lease: Lease, reason: str) -> None:
        """End every line not fed yet under `reason`, without result lines (fenced)."""
        cursor = (batch.items, batch.offset)
        ending = (batch.unfed, reason, "")
        written = self.feeding.record_fed(batch.id, lease, batch.fed, cursor, [], ending)
        if written is not FedWrite.applied:
            raise FeederLostLease(batch.id)
        log.info("batch %s: %d unread lines ended (%s)", batch.id, batch.unfed, reason)

    def _stop_job(self, job_id: str, reason: str, state: str) -> None:
        store = self.store
        try:
            # cancel: queued and paused ones at once, running ones at their next step; expiry:
            # queued and paused only (running jobs may finish)
            if reason == "canceled":
                after = store.cancel(job_id)
            elif state == JobState.PAUSED:
                after = store.expire_paused(job_id)
            else:
                after = store.expire(job_id)
        except IllegalTransition:
            return
        except StorageError as exc:
            log.info("batch job %s: could not stop it (%s)", job_id, exc)
            return
        # its listeners and its own webhook, if its spec has one (read from `after`)
        if after.state in TERMINAL_STATES:
            self.events.changed(after)

    def _finish_if_done(self, batch: FedBatch, lease: Lease) -> bool:
        """End the batch if every line has its result (summary, status, webhook); True if so."""
        if batch.fed < batch.items or self.feeding.open_items(batch.id):
            return False
        status = batch.stop or "completed"
        ended = dataclasses.replace(batch, status=status, finished_at=time.time())
        part = self.results.put_part(batch, lease, summary_line(batch_view(ended)), "summary")
        if not self.feeding.finish_fed(batch.id, lease, status, part):
            self.results.drop(batch, part)
            raise FeederLostLease(batch.id)
        log.info("batch %s %s", batch.id, status)
        self.notifier.finished(self.batches.get_fed(batch.id))
        return True
