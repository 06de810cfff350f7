"""What the API and the CLI do with batches: accept a file, read, list, steer, retry, results."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kiln.common.media import BATCH_INPUT_CONTENT_TYPE
from kiln.common.states import JobState
from kiln.storage.batch_store import BatchFeeding, BatchStore, FedBatch, NewFedBatch
from kiln.storage.job_store import JobRecord, JobStore
from kiln.storage.object_streams import batch_object_key, iter_chunks, open_writer
from kiln.storage.objects import ObjectStore, StoresByUrl
from kiln.tasks.batches.intake import BatchIntake, IntakeReport, JsonCheck, LineDefaults
from kiln.tasks.batches.results import RESULTS_CONTENT_TYPE, stream_results
from kiln.tasks.batches.retry import retry_batch
from kiln.tasks.contract.batches import DEFAULT_COMPLETION_WINDOW, parse_completion_window
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.intake.intake import Intake
from kiln.tasks.intake.pausing import JobPausing, PauseRefused
from kiln.tasks.intake.refusal import Caller
from kiln.tasks.queue.submit import Submitter
from kiln.tasks.webhooks.event_sink import EventSink
from kiln.tasks.webhooks.ssrf import Resolver, UrlPolicy, system_resolver


def new_batch_id() -> str:
    """A fresh batch id: random hex (a valid id; its jobs' ids append `-<custom_id>`)."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class BatchOptions:
    """What applies to a whole batch: its lines' defaults, its window, how invalid lines count."""

    defaults: LineDefaults = field(default_factory=LineDefaults)
    window_s: int = parse_completion_window(DEFAULT_COMPLETION_WINDOW)
    skip_invalid: bool = False
    owner: str | None = None
    # the batch's W3C trace context (its span's at upload): its line jobs' traces link to it
    trace: dict[str, str] = field(default_factory=dict)


class BatchService:
    """Batches over one job store and object store."""

    def __init__(
        self,
        store: JobStore,
        objects: ObjectStore,
        submitter: Submitter,
        settings: KilnSettings,
        json_errors: JsonCheck,
        *,
        policy: UrlPolicy | None = None,
        resolve: Resolver = system_resolver,
    ) -> None:
        self.store = store
        self.batches = BatchStore(store.redis, store.settings)
        self.objects = objects
        # where a batch's files are read: the store its record names (StoresByUrl)
        self.stores = StoresByUrl(objects, store.settings)
        self.submitter = submitter
        self.settings = settings
        self.json_errors = json_errors
        # the one way in: every line passes the checks of POST /v1/jobs (`tasks.intake`)
        self.intake = Intake(submitter, objects, resolve=resolve, webhook_policy=policy)

    def new_intake(self, batch_id: str, options: BatchOptions) -> BatchIntake:
        """An intake writing the batch's input (and, with skip_invalid, its invalid results)."""
        prefix = self.objects.prefix
        input_key = batch_object_key(prefix, batch_id, "input.jsonl")
        items = open_writer(self.objects, input_key, BATCH_INPUT_CONTENT_TYPE)
        invalid = None
        if options.skip_invalid:
            key = batch_object_key(prefix, batch_id, "results", "invalid.jsonl")
            invalid = open_writer(self.objects, key, RESULTS_CONTENT_TYPE)
        return BatchIntake(
            checks=self.intake.lines(Caller(options.owner)),
            json_errors=self.json_errors,
            objects=self.objects,
            items=items,
            invalid=invalid,
            defaults=options.defaults,
            max_json_depth=self.settings.max_json_depth,
        )

    def accept(self, batch_id: str, report: IntakeReport, options: BatchOptions) -> FedBatch:
        """Record a batch whose intake was not refused; the feeders take it from there."""
        if report.refused or report.items_object is None:
            raise ValueError("a refused intake cannot be accepted")
        defaults = options.defaults
        new = NewFedBatch(
            id=batch_id,
            input_key=report.items_object.key,
            items=report.items,
            lines=report.lines,
            invalid=report.invalid,
            window_s=options.window_s,
            owner=options.owner,
            pipeline=defaults.pipeline,
            priority=defaults.priority,
            metadata=dict(defaults.metadata),
            webhook=defaults.webhook,
            invalid_part=report.invalid_object.key if report.invalid_object else None,
            storage_url=self.batches.settings.storage_url,
            trace=dict(options.trace),
        )
        return self.batches.submit_fed_batch(new)

    def submit_lines(
        self, chunks: Iterator[bytes], options: BatchOptions, batch_id: str | None = None
    ) -> tuple[FedBatch | None, IntakeReport]:
        """Validate and accept a whole file from `chunks` (the CLI without an API)."""
        batch_id = batch_id or new_batch_id()
        intake = self.new_intake(batch_id, options)
        try:
            for chunk in chunks:
                intake.feed(chunk)
            report = intake.finish()
        except BaseException:
            intake.abort()
            raise
        if report.refused:
            intake.abort()
            return None, report
        return self.accept(batch_id, report, options), report

    def submit_stored(
        self, key: str, options: BatchOptions, batch_id: str | None = None
    ) -> tuple[FedBatch | None, IntakeReport]:
        """Validate and accept a file already in the object store (an upload), streamed from it.

        The upload stays where it is; the batch's own input is written as the lines pass.
        """
        return self.submit_lines(iter_chunks(self.objects, key), options, batch_id)

    def get(self, batch_id: str) -> FedBatch:
        """The batch (BatchNotFound if there is none)."""
        return self.batches.get_fed(batch_id)

    def list(
        self, owner: str | None, cursor: str | None, limit: int
    ) -> tuple[list[FedBatch], str | None]:
        """A page of batches, newest first (an owner's, or every one)."""
        return self.batches.list_fed(owner, cursor, limit)

    def cancel(self, batch_id: str) -> FedBatch:
        """Stop feeding; the feeder cancels queued and running jobs and ends the unfed lines.

        BatchConflict for a finished batch or one whose completion window is being carried out.
        """
        return self.batches.stop_batch(batch_id, "canceled")

    def pause(self, batch_id: str) -> FedBatch:
        """Stop feeding new lines and pause the fed ones (BatchConflict unless running or paused).

        Each open line is paused as `kiln pause` pauses a job (tasks/intake/pausing.py): a queued
        one at once, a running one at its next step with a step checkpoint.
        """
        self.batches.pause(batch_id)
        self._open_lines(batch_id, (JobState.QUEUED, JobState.RUNNING), self._pausing().pause)
        return self.batches.get_fed(batch_id)  # its counts after its lines moved

    def resume(self, batch_id: str) -> FedBatch:
        """Feed again and resume its paused lines (BatchConflict unless paused or running)."""
        self.batches.resume(batch_id)
        self._open_lines(batch_id, (JobState.PAUSED,), self._pausing().resume)
        return self.batches.get_fed(batch_id)

    def _pausing(self) -> JobPausing:
        return JobPausing(self.store, self.submitter, EventSink(self.store))

    def _open_lines(
        self,
        batch_id: str,
        states: tuple[JobState, ...],
        act: Callable[[JobRecord], object],
    ) -> None:
        """Apply `act` to each fed line whose result is not written yet and that is in `states`."""
        job_ids = [
            job_id
            for job_id, _ in BatchFeeding(self.store.redis, self.store.settings).open_items(
                batch_id
            )
        ]
        for record in self.store.get_many(job_ids):
            if record is None or record.state not in states:
                continue
            try:
                act(record)
            except PauseRefused:  # it ended or was canceled since it was read: nothing to do
                continue

    def retry(self, batch_id: str, statuses: frozenset[str]) -> FedBatch:
        """A new batch of the finished batch's lines that ended in `statuses`, linked to it.

        BatchConflict unless the batch is finished; NothingToRetry if no line qualifies;
        RetryRunning while a retry of the same lines has not ended.
        """
        return self.retry_once(batch_id, statuses)[0]

    def retry_once(
        self, batch_id: str, statuses: frozenset[str], idempotency_key: str | None = None
    ) -> tuple[FedBatch, bool]:
        """`retry`, made once per `idempotency_key`: (the retry, whether this call made it).

        The retry the key made already comes back (not new); RetryKeyBound if it retried other
        lines.
        """
        parent = self.batches.get_fed(batch_id)
        return retry_batch(
            self.batches, self.stores, parent, new_batch_id(), statuses, idempotency_key
        )

    def results(self, batch_id: str) -> Iterator[bytes]:
        """Every result line so far (URLs presigned now), read as consumed."""
        self.batches.get_fed(batch_id)  # BatchNotFound before the first byte
        return stream_results(self.batches, self.stores, batch_id)


def refusal_body(report: IntakeReport) -> dict[str, Any]:
    """The 422 body of a refused file: the first errors (line, field, reason) and the counts.

    `detail` opens with one entry (type `batch_invalid`, line 0) that states the counts, so a
    client that reads only FastAPI's error list still learns how many lines were refused.
    """
    if report.lines == 0:
        return {"detail": report.errors, "invalid_lines": 0, "lines": 0}
    summary = {
        "type": "batch_invalid",
        "loc": ["body"],
        "msg": f"{report.invalid} of {report.lines} lines are invalid; the first ones' errors "
        "follow",
        "line": 0,
        "ctx": {"invalid_lines": report.invalid, "lines": report.lines},
    }
    return {
        "detail": [summary, *report.errors],
        "invalid_lines": report.invalid,
        "lines": report.lines,
    }
