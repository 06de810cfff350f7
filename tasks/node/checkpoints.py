"""A job's step checkpoints on its node: the plan its group runs, and the writer of what it takes.

Which jobs: a job whose request names a cadence (`checkpoint`: every N steps or S seconds) gets
that one, image or video; any other video job (more than one frame: the runs that take minutes)
one at most every `checkpoint_every_s` seconds (30 s; 0 turns them off), so a job shorter than
that writes none; any other image job none. Any job whose record names checkpoints an earlier
attempt wrote is offered them, whatever the setting: its group resumes from the newest valid one
(gpu_worker's ranks/checkpoints.py), or from step 0 when none is.

The group hands each checkpoint to `CheckpointWriter.hand` on its monitor thread, between steps:
the writer keeps only the newest one waiting and writes it on its own thread, into this
attempt's folder, recorded under this attempt's lease token (storage/checkpoints.py). A write
that fails is logged and the next one tried; a lost lease ends the writing (the attempt is over).
A checkpoint never fails the job. Each one written is told to `on_written` with its write's
seconds (the node's `kiln_checkpoints_written_total` and write histograms).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kiln.gpu_worker.protocol import CheckpointPlan, StepCheckpoint
from kiln.storage.checkpoints import CheckpointRef, Checkpoints
from kiln.storage.errors import StaleLease, StorageError
from kiln.tasks.contract.job_spec import JobSpec

log = logging.getLogger(__name__)


def takes_checkpoints(spec: JobSpec, every_s: float) -> bool:
    """Whether a job's run takes checkpoints: its request's cadence, or the node's for a video."""
    return spec.checkpoint is not None or (spec.num_frames > 1 and every_s > 0)


def checkpoint_plan(
    spec: JobSpec, offered: tuple[bytes, ...], every_s: float, *, resumable: bool = True
) -> CheckpointPlan | None:
    """The plan of a job's run: None when it neither resumes nor takes checkpoints.

    `resumable`: whether its pipeline announced step checkpoints (`x-kiln-checkpoints`); a job
    of one that did not gets none (its group would drop the plan anyway) and batches as before.
    """
    takes = resumable and takes_checkpoints(spec, every_s)
    if not takes and not (resumable and offered):
        return None
    if not takes:
        return CheckpointPlan(resume=offered)
    if spec.checkpoint is not None:
        cadence = spec.checkpoint
        return CheckpointPlan(offered, cadence.every_steps, cadence.every_seconds)
    return CheckpointPlan(resume=offered, every_seconds=every_s)


class CheckpointWriter:
    """Writes one attempt's checkpoints off the group's thread, the newest waiting one first."""

    def __init__(
        self,
        checkpoints: Checkpoints,
        job_id: str,
        lease_token: int,
        attempt: str,
        on_written: Callable[[CheckpointRef, float], None] | None = None,
    ):
        self._checkpoints = checkpoints
        self._on_written = on_written
        self._job_id = job_id
        self._lease_token = lease_token
        self._attempt = attempt
        self._cond = threading.Condition()
        self._waiting: StepCheckpoint | None = None
        self._closed = False
        self.written: list[CheckpointRef] = []
        self._thread = threading.Thread(target=self._run, name=f"checkpoints-{job_id}", daemon=True)
        self._thread.start()

    def hand(self, checkpoint: StepCheckpoint) -> None:
        """Take a checkpoint to write (an older one still waiting is dropped: this one is newer)."""
        with self._cond:
            self._waiting = checkpoint
            self._cond.notify()

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what still waits, then stop (at most `timeout_s`)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._closed:
                    self._cond.wait()
                checkpoint, self._waiting = self._waiting, None
            if checkpoint is None:
                return  # closed, nothing left
            if not self._write(checkpoint):
                return

    def _write(self, checkpoint: StepCheckpoint) -> bool:
        """Write one; False when this attempt may write no more."""
        began = time.monotonic()
        try:
            ref = self._checkpoints.write(
                self._job_id,
                self._lease_token,
                self._attempt,
                checkpoint.steps_done,
                checkpoint.data,
            )
        except StaleLease:
            log.warning("job %s: lease lost; its checkpoints are no longer written", self._job_id)
            return False
        except (StorageError, ValueError) as exc:
            log.warning(
                "job %s: checkpoint after step %d not written: %s",
                self._job_id,
                checkpoint.steps_done,
                exc,
            )
            return True
        self.written.append(ref)
        if self._on_written is not None:
            self._on_written(ref, time.monotonic() - began)
        return True
