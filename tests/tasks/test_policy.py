"""Run policies (queue.policy) and the progress writer (node.progress_writer)."""

from __future__ import annotations

import time

import pytest

from kiln.storage.job_store import JobStore, NewJob
from kiln.tasks.contract.events import ProgressData
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.node.progress_writer import PendingProgress, ProgressWriter
from kiln.tasks.node.worker import parse_lanes, parse_pipelines
from kiln.tasks.queue.policy import error_dict, retry_delay
from kiln.tasks.webhooks.event_sink import EventNote, EventSink, JobEvents


def test_retry_delay_doubles_and_is_capped() -> None:
    settings = KilnSettings(retry_backoff_s=2.0, retry_backoff_max_s=10.0)
    for attempt, ceiling in ((1, 2.0), (2, 4.0), (3, 8.0), (4, 10.0), (9, 10.0)):
        delays = [retry_delay(attempt, settings) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays), (attempt, delays)


def running_job(store: JobStore, job_id: str, sink: EventSink | None = None) -> JobEvents:
    store.create_job(NewJob(id=job_id, request={"pipeline": "tiny"}))
    token = store.acquire_lease(job_id, "node/1")
    store.start(job_id, token)
    return (sink or EventSink(store)).job(job_id, token)


def progress(events: JobEvents, stage: str, step: int, total: int | None = None) -> PendingProgress:
    fields = {"stage": stage, "step": step} | ({} if total is None else {"total": total})
    return PendingProgress(events, ProgressData.model_validate(fields))


def test_progress_writer_writes_only_the_newest_progress(job_store: JobStore) -> None:
    sink = EventSink(job_store)
    written: list[EventNote] = []
    sink.add_listener(written.append)
    events = running_job(job_store, "p1", sink)
    writer = ProgressWriter(interval_s=60.0)
    for step in range(1, 6):
        writer.update("p1", progress(events, "denoising", step, 5), False)
    writer.flush()
    progress_events = [e for e in job_store.events("p1") if e.type == "progress"]
    assert [e.payload["step"] for e in progress_events] == [5]
    assert job_store.get("p1").progress == {"stage": "denoising", "step": 5, "total": 5}
    assert written == [EventNote("p1", "progress")]


def test_progress_writer_thread_flushes_urgent_updates(job_store: JobStore) -> None:
    events = running_job(job_store, "p2")
    writer = ProgressWriter(interval_s=60.0)
    writer.start()
    try:
        writer.update("p2", progress(events, "encoding", 1, 1), urgent=True)
        deadline = time.monotonic() + 10
        while job_store.get("p2").progress is None:
            assert time.monotonic() < deadline, "urgent progress never written"
            time.sleep(0.01)
    finally:
        writer.stop()


def test_progress_writer_discard_and_stale_token(job_store: JobStore) -> None:
    events = running_job(job_store, "p3")
    writer = ProgressWriter(interval_s=60.0)
    writer.update("p3", progress(events, "denoising", 1), False)
    writer.discard("p3")
    unknown = EventSink(job_store).job("p4", 999)
    writer.update("p4", progress(unknown, "denoising", 1), False)
    writer.flush()  # an unknown job or a stale token is skipped, never raised
    assert job_store.get("p3").progress is None


def test_error_dict_carries_type_and_retryable() -> None:
    from kiln.gpu_worker.errors import OutOfMemory, WorkerGroupDied

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
        with pytest.raises(ValueError, match="--pipeline"):
            parse_pipelines([bad])
    with pytest.raises(ValueError, match="urgent"):
        parse_lanes("interactive,urgent")


def test_progress_writer_write_now_supersedes_pending(job_store: JobStore) -> None:
    events = running_job(job_store, "p5")
    writer = ProgressWriter(interval_s=60.0)
    writer.update("p5", progress(events, "decoding", 4, 4), False)
    writer.write_now("p5", progress(events, "encoding", 1, 1))
    writer.flush()  # nothing older may land after the newer stage
    assert job_store.get("p5").progress == {"stage": "encoding", "step": 1, "total": 1}
    stages = [e.payload["stage"] for e in job_store.events("p5") if e.type == "progress"]
    assert stages == ["encoding"]
