"""The feeder's result writing: finished jobs' lines as one committed part, parts named safely.

A part is an object named by the lease token and a nonce, listed in Redis only by a fenced write
(`BatchFeeding.record_reported`), so a part a stale feeder writes late is never a result. Once a
job's line is committed its record expires after `batch_item_retention_s`: the results are its
durable record, and Redis keeps the window, not every line a batch ever ran.
"""

from __future__ import annotations

import logging
import time
import uuid

from kiln.common.states import TERMINAL_STATES
from kiln.storage.batch_records import FedBatch
from kiln.storage.batch_store import BatchFeeding
from kiln.storage.errors import StorageError
from kiln.storage.object_streams import batch_object_key
from kiln.storage.objects import StoresByUrl
from kiln.storage.queries import QueryOps
from kiln.tasks.batches.intake import custom_id_of
from kiln.tasks.batches.results import RESULTS_CONTENT_TYPE, job_line
from kiln.tasks.contract.settings import KilnSettings

log = logging.getLogger(__name__)
Lease = tuple[int, str]


class FeederLostLease(Exception):
    """A fenced write was refused: another feeder holds the batch now."""


class ResultWriter:
    """Writes a batch's result parts for its feeder (at least every `batch_results_flush_s`)."""

    def __init__(
        self, store: QueryOps, stores: StoresByUrl, feeding: BatchFeeding, settings: KilnSettings
    ) -> None:
        self.store = store
        self.stores = stores
        self.objects = stores.own
        self.feeding = feeding
        self.settings = settings
        self._flushed_at: dict[str, float] = {}

    def forget_except(self, active: set[str]) -> None:
        """Drop the flush times of batches no longer active."""
        self._flushed_at = {b: t for b, t in self._flushed_at.items() if b in active}

    def report(self, batch: FedBatch, lease: Lease) -> None:
        """Write the lines of the batch's finished open jobs as one part (when a flush is due)."""
        due = time.monotonic() - self._flushed_at.get(batch.id, 0.0)
        if batch.status in ("running", "paused") and due < self.settings.batch_results_flush_s:
            return  # before reading the open set: most visits stop here
        open_items = self.feeding.open_items(batch.id)
        if not open_items:
            return
        states = self.feeding.job_states([job_id for job_id, _ in open_items])
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
        part = self.put_part(batch, lease, data)
        job_ids = [job_id for job_id, _ in done]
        retention = self.settings.batch_item_retention_s
        if not self.feeding.record_reported(batch.id, lease, part, job_ids, retention):
            self.drop(batch, part)
            raise FeederLostLease(batch.id)
        self._flushed_at[batch.id] = time.monotonic()

    def put_part(self, batch: FedBatch, lease: Lease, data: bytes, name: str = "part") -> str:
        """Store `data` as a new part of the batch's results; its key (not listed yet)."""
        # named by the lease token and a nonce: a part a stale feeder writes late never replaces
        # a committed one; only the parts listed in Redis are results
        token, _ = lease
        nonce = uuid.uuid4().hex[:8]
        objects = self.stores.at(batch.storage_url)  # beside its input, where readers look
        key = batch_object_key(objects.prefix, batch.id, "results", f"{name}-{token}-{nonce}.jsonl")
        objects.put(key, data, RESULTS_CONTENT_TYPE)
        return key

    def drop(self, batch: FedBatch, key: str) -> None:
        """Delete a part of the batch that was never listed (best effort)."""
        try:
            self.stores.at(batch.storage_url).delete(key)
        except StorageError as exc:  # an orphan part is never listed: harmless
            log.info("could not delete orphan result part %s: %s", key, exc)
