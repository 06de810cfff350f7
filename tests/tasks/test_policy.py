"""Named run policies: retry backoff, progress throttling, cancel polling (tasks.policy)."""

from __future__ import annotations

import time

from storage.status import JobStore, NewJob
from tasks.policy import CancelCheck, ProgressThrottle, error_dict, retry_delay
from tasks.settings import KilnSettings
from tasks.worker import parse_lanes, parse_pipelines


def test_retry_delay_doubles_and_is_capped() -> None:
    settings = KilnSettings(retry_backoff_s=2.0, retry_backoff_max_s=10.0)
    for attempt, ceiling in ((1, 2.0), (2, 4.0), (3, 8.0), (4, 10.0), (9, 10.0)):
        delays = [retry_delay(attempt, settings) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays), (attempt, delays)


def test_progress_throttle_passes_stage_changes_and_last_steps() -> None:
    throttle = ProgressThrottle(interval_s=60.0)
    assert throttle.due("denoising", last_step=False)
    assert not throttle.due("denoising", last_step=False)
    assert throttle.due("denoising", last_step=True)
    assert throttle.due("encoding", last_step=False)


def test_cancel_check_reads_the_real_flag(job_store: JobStore) -> None:
    job_store.create_job(NewJob(id="j1", request={"pipeline": "tiny"}))
    token = job_store.acquire_lease("j1", "node/1")
    job_store.start("j1", token)
    check = CancelCheck(job_store, "j1", poll_s=0.0)
    assert not check()
    job_store.cancel("j1")
    assert check()
    assert check()  # once seen it stays set, without another read


def test_cancel_check_polls_at_most_every_poll_interval(job_store: JobStore) -> None:
    job_store.create_job(NewJob(id="j2", request={"pipeline": "tiny"}))
    token = job_store.acquire_lease("j2", "node/1")
    job_store.start("j2", token)
    check = CancelCheck(job_store, "j2", poll_s=30.0)
    assert not check()
    job_store.cancel("j2")
    assert not check()  # within the poll interval the last answer stands
    check._checked_at = time.monotonic() - 31
    assert check()


def test_error_dict_carries_type_and_retryable() -> None:
    from gpu_worker.errors import OutOfMemory, WorkerGroupDied

    assert error_dict(WorkerGroupDied("rank 1 died")) == {
        "type": "WorkerGroupDied",
        "message": "rank 1 died",
        "retryable": True,
    }
    assert error_dict(OutOfMemory("lower the size"))["retryable"] is False


def test_worker_options_parse_and_refuse_mistakes() -> None:
    assert parse_pipelines(["tiny", "default=tiny", "sd=diffusers:/m/sd3"]) == {
        "tiny": "tiny",
        "default": "tiny",
        "sd": "diffusers:/m/sd3",
    }
    assert parse_lanes("interactive,bulk") == ("interactive", "bulk")
    for bad in ("=tiny", "x="):
        try:
            parse_pipelines([bad])
        except ValueError as exc:
            assert "--pipeline" in str(exc)
        else:
            raise AssertionError(f"{bad!r} accepted")
    try:
        parse_lanes("interactive,urgent")
    except ValueError as exc:
        assert "urgent" in str(exc)
    else:
        raise AssertionError("unknown lane accepted")
