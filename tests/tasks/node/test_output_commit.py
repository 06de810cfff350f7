"""An attempt's outputs are the job's only through its fenced commit (issue 23, item 1).

Outputs go to a folder of the attempt's own and are created, never replaced; an attempt whose
commit is refused, or whose uploads fail, deletes what it stored.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from kiln.common.states import JobState
from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.storage.errors import ObjectExists
from kiln.storage.objects import LocalObjectStore, ObjectStore, new_attempt_name, output_key
from kiln.tasks.contract.job_spec import JobSpec
from kiln.tasks.node.output_uploads import encode_and_upload, put_verified
from tests.tasks.node.conftest import STEPS, NodeHarness

DATA = b"\x89PNG an output's bytes"


def job_folder(objects: ObjectStore, job_id: str) -> str:
    return f"{objects.prefix}/{job_id}" if objects.prefix else job_id


def stored_under(objects: ObjectStore, job_id: str) -> list[str]:
    return list(objects.list_keys(job_folder(objects, job_id)))


def test_a_retried_put_whose_first_try_landed_is_taken(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path, "outputs")
    key = output_key("outputs", "job1", 0, "png", attempt=new_attempt_name(1))
    store.put(key, DATA, "image/png", create_only=True)  # the first try, its answer lost
    assert put_verified(store, key, DATA, "image/png", {}) == hashlib.sha256(DATA).hexdigest()


def test_a_put_onto_another_writers_bytes_is_refused_and_leaves_them(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path, "outputs")
    key = output_key("outputs", "job1", 0, "png", attempt=new_attempt_name(1))
    store.put(key, b"someone else's", "image/png")
    with pytest.raises(ObjectExists):
        put_verified(store, key, DATA, "image/png", {}, "checksum")
    assert store.get(key) == b"someone else's"


def test_an_output_that_fails_deletes_the_attempts_earlier_ones(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path, "outputs")
    one_image = np.zeros((1, 8, 8, 3), np.uint8)
    two_frames = np.zeros((2, 8, 8, 3), np.uint8)  # a png holds one image: encoding refuses it
    with pytest.raises(UnsupportedRequest):
        encode_and_upload(
            store,
            "job1",
            JobSpec(prompt="a fox", output_format="png", fps=8, seed=1),
            [one_image, two_frames],
            attempt=new_attempt_name(1),
            retry_for_s=1.0,
            on_stage=lambda *_: None,
        )
    assert stored_under(store, "job1") == []


def test_a_commit_refused_as_stale_deletes_the_attempts_outputs(harness: NodeHarness) -> None:
    job_id = harness.submit(num_outputs=2)

    def taken_over_after_the_last_step(step: int) -> None:
        if step != STEPS:
            return
        (tracked,) = harness.node.tracked_jobs()
        harness.store.release_lease(job_id, tracked.lease_token)  # as if it lapsed...
        harness.store.acquire_lease(job_id, "other-node/1")  # ...and another node took it
        # no renewal in between: the attempt learns it at its commit, after its uploads

    harness.coordinator.on_step = taken_over_after_the_last_step
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    assert (record.state, record.outputs) == (JobState.RUNNING, [])
    assert stored_under(harness.node.objects, job_id) == []


def test_a_commit_after_another_attempt_committed_keeps_its_outputs(
    harness: NodeHarness,
) -> None:
    job_id = harness.submit()
    committed: list[dict[str, object]] = []

    def another_node_commits_first(step: int) -> None:
        if step != STEPS:
            return
        (tracked,) = harness.node.tracked_jobs()
        harness.store.release_lease(job_id, tracked.lease_token)
        token = harness.store.acquire_lease(job_id, "other-node/1")
        objects = harness.node.objects
        key = output_key(objects.prefix, job_id, 0, "png", attempt=new_attempt_name(token))
        stored = objects.put(key, DATA, "image/png", create_only=True)
        committed.append({"key": key, "sha256": stored.sha256, "bytes": stored.size})
        harness.store.succeed(job_id, token, committed, {})

    harness.coordinator.on_step = another_node_commits_first
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    assert (record.state, record.outputs) == (JobState.SUCCEEDED, committed)
    # the late attempt's outputs are gone; the committed one is intact
    assert stored_under(harness.node.objects, job_id) == [committed[0]["key"]]
    assert harness.node.objects.get(str(committed[0]["key"])) == DATA
