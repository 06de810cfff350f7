"""Priority preemption: the cluster's decision to suspend a bulk job for a late interactive one.

Every tick, per pipeline whose queues the process watches: when the oldest interactive jobs have
waited past `KILN_TARGET_START_S_INTERACTIVE` and every live node serving the pipeline is busy
with bulk jobs only (none idle, none running interactive work), one bulk job per late job is
asked to stop at its next step boundary (docs/operations.md §20): its stop request, the one a
cancel and a pause write, which its node's cancel watch reads. Only a job whose run takes step
checkpoints is chosen (its node lists it in its heartbeat: `checkpointing_jobs`), so its node
checkpoints the very step it stops at and it resumes with nothing recomputed; the job goes back to
the head of its lane, its attempt not counted (storage/lua/preempted.lua). A node whose heartbeat
does not list `preempted` in `stops_read` (one of an earlier release, which read any stop request
but a pause as a cancel) is asked for none.

Which one: a late job that a node holds already (waiting in it, its delivery taken) needs that
node's group; otherwise a node holding no other waiting job frees its group for the late job's
message, which it then fetches (nodes serve interactive queues first: tasks/queue/lanes.py). Of a
node's candidates, the one preempted fewest times, then the one started last.

The guard: a job is preempted at most `KILN_PRIORITY_PREEMPTION_MAX` times and only after running
`KILN_PRIORITY_PREEMPTION_MIN_RUN_S` since its latest start, checked with the request in one
script (storage/lua/preempt_request.lua) from what its record says, so it holds across restarts
and across control processes deciding at once (each waiting job claims one preemption at a time).
Nothing happens while any node serving the pipeline is idle (it takes the interactive job) or
runs interactive work (it is next), or with `KILN_PRIORITY_PREEMPTION=false`.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.common.request import Lane
from kiln.common.stops import StopReason
from kiln.storage.preemption import PreemptionOps, RunningJob, WaitingJob
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.control.context import ControlContext
from kiln.tasks.queue.lanes import lane_and_pipeline, queue_name

log = logging.getLogger(__name__)

# late interactive jobs looked at per pipeline and tick (each needs a node of its own)
WAITING_READ = 32
# a claim outlives the stop and the late job's start at least this long (s)
CLAIM_MIN_S = 10.0


@dataclass(frozen=True)
class Preemption:
    """One decision: suspend `job_id` (running on `node`) so that `for_job` can start."""

    job_id: str
    node: str
    for_job: str


@dataclass(frozen=True)
class NodeState:
    """A live node serving the pipeline, as its heartbeat and the running jobs say."""

    node_id: str
    waiting: int  # jobs it holds that its group has not started
    checkpointing: frozenset[str]  # its running jobs whose run takes step checkpoints
    reads_preemptions: bool = True  # its cancel watch stops a job for a preemption request


def choose(
    late: Sequence[WaitingJob],
    nodes: Sequence[NodeState],
    running: Sequence[RunningJob],
    bulk_queue: str,
    now: float,
    settings: KilnSettings,
) -> list[Preemption]:
    """The preemptions that let `late` (oldest first) start: none unless every node is bulk-busy.

    `running`: every running job (of any queue); a node running none is idle, one running a job
    outside the bulk lane is busy with interactive work: either way nothing is preempted.
    """
    by_node: dict[str, list[RunningJob]] = defaultdict(list)
    for job in running:
        if job.node is not None:
            by_node[job.node].append(job)
    for node in nodes:
        jobs = by_node.get(node.node_id, [])
        if not jobs or any(lane_and_pipeline(job.queue)[0] != Lane.bulk for job in jobs):
            return []
    serving = {node.node_id: node for node in nodes}
    # a node that reads no preemption request (an earlier release's) offers no job and is no
    # place to free: its watch would take the request for a cancel
    askable = [node.node_id for node in nodes if node.reads_preemptions]
    candidates = {
        node.node_id: [
            job
            for job in by_node[node.node_id]
            if node.reads_preemptions
            and job.queue == bulk_queue
            and job.job_id in node.checkpointing
            and job.preemptions < settings.priority_preemption_max
            and now - job.started_at >= settings.priority_preemption_min_run_s
        ]
        for node in nodes
    }
    chosen: list[Preemption] = []
    for waiting in late:
        if waiting.holder in serving:
            places = [waiting.holder]  # its delivery waits in that node for its group
        else:
            free = [n for n in askable if serving[n].waiting == 0]
            places = free or askable
        pick = _best([job for place in places for job in candidates[place]])
        if pick is None:
            continue
        assert pick.node is not None
        candidates[pick.node].remove(pick)
        chosen.append(Preemption(pick.job_id, pick.node, waiting.job_id))
    return chosen


def _best(jobs: Sequence[RunningJob]) -> RunningJob | None:
    """The job preempted fewest times, then the one started last."""
    return min(jobs, key=lambda job: (job.preemptions, -job.started_at), default=None)


def _node_state(info: dict[str, Any]) -> NodeState:
    return NodeState(
        node_id=str(info.get("node_id", "")),
        waiting=int(info.get("jobs_waiting") or 0),
        checkpointing=frozenset(str(j) for j in info.get("checkpointing_jobs") or []),
        reads_preemptions=StopReason.PREEMPTED in (info.get("stops_read") or []),
    )


def takes_work(info: dict[str, Any]) -> bool:
    """Whether a node's heartbeat says it takes new jobs: not draining, drained or quarantined.

    A node that takes none neither runs the late job nor counts as idle.
    """
    return not (info.get("draining") or info.get("drain") or info.get("quarantined"))


def preempt_for_late_jobs(ctx: ControlContext, queues: Sequence[str]) -> list[Preemption]:
    """One tick: ask for the preemptions late interactive jobs of `queues`' pipelines need."""
    settings = ctx.settings
    if not settings.priority_preemption or settings.priority_preemption_max <= 0:
        return []
    ops = PreemptionOps(ctx.store.redis, ctx.store.settings)
    pipelines = sorted(
        {pipeline for lane, pipeline in map(lane_and_pipeline, queues) if lane == Lane.interactive}
    )
    now = ops.redis_now()
    asked: list[Preemption] = []
    nodes_read: list[dict[str, Any]] | None = None
    running: list[RunningJob] | None = None
    for pipeline in pipelines:
        late = [
            job
            for job in ops.waiting(queue_name(Lane.interactive, pipeline), WAITING_READ)
            if now - job.created_at > settings.target_start_s_interactive
        ]
        if not late:
            continue
        if nodes_read is None:  # read once per tick, and only when some job is late
            nodes_read, running = ctx.store.live_nodes(), ops.running_in(None)
        assert running is not None
        nodes = [
            _node_state(info)
            for info in nodes_read
            if pipeline in info.get("pipelines", []) and takes_work(info)
        ]
        if not nodes:
            continue  # no node serves it: the autoscaler's signal, not preemption's
        bulk_queue = queue_name(Lane.bulk, pipeline)
        for choice in choose(late, nodes, running, bulk_queue, now, settings):
            if ops.request_preemption(
                choice.job_id,
                choice.for_job,
                cap=settings.priority_preemption_max,
                min_run_s=settings.priority_preemption_min_run_s,
                ttl_s=claim_ttl_s(settings),
            ):
                log.info(
                    "job %s (bulk, on %s) preempted for interactive job %s, waiting past %g s",
                    choice.job_id,
                    choice.node,
                    choice.for_job,
                    settings.target_start_s_interactive,
                )
                asked.append(choice)
    return asked


def claim_ttl_s(settings: KilnSettings) -> float:
    """How long a preemption request and its waiting job's claim live."""
    return max(
        settings.priority_preemption_min_run_s, settings.target_start_s_interactive, CLAIM_MIN_S
    )


def preemption_step(ctx: ControlContext, queues: Callable[[], Sequence[str]]) -> Callable[[], None]:
    """The control room's step: `preempt_for_late_jobs` over the queues watched now."""

    def step() -> None:
        preempt_for_late_jobs(ctx, queues())

    return step
