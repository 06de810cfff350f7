"""Stages a job's task thread hands to the progress writer: in order, never waited for."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import wait
from typing import Any

import pytest

from kiln.storage.job_store import JobStore, NewJob
from kiln.tasks.contract.events import PreviewPayload, ProgressData
from kiln.tasks.node import progress_writer
from kiln.tasks.node.progress_writer import PendingPreview, PendingProgress, ProgressWriter
from kiln.tasks.webhooks.event_sink import EventNote, EventSink, JobEvents


def running_job(store: JobStore, job_id: str, sink: EventSink | None = None) -> JobEvents:
    store.create_job(NewJob(id=job_id, request={"pipeline": "tiny"}))
    token = store.acquire_lease(job_id, "node/1")
    store.start(job_id, token)
    return (sink or EventSink(store)).job(job_id, token)


def progress(events: JobEvents, stage: str, step: int, total: int | None = None) -> PendingProgress:
    fields = {"stage": stage, "step": step} | ({} if total is None else {"total": total})
    return PendingProgress(events, ProgressData.model_validate(fields))


def stages(store: JobStore, job_id: str) -> list[str]:
    return [e.payload["stage"] for e in store.events(job_id) if e.type == "progress"]


@pytest.fixture
def writer() -> Iterator[ProgressWriter]:
    """A started writer whose throttle never flushes by itself; stopped afterwards."""
    started = ProgressWriter(interval_s=60.0)
    started.start()
    yield started
    started.stop()


def test_handed_over_stages_are_written_in_order_and_settle_waits_for_them(
    job_store: JobStore,
    writer: ProgressWriter,
) -> None:
    sink = EventSink(job_store)
    events = running_job(job_store, "s1", sink)
    gate = threading.Event()
    heard: list[EventNote] = []

    def held_at_the_gate(note: EventNote) -> None:  # the sink's listener: after the first write
        heard.append(note)
        if len(heard) == 1:
            gate.wait(30)

    sink.add_listener(held_at_the_gate)
    try:
        encoding = progress(events, "encoding", 1, 1)
        writer.write_soon("s1", encoding)  # its write then blocks in the listener until the gate
        uploading = progress(events, "uploading", 1, 1)
        writer.write_soon("s1", uploading)  # returns at once: the task thread never waits here
        assert stages(job_store, "s1") in ([], ["encoding"])
        gate.set()
        writer.settle("s1")
        assert stages(job_store, "s1") == ["encoding", "uploading"]
        assert job_store.get("s1").progress == {"stage": "uploading", "step": 1, "total": 1}
        assert heard == [EventNote("s1", "progress")] * 2
    finally:
        gate.set()


def test_settle_drops_unwritten_step_progress_after_the_stages(
    job_store: JobStore, writer: ProgressWriter
) -> None:
    events = running_job(job_store, "s2")
    writer.write_soon("s2", progress(events, "encoding", 1))
    writer.settle("s2")
    writer.update("s2", progress(events, "decoding", 4), False)
    writer.settle("s2")  # the terminal transition follows: nothing may be written after it
    writer.flush()
    assert stages(job_store, "s2") == ["encoding"]


def test_a_stage_handed_over_after_stop_is_written_on_the_callers_thread(
    job_store: JobStore,
    writer: ProgressWriter,
) -> None:
    events = running_job(job_store, "s3")
    writer.stop()  # the node is going down while a job still uploads
    writer.write_soon("s3", progress(events, "uploading", 1))
    assert stages(job_store, "s3") == ["uploading"]


def test_settle_runs_the_calls_not_yet_begun_itself_in_order(
    monkeypatch: pytest.MonkeyPatch,
    writer: ProgressWriter,
) -> None:
    began, gate = threading.Event(), threading.Event()
    ran: list[tuple[str, str]] = []

    def call(name: str) -> Callable[[], None]:
        def run() -> None:
            if name == "first":
                began.set()
                gate.wait(30)
            ran.append((name, threading.current_thread().name))

        return run

    def opening_the_gate(futures: Any) -> Any:  # settle waits for what the thread began
        gate.set()
        return wait(futures)

    monkeypatch.setattr(progress_writer, "wait", opening_the_gate)
    try:
        writer.call_soon("j", call("first"))
        assert began.wait(30)  # the ordered thread is inside the first call
        writer.call_soon("j", call("second"))
        writer.call_soon("j", call("third"))
        writer.settle("j")
        here = threading.current_thread().name
        assert [name for name, _ in ran] == ["first", "second", "third"]
        assert ran[0][1].startswith("kiln-progress-stage")
        assert [thread for _, thread in ran[1:]] == [here, here]  # taken back, not waited for
    finally:
        gate.set()


def test_settle_writes_the_newest_preview_after_the_one_being_written(
    job_store: JobStore,
    writer: ProgressWriter,
) -> None:
    events = running_job(job_store, "p1")
    began, gate = threading.Event(), threading.Event()

    def preview(step: int) -> PendingPreview:
        def payload() -> PreviewPayload:
            if step == 1:  # the writer thread is inside this preview's encoding
                began.set()
                gate.wait(30)
            return PreviewPayload(
                step=step, total=2, width=8, height=8, format="webp",
                content_type="image/webp", image_b64="UklGRg==", url=None,
            )  # fmt: skip

        return PendingPreview(events, payload)

    try:
        writer.preview("p1", preview(1))
        assert began.wait(30)
        writer.preview("p1", preview(2))  # the last step's, while the writer is busy
        settling = threading.Thread(target=writer.settle, args=("p1",))
        settling.start()
        settling.join(2.0)  # settle waits for the preview being written (it may not drop it)
        gate.set()
        settling.join(30)
        assert not settling.is_alive()
        # before the terminal transition: the last step's preview is the newest one written
        steps = [e.payload["step"] for e in job_store.events("p1") if e.type == "preview"]
        assert steps[-1:] == [2], steps
    finally:
        gate.set()
