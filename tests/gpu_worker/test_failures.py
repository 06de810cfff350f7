"""Failure modes on a 2-rank group of fixture pipelines.

Every one ends in the right error type, and the same coordinator serves the next request
(rebuilding the group where it must).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.errors import (
    DeadlineExceeded,
    JobFailed,
    JobStopped,
    OutOfMemory,
    RankStartupFailed,
    UnsupportedRequest,
    WorkerGroupDied,
)
from kiln.gpu_worker.protocol import GenerationRequest
from tests.gpu_worker.conftest import (
    FIXTURE_PIPELINES,
    GENEROUS_S,
    process_gone,
    request,
    start_coordinator,
)
from tests.gpu_worker.fixtures import fails_to_load, ooms, raises, spec
from tests.gpu_worker.fixtures.base import STEP_LOG_ENV
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def step_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The step log the ranks append to (named in the environment they inherit)."""
    path = tmp_path_factory.mktemp("failure-logs") / "steps.log"
    saved = os.environ.get(STEP_LOG_ENV)
    os.environ[STEP_LOG_ENV] = str(path)
    yield path
    if saved is None:
        os.environ.pop(STEP_LOG_ENV, None)
    else:
        os.environ[STEP_LOG_ENV] = saved


@pytest.fixture(scope="module")
def coordinator(step_log: Path) -> Iterator[Coordinator]:
    """Shared by the tests below; the ones that break the group leave it rebuilt."""
    del step_log  # requested so the log path is in the environment before the ranks spawn
    coordinator = start_coordinator(
        "cpu:2",
        FIXTURE_PIPELINES,
        deadline_grace_s=1.0,
        desync_grace_s=2.0,
        collective_timeout_s=60.0,
    )
    yield coordinator
    coordinator.shutdown()


def run(coordinator: Coordinator, req: GenerationRequest, **options: object) -> object:
    """Submit and wait; returns the result (raises what the future raises)."""
    return coordinator.submit(req, **options).result(GENEROUS_S)  # type: ignore[arg-type]


def still_serves(coordinator: Coordinator, pipeline: str) -> None:
    """An ordinary request to `pipeline` succeeds."""
    result = run(coordinator, request(f"after-{pipeline}-{os.urandom(3).hex()}", pipeline))
    assert result is not None


def rebuilds(coordinator: Coordinator) -> int:
    """How many times the coordinator rebuilt its group."""
    return int(coordinator.stats()["rebuilds"])


def steps_logged(step_log: Path, request_id: str) -> list[int]:
    """Steps the ranks logged for `request_id`."""
    lines = step_log.read_text().splitlines() if step_log.exists() else []
    return [int(line.split()[3]) for line in lines if line.split()[2] == request_id]


def test_pipeline_exception_fails_the_job_and_the_group_keeps_serving(
    coordinator: Coordinator,
) -> None:
    before = rebuilds(coordinator)
    with pytest.raises(JobFailed) as failure:
        run(coordinator, request("raise-1", "raises", "please raise"))
    assert type(failure.value) is JobFailed
    assert not failure.value.retryable
    assert raises.MESSAGE in str(failure.value)
    still_serves(coordinator, "raises")
    assert rebuilds(coordinator) == before


def test_out_of_memory_fails_with_advice_and_the_group_keeps_serving(
    coordinator: Coordinator,
) -> None:
    before = rebuilds(coordinator)
    with pytest.raises(OutOfMemory) as failure:
        run(coordinator, request("oom-1", "ooms", "oom please"))
    message = str(failure.value)
    assert not failure.value.retryable
    for advice in ("width/height", "num_frames", "num_outputs", "offload", "more GPUs"):
        assert advice in message
    assert ooms.MESSAGE in message
    still_serves(coordinator, "ooms")
    assert rebuilds(coordinator) == before


@pytest.mark.slow
def test_out_of_memory_on_one_rank_only_does_not_hang_the_group(coordinator: Coordinator) -> None:
    before = rebuilds(coordinator)
    # The last rank OOMs while rank 0 waits in an all-reduce for it: the ranks are out of step.
    with pytest.raises(OutOfMemory):
        run(coordinator, request("oom-last-1", "ooms", "oom-last"))
    still_serves(coordinator, "ooms")
    assert rebuilds(coordinator) == before + 1


@pytest.mark.slow
def test_a_rank_that_exits_mid_run_fails_in_flight_work_as_retryable(
    coordinator: Coordinator,
) -> None:
    before = rebuilds(coordinator)
    with pytest.raises(WorkerGroupDied) as failure:
        run(coordinator, request("exit-1", "exits", "exit now"))
    assert failure.value.retryable
    assert "rank 1" in str(failure.value)
    assert "exit code 3" in str(failure.value)
    still_serves(coordinator, "exits")
    assert rebuilds(coordinator) == before + 1


@pytest.mark.slow
def test_kill_9_of_a_follower_mid_request_then_the_group_is_rebuilt(
    coordinator: Coordinator,
) -> None:
    before = rebuilds(coordinator)
    old_pids = coordinator.stats()["pids"]
    future = coordinator.submit(request("killed-1", "hangs", "hang here"))
    wait_until(
        lambda: coordinator.stats()["jobs_running"], lambda n: n == 1, what="one job running"
    )
    os.kill(old_pids[1], signal.SIGKILL)
    with pytest.raises(WorkerGroupDied) as failure:
        future.result(GENEROUS_S)
    assert "killed by SIGKILL" in str(failure.value)
    still_serves(coordinator, "hangs")
    assert rebuilds(coordinator) == before + 1
    assert all(process_gone(pid) for pid in old_pids)
    assert set(coordinator.stats()["pids"]).isdisjoint(old_pids)


@pytest.mark.slow
def test_deadline_of_a_hung_step_kills_and_rebuilds_the_group(coordinator: Coordinator) -> None:
    before = rebuilds(coordinator)
    with pytest.raises(DeadlineExceeded):
        run(coordinator, request("hang-1", "hangs", "hang"), max_run_seconds=1.0)
    still_serves(coordinator, "hangs")
    assert rebuilds(coordinator) == before + 1


def test_deadline_of_a_long_job_stops_it_cooperatively(
    coordinator: Coordinator, step_log: Path
) -> None:
    before = rebuilds(coordinator)
    total = 2000  # 100 s of slow steps
    with pytest.raises(DeadlineExceeded):
        run(coordinator, request("long-1", "base", "slow", steps=total), max_run_seconds=1.0)
    assert 0 < max(steps_logged(step_log, "long-1")) < total
    assert rebuilds(coordinator) == before  # it stopped at a step: no kill was needed


def test_a_request_stopped_while_queued_never_runs(
    coordinator: Coordinator, step_log: Path
) -> None:
    busy = coordinator.submit(request("busy-1", "base", "slow", steps=10))
    stopped = coordinator.submit(request("queued-stop", "base"), should_stop=lambda: True)
    with pytest.raises(JobStopped):
        stopped.result(GENEROUS_S)
    busy.result(GENEROUS_S)
    assert steps_logged(step_log, "queued-stop") == []


def test_a_deadline_that_passes_in_the_queue_never_runs(
    coordinator: Coordinator, step_log: Path
) -> None:
    busy = coordinator.submit(request("busy-2", "base", "slow", steps=20))
    late = coordinator.submit(request("too-late", "base", size=32), max_run_seconds=0.2)
    with pytest.raises(DeadlineExceeded, match="before it could start"):
        late.result(GENEROUS_S)
    busy.result(GENEROUS_S)
    assert steps_logged(step_log, "too-late") == []


def test_stopping_one_request_of_a_batch_lets_its_batch_mates_finish(
    coordinator: Coordinator,
) -> None:
    busy = coordinator.submit(request("busy-3", "base", "slow", steps=10))
    seen: list[int] = []
    stopped = coordinator.submit(
        request("mate-stopped", "base", size=16, steps=6, seed=1),
        on_progress=lambda progress: seen.append(progress.step),
        should_stop=lambda: bool(seen) and seen[-1] >= 2,
    )
    finished = coordinator.submit(request("mate-finished", "base", size=16, steps=6, seed=2))
    busy.result(GENEROUS_S)
    with pytest.raises(JobStopped):
        stopped.result(GENEROUS_S)
    result = finished.result(GENEROUS_S)
    assert result.metrics is not None
    assert result.metrics.batch_size == 2
    assert [o.shape for o in result.outputs] == [(1, 16, 16, 3)]


def test_requests_the_group_cannot_serve_are_refused(coordinator: Coordinator) -> None:
    with pytest.raises(UnsupportedRequest, match="not served here"):
        run(coordinator, request("unknown-1", "no-such-pipeline"))
    with pytest.raises(UnsupportedRequest, match="multiples of 8"):
        run(coordinator, request("odd-size", "base", size=60))
    still_serves(coordinator, "base")


def test_start_reports_a_rank_that_fails_to_load() -> None:
    with pytest.raises(RankStartupFailed, match=fails_to_load.MESSAGE):
        start_coordinator("cpu:2", {"broken": spec("fails_to_load")})


def test_shutdown_fails_pending_work_and_leaves_no_process() -> None:
    coordinator = start_coordinator("cpu:2", {"hangs": spec("hangs")}, shutdown_grace_s=1.0)
    pids = coordinator.stats()["pids"]
    running = coordinator.submit(request("hung", "hangs", "hang"))
    queued = coordinator.submit(request("waiting", "hangs", size=32))  # not batchable with it
    wait_until(
        lambda: coordinator.stats()["jobs_running"], lambda n: n == 1, what="one job running"
    )
    coordinator.shutdown()
    for future in (running, queued):
        with pytest.raises(WorkerGroupDied, match="shut down"):
            future.result(GENEROUS_S)
    assert all(process_gone(pid) for pid in pids)
    coordinator.shutdown()  # idempotent


def test_a_queued_deadline_passes_on_time_behind_a_hung_step() -> None:
    """A queued request's deadline passes on time though the batch ahead reports nothing.

    That batch is a hung step: without the dispatcher waking for the queued deadline, the request
    would fail only once the batch ended (here: never, until shutdown).
    """
    coordinator = start_coordinator("cpu:2", {"hangs": spec("hangs")}, shutdown_grace_s=1.0)
    try:
        coordinator.submit(request("hung-ahead", "hangs", "hang"))  # no deadline of its own
        wait_until(
            lambda: coordinator.stats()["jobs_running"], lambda n: n == 1, what="one job running"
        )
        late = coordinator.submit(request("late", "hangs", size=32), max_run_seconds=0.5)
        with pytest.raises(DeadlineExceeded, match="before it could start"):
            late.result(GENEROUS_S)
        assert coordinator.stats()["jobs_running"] == 1  # the hung one: nothing else moved it
    finally:
        coordinator.shutdown()
