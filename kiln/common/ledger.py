"""The ledger: what a job cost, per phase and in GPU-seconds and energy (docs/contract.md §5c).

A node reports each attempt's own figures with its end (`AttemptUsage`, riding in the
`attempt_steps` field beside the step accounting, kiln/common/accounting.py); the transition that
closes the attempt (storage/lua/_machine.lua `account_usage`) is the one writer of the record's
`ledger` field, which `JobLedger` reads, and of the hourly usage buckets that `GET /v1/usage` and
`kiln usage` total (storage/usage.py). The job view, the events that close an attempt or end the
job (and so their webhooks), batch result lines and the metrics' `kiln_gpu_seconds_total` all show
those figures, never a copy of the arithmetic.

GPU-seconds: a batched forward occupies its group's devices for its wall time, so it costs
seconds × devices; that is shared among the batch's requests by their share of the work, a
request's work being outputs × width × height × frames (`work_units`). A request that ran alone
is charged its forward's whole time. Energy: the same share of the devices' NVML energy counter
over the forward, where the devices are NVIDIA GPUs (NVML, through `nvidia-ml-py`); else null.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from pydantic import BaseModel, ConfigDict, Field

LEDGER_FIELD = "ledger"  # the record's field: JobLedger as JSON
USAGE_KEY = "usage"  # AttemptUsage's key inside the attempt's reported steps (AttemptSteps)
USAGE_BUCKET_S = 3600  # usage is summed per hour: a bucket per hour per deployment
# how long an hour's usage bucket is kept after its last write (93 days: a quarter and its margin)
USAGE_RETENTION_S = 93 * 24 * 3600


def work_units(num_outputs: int, width: int, height: int, num_frames: int) -> int:
    """A request's share of a batched forward's work: its outputs' pixels over all frames."""
    return max(1, num_outputs) * max(1, width) * max(1, height) * max(1, num_frames)


def shares(total: float, works: Mapping[str, int]) -> dict[str, float]:
    """`total` (GPU-seconds or joules) split among requests in proportion to their work.

    The parts add up to `total` (the last one takes the rounding's remainder).
    """
    if not works:
        return {}
    weight = sum(max(0, w) for w in works.values())
    names = list(works)
    if weight <= 0:  # no work stated: an even split
        return {name: total / len(names) for name in names}
    parts = {name: total * max(0, works[name]) / weight for name in names[:-1]}
    parts[names[-1]] = total - sum(parts.values())
    return parts


@dataclass(frozen=True)
class AttemptUsage:
    """What one attempt cost, as its node measured it (reported with the attempt's end).

    Phases in seconds: `loading_s` from the submit to the group until its forward started (waiting
    for a batch, waking the group), `computing_s` its forward (denoising and decoding),
    `encoding_s` and `uploading_s` its outputs'. `gpu_s`: its share of its forward's
    seconds × devices; `energy_j`: its share of the devices' energy (None: not measured).
    """

    pipeline: str
    gpu_s: float
    energy_j: float | None = None
    loading_s: float = 0.0
    computing_s: float = 0.0
    encoding_s: float = 0.0
    uploading_s: float = 0.0

    def as_dict(self) -> dict[str, object]:
        """The report as the transition script reads it (figures rounded to the microsecond)."""
        figures = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        return figures


class JobLedger(BaseModel):
    """A job's cost over all its attempts: seconds per phase, GPU-seconds, energy."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    queued_s: float = Field(
        default=0.0,
        description="Seconds the job waited before its attempts started (from its creation, or "
        "from the end of the attempt before, paused time included).",
    )
    loading_s: float = Field(
        default=0.0,
        description="Seconds from the hand-off to the node's worker group until the forward "
        "started (waiting for a batch, waking the group).",
    )
    computing_s: float = Field(default=0.0, description="Seconds of the forwards.")
    encoding_s: float = Field(default=0.0, description="Seconds encoding outputs.")
    uploading_s: float = Field(default=0.0, description="Seconds uploading outputs.")
    gpu_s: float = Field(
        default=0.0,
        description="GPU-seconds the job occupied: each forward's seconds × its group's devices, "
        "shared among a batch's jobs by outputs × width × height × frames.",
    )
    energy_j: float | None = Field(
        default=None,
        description="Joules from NVML's energy counter (its share of a batch's); null where the "
        "devices are not NVIDIA GPUs or NVML is not installed.",
    )

    @classmethod
    def from_field(cls, text: str | None) -> JobLedger:
        """The record's `ledger` field as stored; zeros when absent (the job never ran)."""
        if not text:
            return cls()
        return cls.model_validate(json.loads(text))
