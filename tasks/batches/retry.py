"""A batch's retry: a new batch of the parent's failed, expired and/or canceled lines, linked to it.

The retry's input is written by streaming: first the parent's results (the custom_ids whose
status was asked for), then the parent's stored input, whose items for those custom_ids are copied
as they are (same custom_id, same request and seed). Only a finished parent is retried, since only
then is every line's outcome written.

A retry is made once per request: while a retry of the same lines (one of the statuses asked for)
has not ended, another is refused (RetryRunning, naming it), and an idempotency key answers the
retry it made. Both are checked before the input is written and again, atomically, when the retry
is recorded (`batch_submit.lua`); a request that lost that race removes the input it wrote.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable

from kiln.common.media import BATCH_INPUT_CONTENT_TYPE
from kiln.storage.batch_records import (
    BatchConflict,
    FedBatch,
    NewFedBatch,
    RetryKeyBound,
    RetryRunning,
)
from kiln.storage.batch_store import BatchStore
from kiln.storage.object_streams import batch_object_key, iter_lines, open_writer
from kiln.storage.objects import ObjectStore, StoresByUrl
from kiln.tasks.batches.intake import item_line, parse_item


class NothingToRetry(ValueError):
    """The parent has no line of the statuses asked for."""


def lines_to_retry(
    batches: BatchStore, objects: ObjectStore, batch_id: str, statuses: frozenset[str]
) -> set[str]:
    """The custom_ids of the batch's result lines whose status is one of `statuses`."""
    chosen: set[str] = set()
    for part in batches.part_keys(batch_id):
        for raw in iter_lines(objects, part):
            if b'"result"' not in raw:
                continue
            line = json.loads(raw)
            custom_id = line.get("custom_id")
            if line.get("type") == "result" and line.get("status") in statuses and custom_id:
                chosen.add(str(custom_id))
    return chosen


def write_retry_input(
    stores: StoresByUrl, parent: FedBatch, retry_id: str, custom_ids: Iterable[str]
) -> tuple[str, int]:
    """Copy the parent's items of `custom_ids` into the retry's input (renumbered from 1).

    Read where the parent's record says; written to this process's own store.
    """
    wanted = set(custom_ids)
    objects = stores.own
    key = batch_object_key(objects.prefix, retry_id, "input.jsonl")
    writer = open_writer(objects, key, BATCH_INPUT_CONTENT_TYPE)
    count = 0
    try:
        for raw in iter_lines(stores.at(parent.storage_url), parent.input_key):
            if not raw.strip():
                continue
            item = parse_item(raw)
            if item.custom_id in wanted:
                count += 1
                writer.write(item_line(count, item.custom_id, item.spec))
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return key, count


def retry_batch(
    batches: BatchStore,
    stores: StoresByUrl,
    parent: FedBatch,
    retry_id: str,
    statuses: frozenset[str],
    idempotency_key: str | None = None,
) -> tuple[FedBatch, bool]:
    """Record a new batch of the parent's lines that ended in `statuses`: (it, whether new).

    BatchConflict unless the parent is finished, NothingToRetry if no line qualifies,
    RetryRunning while a retry of the same lines runs, RetryKeyBound for a key used otherwise.
    """
    if not parent.final:
        raise BatchConflict(parent.id, parent.status, "retried")
    new = NewFedBatch(
        id=retry_id,
        input_key="",
        items=0,
        lines=0,
        invalid=0,
        window_s=parent.window_s,
        owner=parent.owner,
        pipeline=parent.pipeline,
        priority=parent.priority,
        metadata=dict(parent.metadata),
        webhook=parent.webhook,
        parent_id=parent.id,
        retried=tuple(sorted(statuses)),
        idempotency_key=idempotency_key,
        storage_url=stores.settings.storage_url,
    )
    made = batches.check_retry(new)  # before streaming the parent's files: most refusals
    if made is not None:
        return made, False
    chosen = lines_to_retry(batches, stores.at(parent.storage_url), parent.id, statuses)
    if not chosen:
        raise NothingToRetry(f"batch {parent.id} has no {' or '.join(sorted(statuses))} lines")
    input_key, items = write_retry_input(stores, parent, retry_id, chosen)
    new = dataclasses.replace(new, input_key=input_key, items=items, lines=items)
    try:
        return batches.submit_retry(new)
    except (RetryRunning, RetryKeyBound):
        stores.own.delete(input_key)  # another request made the retry meanwhile
        raise
