"""The SIGTERM drain of a node (docs/operations.md §4): what goes back to the queue at once.

A Kubernetes scale-down or rollout, a spot machine's preemption notice (tasks/node/preemption.py)
or a plain `kill` sends SIGTERM; the node then takes nothing new and:

- hands back at once every job it holds that has not started, and every running job whose run
  takes step checkpoints (its pipeline announced them, and its request got a plan:
  tasks/node/checkpoints.py). Its group stops it at its next step boundary after checkpointing
  that very step (the coordinator's verdict names it in `checkpoint_ids`), the checkpoint is
  written under the attempt's lease, and the job is queued again: its next attempt, on any node,
  resumes from that step, so the drain loses no step and costs at most one step of waiting. One
  whose every step ran (the drain read at its last step, or after) ends here as it would have:
  its last step's state is its output, of which no checkpoint is taken;
- lets a running job that takes no checkpoints (an image job, a pipeline whose loop cannot
  resume) go on for up to `KILN_DRAIN_GRACE_S`, since stopping it would throw its progress away;
  one still running then is handed back (and restarts from step 0 elsewhere).

Once its jobs are back or done, the Celery worker's warm shutdown ends and the node exits.
"""

from __future__ import annotations

import logging
import threading

from kiln.common.request import pipeline_takes_checkpoints
from kiln.common.stops import StopReason
from kiln.storage.checkpoints import recorded_checkpoints
from kiln.storage.errors import StorageError
from kiln.tasks.contract.job_spec import JobSpec, JobSpecRefused
from kiln.tasks.node.checkpoints import takes_checkpoints
from kiln.tasks.node.node import Node, TrackedJob

log = logging.getLogger(__name__)


def runs_with_checkpoints(node: Node, job_id: str) -> bool:
    """Whether the job's run on this node takes step checkpoints (so it can stop at any step)."""
    try:
        record = node.store.get(job_id)
        spec = JobSpec.decode(record.request)
        offered = bool(recorded_checkpoints(node.store, job_id))
    except (StorageError, JobSpecRefused) as exc:
        log.warning(
            "job %s: whether it takes checkpoints is unknown (%s): it gets the grace", job_id, exc
        )
        return False
    if not pipeline_takes_checkpoints(node.pipeline_inputs(), spec.pipeline):
        return False
    return offered or takes_checkpoints(spec, node.settings.checkpoint_every_s)


def hand_back_at_once(node: Node) -> list[TrackedJob]:
    """Hand back the jobs that lose nothing by it: those not started, those that checkpoint."""
    handed: list[TrackedJob] = []
    for tracked in node.tracked_jobs():
        if tracked.stop_reason is not None:
            continue
        # one whose start is under way counts as started: its record may say running already
        running = tracked.started or tracked.starting
        if running and not runs_with_checkpoints(node, tracked.job_id):
            continue
        tracked.stop_reason = StopReason.HANDED_BACK
        handed.append(tracked)
    return handed


def start_drain(node: Node, grace_s: float) -> threading.Timer:
    """SIGTERM's drain: take nothing new, hand back what loses nothing, the rest after the grace.

    The returned timer (started) hands back every job still running after `grace_s`.
    """
    node.controls.shutting_down = True  # an operator's undrain cannot undo this one
    node.draining.set()
    handed = hand_back_at_once(node)
    if handed:
        log.info(
            "node %s draining: %d job(s) handed back at their next step (%s)",
            node.node_id,
            len(handed),
            ", ".join(t.job_id for t in handed),
        )
    timer = threading.Timer(grace_s, node.hand_back_all)
    timer.daemon = True
    timer.start()
    return timer
