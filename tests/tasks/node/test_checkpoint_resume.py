"""A video job handed back mid-run resumes on another node from its last step checkpoint.

Two real nodes on real Redis and a real local object store, each with its own worker group (one
CPU rank, the tiny video pipeline). Node A runs the job, writing a checkpoint about every two
steps, and is drained (`hand_back_all`) as its group reports step 10; node B takes the job and
resumes: it computes only the steps left, and the job's output has the same sha256 as the same
request run uninterrupted. A drain that comes once every step ran (at the last step, or while
the frames decode) lets the job end on node A instead: nothing is left to resume.

The drain is called from the group's own report of the step (the node's `on_progress`, on the
coordinator's thread, as the step's stop verdict is taken), not from the test's thread once it
sees a checkpoint: a step of this pipeline takes a few milliseconds, and a test thread slowed by a
loaded machine could call it after the run's last step.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kiln.common.accounting import StepAccounting
from kiln.common.states import JobState
from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.protocol import StepProgress
from kiln.storage.checkpoints import recorded_checkpoints
from kiln.storage.errors import ObjectNotFound
from kiln.storage.job_store import JobStore, NewJob
from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.node.jobs import JobRunner
from kiln.tasks.node.node import Node
from kiln.tasks.queue.process import ProcessParts

PIPELINE = "tiny-video"
STEPS = 40


@pytest.fixture
def nodes(storage_settings: StorageSettings) -> Iterator[dict[str, Node]]:
    """Node `a` checkpoints often (0.05 s), `b` by default (30 s: this job writes none there)."""
    made = {}
    for name, every_s in (("a", 0.05), ("b", 30.0)):
        settings = KilnSettings(checkpoint_every_s=every_s)
        node = Node(
            GroupConfig(devices=["cpu:1"], pipelines={PIPELINE: PIPELINE}, cpu_threads_per_rank=1),
            ProcessParts(settings, storage_settings),
            node_id=f"node-{name}",
            publish=lambda *_args, **_kwargs: None,
        )
        node.start()
        made[name] = node
    yield made
    for node in made.values():
        node.shutdown()
        node.celery_app.close()
        node.store.redis.close()


def drain_at(
    monkeypatch: pytest.MonkeyPatch, node: Node, reached: Callable[[StepProgress], bool]
) -> None:
    """Drain `node` (`hand_back_all`) from its group's report of the first progress `reached`."""
    submit = node.submit

    def submit_then_drain(request: Any, on_progress: Any = None, **options: Any) -> Any:
        def progress(report: StepProgress) -> None:
            if on_progress is not None:
                on_progress(report)
            if reached(report) and not node.draining.is_set():
                node.hand_back_all()

        return submit(request, progress, **options)

    monkeypatch.setattr(node, "submit", submit_then_drain)


def new_job(store: JobStore) -> str:
    fields: dict[str, Any] = {
        "pipeline": PIPELINE,
        "prompt": "a kiln at night",
        "width": 64,
        "height": 64,
        "num_frames": 5,
        "steps": STEPS,
        "seed": 7,
    }
    job_id = uuid.uuid4().hex
    store.create_job(NewJob(id=job_id, request=JobRequest(**fields).to_record()))
    return job_id


def test_a_handed_back_job_resumes_on_another_node_with_the_same_output(
    nodes: dict[str, Node], job_store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    uninterrupted = new_job(job_store)
    JobRunner(nodes["b"], uninterrupted).run()
    expected = job_store.get(uninterrupted)
    assert expected.state == JobState.SUCCEEDED
    assert "steps_restored" not in expected.metrics  # no checkpoints, none offered

    job_id = new_job(job_store)
    # a drain as step 10 is reported: the job stops at its next step and goes back
    drain_at(monkeypatch, nodes["a"], lambda p: p.stage == "denoising" and p.step >= 10)
    JobRunner(nodes["a"], job_id).run()
    handed_back = job_store.get(job_id)
    assert handed_back.state == JobState.QUEUED
    latest = recorded_checkpoints(job_store, job_id)[0]
    assert 10 < latest.steps_done < STEPS
    assert f"/{latest.attempt}/checkpoints/" in latest.key
    # node a counted each checkpoint it wrote (the record keeps the newest few only)
    labels = {"node_id": "node-a", "pipeline": PIPELINE}
    sample = nodes["a"].metrics.registry.get_sample_value
    written = sample("kiln_checkpoints_written_total", labels) or 0
    assert written >= len(recorded_checkpoints(job_store, job_id)) >= 1
    assert sample("kiln_checkpoint_write_bytes_count", labels) == written
    assert sample("kiln_checkpoint_write_seconds_count", labels) == written

    JobRunner(nodes["b"], job_id).run()
    record = job_store.get(job_id)
    assert record.state == JobState.SUCCEEDED, record.error
    assert record.attempts == 2
    assert record.metrics["steps_restored"] == latest.steps_done
    assert record.metrics["steps_computed"] == STEPS - latest.steps_done
    assert record.metrics["checkpoints_refused"] == []
    # the drain checkpointed the step it stopped at: the second attempt ran none of it again
    assert record.accounting == StepAccounting(
        steps_computed=STEPS, steps_restored=latest.steps_done, steps_recomputed=0
    )
    assert [o["sha256"] for o in record.outputs] == [o["sha256"] for o in expected.outputs]
    # a succeeded job needs none of its checkpoints: their objects are gone
    for ref in recorded_checkpoints(job_store, job_id):
        with pytest.raises(ObjectNotFound):
            nodes["b"].objects.get(ref.key)


def test_a_drain_that_comes_once_every_step_ran_lets_the_job_end_on_its_node(
    nodes: dict[str, Node], job_store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handed back then, it would leave no checkpoint of its last step: every step ran again.

    Node a is drained as the last step but one is reported (rank 0 reads that verdict at the end
    of the last step), node b as the frames decode (the ranks' last decision is taken).
    """
    drained_at: dict[str, Callable[[StepProgress], bool]] = {
        "a": lambda p: p.stage == "denoising" and p.step == STEPS - 1,
        "b": lambda p: p.stage == "decoding",
    }
    for name, reached in drained_at.items():
        job_id = new_job(job_store)
        drain_at(monkeypatch, nodes[name], reached)
        JobRunner(nodes[name], job_id).run()
        assert nodes[name].draining.is_set()
        record = job_store.get(job_id)
        assert (name, record.state) == (name, JobState.SUCCEEDED), record.error
        assert record.attempts == 1
        assert record.accounting == StepAccounting(steps_computed=STEPS)
