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
that fails transiently (the store or Redis unreachable: a retryable StorageError) is tried again
after a doubling pause, until a newer checkpoint waits (that one is written instead) or until it
could not end before `close`'s limit: the checkpoint a drain, pause or preemption takes of the
step it stops at is written just before the close, and a lost one makes the next attempt resume
from an older one. Any other failure is logged and the next one tried; a lost lease ends the
writing (the attempt is over, and a fenced write is never tried again). A checkpoint never fails
the job. Each one written is told to `on_written` with its write's
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
from kiln.tasks.contract.backoff import doubling_delay
from kiln.tasks.contract.job_spec import JobSpec

log = logging.getLogger(__name__)

RETRY_PAUSE_S = 0.5  # before a write's second try; doubled for each later one
MAX_RETRY_PAUSE_S = 8.0
LAST_TRY_S = 5.0  # a try begins at least this long before close's limit: its own time to end


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
        self._retry_until: float | None = None  # set by close: no try begins after it
        self.written: list[CheckpointRef] = []
        self._thread = threading.Thread(target=self._run, name=f"checkpoints-{job_id}", daemon=True)
        self._thread.start()

    def hand(self, checkpoint: StepCheckpoint) -> None:
        """Take a checkpoint to write (an older one still waiting is dropped: this one is newer)."""
        with self._cond:
            self._waiting = checkpoint
            self._cond.notify()

    def close(self, timeout_s: float = 30.0) -> bool:
        """Write what still waits, then stop (at most `timeout_s`); whether the writer ended.

        A failing write is tried again only while a try can end by then (`LAST_TRY_S`).
        """
        with self._cond:
            self._closed = True
            self._retry_until = time.monotonic() + timeout_s - LAST_TRY_S
            self._cond.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

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
        """Write one, trying a transient failure again; False: this attempt may write no more."""
        began = time.monotonic()
        tries = 0
        while True:
            tries += 1
            try:
                ref = self._checkpoints.write(
                    self._job_id,
                    self._lease_token,
                    self._attempt,
                    checkpoint.steps_done,
                    checkpoint.data,
                )
            except StaleLease:
                log.warning(
                    "job %s: lease lost; its checkpoints are no longer written", self._job_id
                )
                return False
            except (StorageError, ValueError) as exc:
                if self._tries_again(checkpoint, tries, exc):
                    continue
                return True
            self.written.append(ref)
            if self._on_written is not None:
                self._on_written(ref, time.monotonic() - began)
            return True

    def _tries_again(self, checkpoint: StepCheckpoint, tries: int, exc: Exception) -> bool:
        """After a failed try: pause and say True to try again, or log it given up (False)."""
        pause_s = doubling_delay(tries, RETRY_PAUSE_S, MAX_RETRY_PAUSE_S)
        if isinstance(exc, StorageError) and exc.retryable and self._pause(pause_s):
            log.info(
                "job %s: checkpoint after step %d, try %d failed (%s); trying again",
                self._job_id,
                checkpoint.steps_done,
                tries,
                exc,
            )
            return True
        log.warning(
            "job %s: checkpoint after step %d not written (%d tries): %s",
            self._job_id,
            checkpoint.steps_done,
            tries,
            exc,
        )
        return False

    def _pause(self, pause_s: float) -> bool:
        """Wait `pause_s` before trying a write again; False: give it up.

        Given up when a newer checkpoint waits (it replaces this one) or when, the writer
        closing, the next try would begin after close's limit.
        """
        resume_at = time.monotonic() + pause_s
        with self._cond:
            while True:
                if self._waiting is not None:
                    return False
                if self._retry_until is not None and resume_at > self._retry_until:
                    return False
                left_s = resume_at - time.monotonic()
                if left_s <= 0:
                    return True
                self._cond.wait(left_s)
