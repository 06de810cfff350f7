"""Step accounting: what a job's attempts computed, restored from checkpoints and computed again.

Its one writer is the transition that closes an attempt (storage/lua/_machine.lua,
`account_attempt`): the attempt's figures go on its `attempt_log` entry and their sums on the
record's `accounting` field, which `StepAccounting` reads; the API's job view, the event that
closes an attempt or ends the job (and so its webhooks), a batch's result lines and the metrics'
`kiln_steps_*_total` counters all show those figures, never a copy of the arithmetic.

Per attempt, with `restored` the step its checkpoint gave it (0: it started from step 0) and
`reached` the furthest denoising step it ran:

- computed = reached - restored;
- recomputed = max(0, min(reached, frontier) - restored), `frontier` being the furthest step
  any earlier attempt reached: steps an earlier attempt had computed but left no checkpoint of;
- seconds_lost = recomputed × the attempt's seconds per step (`AttemptSteps.step_s`: the pace
  of its denoising steps, from the first step's report to the last, so not the text encoding or
  the restore that come before them).

A job's figures are the sums over its attempts (docs/contract.md §5b).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

ACCOUNTING_FIELD = "accounting"  # the record's field: StepAccounting as JSON
ATTEMPT_STEPS_FIELD = "attempt_steps"  # written with a node's end of its attempt: AttemptSteps


class StepAccounting(BaseModel):
    """A job's denoising steps over all its attempts, and the compute lost to interruptions."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    steps_computed: int = Field(default=0, description="Denoising steps every attempt ran.")
    steps_restored: int = Field(
        default=0, description="Steps attempts took from a step checkpoint instead of computing."
    )
    steps_recomputed: int = Field(
        default=0,
        description="Steps an attempt computed that an earlier attempt had already computed "
        "(and left no checkpoint of).",
    )
    seconds_lost: float = Field(
        default=0.0,
        description="Compute seconds of the recomputed steps: each attempt's recomputed steps "
        "times its mean seconds per step.",
    )

    @classmethod
    def from_field(cls, text: str | None) -> StepAccounting:
        """The record's `accounting` field as stored; zeros when absent (the job never ran)."""
        if not text:
            return cls()
        return cls.model_validate(json.loads(text))


@dataclass(frozen=True)
class AttemptSteps:
    """What a node's attempt ran, as the node reports it with the attempt's end.

    `restored`: the step it resumed from (0: none); `reached`: the furthest denoising step it
    ran; `step_s`: its seconds per denoising step, first step's report to last (the forward's
    mean per step when it reported one step only; 0: unknown).
    """

    restored: int
    reached: int
    step_s: float
    # the attempt's ledger figures, carried in the same field (kiln/common/ledger.py AttemptUsage)
    usage: Mapping[str, object] | None = None

    def field(self) -> str:
        """The record field's value (the transition script reads and removes it)."""
        figures = {
            "restored": self.restored,
            "reached": self.reached,
            "step_s": round(self.step_s, 6),
        }
        return json.dumps(figures if self.usage is None else {**figures, "usage": self.usage})


class StepTracker:
    """An attempt's denoising steps as its progress reports them, one per step, in order.

    The first step reported after a resume from step k is k + 1 (the skipped steps report
    nothing), so the run's `restored` is the first step seen, less one.
    """

    def __init__(self) -> None:
        self._first: tuple[int, float] | None = None
        self._last: tuple[int, float] | None = None

    def step(self, step: int, at: float) -> None:
        """A denoising step finished at `at` (a monotonic time)."""
        if self._first is None:
            self._first = (step, at)
        if self._last is None or step > self._last[0]:
            self._last = (step, at)

    def steps(self, restored: int | None = None, step_s: float | None = None) -> AttemptSteps:
        """What the run did; `restored` and `step_s` given when known better (its result's)."""
        if self._first is None or self._last is None:
            return AttemptSteps(restored or 0, restored or 0, step_s or 0.0)
        (first, first_at), (last, last_at) = self._first, self._last
        if step_s is None:  # the first step's own time is unknown: it is the start of the clock
            step_s = (last_at - first_at) / (last - first) if last > first else 0.0
        return AttemptSteps(first - 1 if restored is None else restored, last, step_s)
