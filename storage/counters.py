"""Counts of finished jobs, batch lines and batches, of live batches, and the steps' sums.

`finished_counts` reads `keys.finished_counts`: the terminal transition of a job
(storage/lua/_machine.lua, `finish`) and the end of a fed batch (batch_finish.lua) add 1 there in
the same atomic step that ends it; a transition refused or retried (the job already terminal, the
batch's lease gone) writes nothing, so nothing is counted twice. A batch line is counted once
whichever way it ends: its job's terminal transition; the feeder's write that ends it without a
job (batch_fed.lua: canceled, expired or failed before it was fed); or, refused at submit
(`INVALID_LINES`), the batch's creation (batch_submit.lua). The hash has no TTL: the counts
stay right after the records they count have expired, and every API process or node reading it
sees the same numbers. `live_batches` counts the batches still being fed or finished by status.
The transition that closes an attempt adds its step accounting there too (`steps/<queue>/<figure>`,
kiln/common/accounting.py), and its GPU-seconds (`gpu/<pipeline>/<owner key id>`,
kiln/common/ledger.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kiln.common.states import TERMINAL_STATES, JobState
from kiln.storage.base import StoreBase
from kiln.storage.boundary import redis_boundary

# The status of a batch line refused at submit (its result line's, tasks/contract/batches.py
# INVALID): with the terminal job states, what a finished batch line is counted under.
INVALID_LINES = "invalid"
LINE_STATUSES: tuple[str, ...] = (*sorted(TERMINAL_STATES), INVALID_LINES)


@dataclass(frozen=True)
class FinishedCounts:
    """Jobs finished per (queue, terminal state), batch lines per status, batches per status."""

    jobs: dict[tuple[str, JobState], int] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)  # by LINE_STATUSES
    batches: dict[str, int] = field(default_factory=dict)
    # step accounting (kiln/common/accounting.py), per (queue, figure): steps_computed,
    # steps_restored, steps_recomputed and seconds_lost, added by the transition that closes an
    # attempt (storage/lua/_machine.lua `account_attempt`)
    steps: dict[tuple[str, str], float] = field(default_factory=dict)
    # GPU-seconds per (pipeline, owner key id; '-' without a key), the ledger's
    # (storage/lua/_machine.lua `account_usage`)
    gpu: dict[tuple[str, str], float] = field(default_factory=dict)


@redis_boundary
def finished_counts(store: StoreBase) -> FinishedCounts:
    """The counters as they stand (one HGETALL); fields of another form are skipped."""
    counts = FinishedCounts()
    for name, value in store.redis.hgetall(store.keys.finished_counts).items():
        kind, _, rest = name.partition("/")
        if kind == "batch":
            counts.batches[rest] = int(value)
            continue
        queue, _, state = rest.rpartition("/")
        if kind == "steps":
            counts.steps[queue, state] = float(value)
            continue
        if kind == "gpu":  # gpu/<pipeline>/<owner>
            counts.gpu[queue, state] = float(value)
            continue
        if kind == "line" and not queue and state in LINE_STATUSES:
            counts.lines[state] = int(value)
        elif kind == "job" and state in TERMINAL_STATES:
            counts.jobs[queue, JobState(state)] = int(value)
    return counts


@redis_boundary
def live_batches(store: StoreBase) -> dict[str, int]:
    """Batches still being fed or finished, per status (running, paused, finalizing)."""
    batch_ids = store.redis.zrange(store.keys.active_batches, 0, -1)
    if not batch_ids:
        return {}
    with store.redis.pipeline(transaction=False) as pipe:
        for batch_id in batch_ids:
            pipe.hget(store.keys.batch(batch_id), "status")
        statuses = pipe.execute()
    return dict(Counter(status for status in statuses if status))
