"""A redrive: a new job for each chosen dead letter, at most `rate` per second.

The new job is a copy of the dead one's request, owner and lane under a fresh id, its metadata
naming the old one (`redrive_of`); the dead letter names the new job (`redriven_to`), claimed
before the job is written so two redrives never make two jobs of one dead letter. A failed job
stays failed (a terminal state never changes), and its dead letter stays as the record of what
happened; docs/contract.md §5a says why a new job rather than a new attempt series.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from kiln.storage.creation import CreationOps, QueueFull
from kiln.storage.dead_letters import DeadLetter, DeadLetterFilter, DeadLetterStore
from kiln.storage.errors import QuotaExceeded
from kiln.tasks.contract.dead_letters import (
    AttemptView,
    DeadLetterView,
    RedriveItem,
    RedriveRequest,
    RedriveResult,
)
from kiln.tasks.contract.job_spec import JobSpec, JobSpecRefused
from kiln.tasks.intake.intake import spec_job
from kiln.tasks.queue.submit import Submitter, new_job_id

# the metadata entry of a redriven job naming the job it was made from
REDRIVE_OF = "redrive_of"


def dead_letter_view(letter: DeadLetter) -> DeadLetterView:
    """The view of one dead letter."""
    return DeadLetterView(
        id=letter.id,
        owner=letter.owner,
        pipeline=letter.pipeline,
        dead_at=letter.dead_at,
        poison=letter.poison,
        error=letter.error,
        attempts=letter.attempts,
        attempt_log=[AttemptView.model_validate(entry) for entry in letter.attempt_log],
        request=letter.request,
        lane=letter.lane,
        queue=letter.queue,
        batch_id=letter.batch_id,
        metadata=letter.metadata,
        created_at=letter.created_at,
        started_at=letter.started_at,
        finished_at=letter.finished_at,
        checkpoint=letter.checkpoint,
        redriven_to=letter.redriven_to,
        redriven_at=letter.redriven_at,
    )


def pick(
    letters: DeadLetterStore, owner: str | None, chosen: DeadLetterFilter, limit: int
) -> list[DeadLetter]:
    """Up to `limit` dead letters (an owner's, or all) that `chosen` takes, newest first."""
    found: list[DeadLetter] = []
    cursor: str | None = None
    while len(found) < limit:
        page, cursor = letters.page(owner, cursor, limit - len(found), chosen.takes)
        found.extend(page)
        if cursor is None:
            break
    return found


def chosen_letters(
    letters: DeadLetterStore, request: RedriveRequest, owner: str | None
) -> list[tuple[str, DeadLetter | None]]:
    """The dead letters a redrive names: its ids (None where none is left), or its filter's.

    A filter takes up to the request's limit of `owner`'s letters (None: everyone's).
    """
    if request.ids is not None:
        return list(zip(request.ids, letters.get_many(request.ids), strict=True))
    chosen = request.filter
    assert chosen is not None  # the request's validator: ids or filter
    taking = DeadLetterFilter(
        error_type=chosen.error_type,
        pipeline=chosen.pipeline,
        since=chosen.since,
        until=chosen.until,
        include_redriven=chosen.include_redriven,
        poison=chosen.poison,
    )
    return [(letter.id, letter) for letter in pick(letters, owner, taking, request.limit)]


def redrive(
    store: CreationOps,
    letters: DeadLetterStore,
    submitter: Submitter,
    targets: Sequence[tuple[str, DeadLetter | None]],
    *,
    rate: float,
    dry_run: bool,
    may_see: Callable[[str | None], bool] = lambda _owner: True,
    max_depth: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> RedriveResult:
    """Redrive `targets` (id, its dead letter or None) in order, one job per 1/rate s at most.

    A dry run reports `would_redrive` for each one a redrive would take and writes nothing.
    A full queue (`max_depth`) or the owner's quota refuses that job and every one after it.
    """
    results: list[RedriveItem] = []
    made = 0
    last_start = float("-inf")
    refusal: str | None = None
    for job_id, letter in targets:
        item = _unavailable(job_id, letter, may_see)
        if item is not None:
            results.append(item)
            continue
        assert letter is not None
        if dry_run:
            results.append(RedriveItem(id=job_id, outcome="would_redrive"))
            continue
        if refusal is not None:
            results.append(RedriveItem(id=job_id, outcome="refused", message=refusal))
            continue
        # each job 1/rate after the one before it: a late one never lets the next ones bunch
        wait = last_start + 1.0 / rate - time.monotonic()
        if wait > 0:
            sleep(wait)
        last_start = time.monotonic()
        try:
            new_id = _make_job(store, letters, submitter, letter, max_depth)
        except (QueueFull, QuotaExceeded) as exc:
            refusal = f"not redriven: {exc}"
            results.append(RedriveItem(id=job_id, outcome="refused", message=refusal))
            continue
        except JobSpecRefused as exc:  # its spec is not one this release reads: this one only
            unread = f"not redriven: {exc}"
            results.append(RedriveItem(id=job_id, outcome="refused", message=unread))
            continue
        if new_id is None:
            results.append(RedriveItem(id=job_id, outcome="already_redriven"))
            continue
        made += 1
        results.append(RedriveItem(id=job_id, outcome="redriven", new_job_id=new_id))
    return RedriveResult(dry_run=dry_run, rate=rate, redriven=made, results=results)


def _unavailable(
    job_id: str, letter: DeadLetter | None, may_see: Callable[[str | None], bool]
) -> RedriveItem | None:
    if letter is None:
        return RedriveItem(id=job_id, outcome="not_found", message="no such dead letter")
    if not may_see(letter.owner):
        return RedriveItem(id=job_id, outcome="forbidden", message="another API key's job")
    if letter.redriven_to is not None:
        return RedriveItem(id=job_id, outcome="already_redriven", new_job_id=letter.redriven_to)
    return None


def _make_job(
    store: CreationOps,
    letters: DeadLetterStore,
    submitter: Submitter,
    letter: DeadLetter,
    max_depth: int | None,
) -> str | None:
    """The new job's id, written and published; None if another redrive claimed it first."""
    spec = JobSpec.decode(letter.request)
    new = spec_job(spec, job_id=new_job_id(), owner=letter.owner, lane=letter.lane)
    new = dataclasses.replace(new, metadata={**new.metadata, REDRIVE_OF: letter.id})
    if not letters.claim(letter.id, new.id):
        return None
    try:
        record, created = store.create_job(
            new, max_depth=max_depth, message=submitter.message_for(new)
        )
    except BaseException:
        letters.unclaim(letter.id, new.id)
        raise
    submitter.accepted(record, created)
    return new.id
