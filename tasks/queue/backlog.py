"""The backlog autoscalers read, and the wait admission control checks (docs/operations.md §16).

Per pipeline, from one read of its lanes' queues (storage/backlog.py: Kiln's records, never the
broker's lists, so a message a node has prefetched still counts as queued):

- job GPU-seconds: the mean run time (finish - start) of the pipeline's runs that ended in the
  last ten minutes, both lanes (the completion windows the ETA model reads, tasks/queue/
  positions.py); `KILN_JOB_GPU_S_UNKNOWN` while none ended. A batched run counts its batch's time
  for each of its jobs: with batching the work is overestimated, so the fleet errs large.
- queued GPU-seconds per lane: Q = queued jobs × job GPU-seconds.
- running jobs, and busy nodes: the distinct nodes (node ids, not the per-delivery lease owners)
  holding a lease of the pipeline's running jobs.
- desired nodes, for the targets T = `KILN_TARGET_START_S_INTERACTIVE` / `_BULK`:

      queue_nodes = ceil(max(Q_interactive / T_interactive, (Q_interactive + Q_bulk) / T_bulk))
      desired     = min(busy_nodes + queue_nodes, KILN_DESIRED_NODES_MAX)

  Nodes take interactive jobs first, so N nodes start the last queued interactive job after about
  Q_interactive / N seconds and the last bulk one after (Q_interactive + Q_bulk) / N: each lane
  within its target. `queue_nodes` is at least 1 while any job is queued (a job of a pipeline
  with no node asks for one at once) and at most the queued jobs (a job runs on one node). Busy
  nodes count on their own: the queued work comes on top of what runs, and a node running a job
  is never asked to leave for it.
- expected wait per lane: the ETA model's estimate for a job submitted now, at the back of its
  lane (`positions.estimate_from`); None while no run ended lately or the queue is paused.

Admission (`late_start`): an interactive job whose `start_by` (or, with `KILN_ADMIT_BY_TARGET`,
its lane's target) is sooner than its lane's expected wait is refused, Retry-After the difference
(the wait shrinks by a second a second while no job arrives). Bulk is never refused for latency.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.common.request import Lane
from kiln.storage.backlog import BacklogOps, BacklogReading, QueueBacklog
from kiln.storage.queues import QueueSnapshot
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.lanes import LANES, queue_name
from kiln.tasks.queue.positions import estimate_from

# how long one backlog read answers admission for (the submit route reads at most this often)
ADMISSION_READ_S = 1.0


@dataclass(frozen=True)
class PipelineBacklog:
    """One pipeline's backlog and the nodes it wants, read at `now` (the Redis clock, s)."""

    pipeline: str
    now: float
    queued: dict[str, int]  # per lane
    queued_gpu_s: dict[str, float]  # per lane
    job_gpu_s: float  # what one job is counted at (mean recent run, or the unknown default)
    running_jobs: int
    busy_nodes: int
    desired_nodes: int
    expected_wait_s: dict[str, float | None]  # per lane: a job submitted now


@dataclass(frozen=True)
class NodeCounts:
    """A pipeline's live nodes from their heartbeats; `asleep` and `draining` are among them."""

    live: int = 0
    asleep: int = 0
    draining: int = 0


def lane_targets(settings: KilnSettings) -> dict[str, float]:
    """The target start (s) of each lane."""
    return {
        Lane.interactive: settings.target_start_s_interactive,
        Lane.bulk: settings.target_start_s_bulk,
    }


def queue_nodes(
    queued_jobs: int, queued_gpu_s: Mapping[str, float], targets: Mapping[str, float]
) -> int:
    """Nodes that start every queued job within its lane's target (the module's arithmetic)."""
    if queued_jobs <= 0:
        return 0
    interactive = queued_gpu_s.get(Lane.interactive, 0.0)
    everything = interactive + queued_gpu_s.get(Lane.bulk, 0.0)
    needed = max(interactive / targets[Lane.interactive], everything / targets[Lane.bulk])
    return min(max(math.ceil(needed), 1), queued_jobs)


def desired_nodes(busy: int, queued: int, most: int) -> int:
    """Busy nodes plus the queue's, at most `most`."""
    return min(busy + queued, most)


def pipeline_queues(pipeline: str) -> list[str]:
    """The queues of every lane of `pipeline`, in lane order."""
    return [queue_name(lane, pipeline) for lane in LANES]


def read_backlogs(
    store: BacklogOps, settings: KilnSettings, pipelines: Sequence[str]
) -> list[PipelineBacklog]:
    """The backlog of each of `pipelines`, all read in one call."""
    reading = store.backlog([q for p in pipelines for q in pipeline_queues(p)])
    return [backlog_of(reading, p, settings) for p in pipelines]


def read_backlog(store: BacklogOps, settings: KilnSettings, pipeline: str) -> PipelineBacklog:
    """The backlog of one pipeline."""
    return read_backlogs(store, settings, [pipeline])[0]


def backlog_of(reading: BacklogReading, pipeline: str, settings: KilnSettings) -> PipelineBacklog:
    """One pipeline's backlog from a reading that holds its lanes' queues."""
    lanes = {lane: reading.queues[queue_name(lane, pipeline)] for lane in LANES}
    timed = sum(q.timed for q in lanes.values())
    job_gpu_s = (
        sum(q.run_s for q in lanes.values()) / timed if timed else settings.job_gpu_s_unknown
    )
    queued = {str(lane): q.queued for lane, q in lanes.items()}
    queued_gpu_s = {lane: n * job_gpu_s for lane, n in queued.items()}
    busy = len(frozenset().union(*(q.holders for q in lanes.values())))
    wanted = queue_nodes(sum(queued.values()), queued_gpu_s, lane_targets(settings))
    return PipelineBacklog(
        pipeline=pipeline,
        now=reading.now,
        queued=queued,
        queued_gpu_s=queued_gpu_s,
        job_gpu_s=job_gpu_s,
        running_jobs=sum(q.running for q in lanes.values()),
        busy_nodes=busy,
        desired_nodes=desired_nodes(busy, wanted, settings.desired_nodes_max),
        expected_wait_s={
            str(lane): _expected_wait(lanes, lane, reading.now, settings.bulk_share_every)
            for lane in LANES
        },
    )


def _expected_wait(
    lanes: Mapping[Lane, QueueBacklog], lane: Lane, now: float, bulk_share_every: int
) -> float | None:
    """The ETA model's expected start of a job entering `lane` now (at the back of its queue)."""
    own, other = lanes[lane], next(q for each, q in lanes.items() if each != lane)
    starts = [q.earliest_start for q in lanes.values() if q.earliest_start]
    snapshot = QueueSnapshot(
        rank=own.queued,
        other_size=other.queued,
        paused=own.paused,
        other_paused=other.paused,
        finished=sum(q.finished for q in lanes.values()),
        earliest_start=min(starts) if starts else None,
        now=now,
    )
    estimate = estimate_from(snapshot, lane, bulk_share_every)
    return estimate.estimated_start_s if estimate else None


def node_counts(live_nodes: Iterable[Mapping[str, Any]], pipeline: str) -> NodeCounts:
    """How many live nodes (heartbeats) serve `pipeline`, asleep and draining among them."""
    serving = [n for n in live_nodes if pipeline in n.get("pipelines", [])]
    return NodeCounts(
        live=len(serving),
        asleep=sum(1 for n in serving if n.get("asleep")),
        draining=sum(1 for n in serving if n.get("draining")),
    )


@dataclass(frozen=True)
class LateStart:
    """Why a job cannot start in time: its budget, its lane's expected wait, when to retry."""

    pipeline: str
    lane: str
    budget_s: float
    expected_wait_s: float
    retry_after_s: int
    deadline: str  # what set the budget: the job's start_by or its lane's target

    def message(self) -> str:
        """The 429's detail, naming why."""
        return (
            f"pipeline {self.pipeline!r}: a new {self.lane} job is expected to start in "
            f"{self.expected_wait_s:g} s (the current backlog at the recent completion rate), "
            f"later than {self.deadline} allows ({self.budget_s:.1f} s from now); retry after "
            f"{self.retry_after_s} s"
        )


def needs_admission(lane: str, start_by: float | None, settings: KilnSettings) -> bool:
    """Whether a job's start is checked against the backlog: an interactive one with a deadline.

    Bulk may wait: it is never refused for latency.
    """
    return lane != Lane.bulk and (start_by is not None or settings.admit_by_target)


def late_start(
    backlog: PipelineBacklog,
    lane: str,
    start_by: float | None,
    settings: KilnSettings,
    now: float,
) -> LateStart | None:
    """The refusal of a job the backlog cannot start in time, or None to admit it.

    Admitted: bulk jobs, jobs with no deadline (no start_by, and no lane target applies), a
    start_by already past (the job expires as before: a retry would not help), and any job
    while the lane has no expected wait (nothing ended lately, or a paused queue).
    """
    if not needs_admission(lane, start_by, settings):
        return None
    if start_by is not None:
        budget, deadline = start_by - now, "its start_by"
    else:
        budget = lane_targets(settings)[lane]
        deadline = f"the {lane} lane's target start (KILN_TARGET_START_S_{lane.upper()})"
    wait = backlog.expected_wait_s.get(lane)
    if wait is None or budget <= 0 or wait <= budget:
        return None
    retry = max(1, math.ceil(wait - budget))
    return LateStart(backlog.pipeline, lane, budget, wait, retry, deadline)


class BacklogCache:
    """Per pipeline, the last backlog read, answering for `ADMISSION_READ_S`."""

    def __init__(self, store: BacklogOps, settings: KilnSettings) -> None:
        self.store = store
        self.settings = settings
        self._read: dict[str, tuple[float, PipelineBacklog]] = {}  # pipeline -> (when, what)

    def is_fresh(self, pipeline: str) -> bool:
        """Whether `now(pipeline)` answers without reading Redis."""
        read = self._read.get(pipeline)
        return read is not None and time.monotonic() - read[0] < ADMISSION_READ_S

    def now(self, pipeline: str) -> tuple[PipelineBacklog, float]:
        """The pipeline's backlog, and the Redis clock now (its read time plus the time since)."""
        if not self.is_fresh(pipeline):  # keys: known pipeline names only (checked before)
            self._read[pipeline] = (
                time.monotonic(),
                read_backlog(self.store, self.settings, pipeline),
            )
        when, backlog = self._read[pipeline]
        return backlog, backlog.now + (time.monotonic() - when)
