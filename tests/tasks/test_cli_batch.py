"""`kiln batch` and the client's batch calls over a real API and Redis: follow, control, download.

No node runs here: a feeder is ticked by hand and jobs are moved through the real store as a node
would move them, their outputs written to the API's real object store (a local directory; the S3
path of downloads is covered by the presigned-URL test below and by tests/e2e/test_batch_crash.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
from pathlib import Path

import pytest

from kiln.common.states import BatchStatus, JobState, is_final_batch
from kiln.storage.errors import JobNotFound
from kiln.storage.object_base import output_key
from kiln.storage.objects import open_object_store
from kiln.storage.settings import StorageSettings
from kiln.tasks.batches.feeder import BatchFeeder
from kiln.tasks.batches.intake import batch_job_id
from kiln.tasks.cli.batch_display import BatchProgress
from kiln.tasks.cli.main import main
from kiln.tasks.client import KilnClient
from kiln.tasks.client.batch_downloads import OutputFile, download_outputs
from kiln.tasks.contract.batches import BatchView
from kiln.tasks.queue.submit import Submitter
from tests.tasks.helpers import Api, ApiFactory, start_job

LINE = {"prompt": "a kiln at dusk", "width": 64, "height": 64, "steps": 2}


def write_file(path: Path, custom_ids: list[str]) -> Path:
    path.write_text("".join(json.dumps({**LINE, "custom_id": c}) + "\n" for c in custom_ids))
    return path


def hand_feeder(api: Api) -> BatchFeeder:
    tuned = api.settings.model_copy(update={"batch_results_flush_s": 0.0})
    submitter = Submitter(api.store, tuned, publish=lambda *_args, **_kw: None)
    assert api.ctx.objects is not None
    return BatchFeeder(api.store, api.ctx.objects, submitter, tuned, "node-test")


def finish(api: Api, job_id: str, fail: bool = False) -> None:
    """Run one queued job as a node would: its output really written to the store."""
    token = start_job(api.store, job_id)
    if fail:
        error = {"type": "JobFailed", "message": "no", "retryable": False}
        api.store.fail(job_id, token, error)
        return
    assert api.ctx.objects is not None
    data = f"pixels of {job_id}".encode()
    stored = api.ctx.objects.put(
        output_key(api.ctx.objects.prefix, job_id, 0, "png", attempt="1-0123abcd"),
        data,
        "image/png",
    )
    output = {"key": stored.key, "content_type": "image/png", "bytes": stored.size}
    api.store.succeed(job_id, token, [{**output, "sha256": stored.sha256}], {"run_s": 0.1})
    api.store.release_lease(job_id, token)


def run_queued(api: Api, batch_id: str, custom_ids: list[str], failing: frozenset[str]) -> int:
    """Finish every queued job of the batch (those in `failing` fail); returns how many."""
    ran = 0
    for custom_id in custom_ids:
        job_id = batch_job_id(batch_id, custom_id)
        try:
            queued = api.store.get(job_id).state == JobState.QUEUED
        except JobNotFound:
            continue  # not fed yet
        if queued:
            finish(api, job_id, fail=custom_id in failing)
            ran += 1
    return ran


class HandNode(threading.Thread):
    """Feeds and runs every batch's jobs in the background (a node, by hand) until stopped."""

    def __init__(self, api: Api, custom_ids: list[str], failing: frozenset[str] = frozenset()):
        super().__init__(daemon=True)
        self.api, self.custom_ids, self.failing = api, custom_ids, failing
        self.feeder = hand_feeder(api)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.05):
            self.feeder.tick()
            batches, _ = self.feeder.batches.list_fed()
            for batch in batches:
                run_queued(self.api, batch.id, self.custom_ids, self.failing)

    def __enter__(self) -> HandNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.join(timeout=30)


def http_args(api: Api) -> list[str]:
    return ["--api", api.url, "--api-key", api.keys["alice"]]


@pytest.fixture
def batch_api(make_api: ApiFactory) -> Api:
    """An API whose batch events report every change at once."""
    return make_api(batch_progress_interval_s=0.0)


def test_submit_wait_shows_progress_lines_and_the_final_batch(
    batch_api: Api, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    custom_ids = [f"c{n}" for n in range(4)]
    path = write_file(tmp_path / "b.jsonl", custom_ids)
    with HandNode(batch_api, custom_ids, failing=frozenset({"c3"})):
        code = main(["batch", "submit", str(path), "--wait", *http_args(batch_api)])
    out, err = capsys.readouterr()
    assert code == 1  # one line failed: the batch is not a success
    progress = err.splitlines()
    assert progress[0].startswith("batch ")
    assert "4/4 done" in progress[-1]
    assert progress[-1].endswith("1 not ok")
    assert len(progress) == len(set(progress))  # a line only when something changed
    assert "completed (partial)" in out


def test_submit_wait_json_prints_nothing_but_the_final_view(
    batch_api: Api, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_file(tmp_path / "b.jsonl", ["a", "b"])
    with HandNode(batch_api, ["a", "b"]):
        code = main(["batch", "submit", str(path), "--wait", "--json", *http_args(batch_api)])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    view = json.loads(out)
    assert (view["status"], view["outcome"], view["counts"]["succeeded"]) == (
        "completed",
        "succeeded",
        2,
    )


def test_pause_resume_and_retry_through_the_cli(
    batch_api: Api, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    custom_ids = ["ok", "bad"]
    with KilnClient(batch_api.url, batch_api.keys["alice"]) as client:
        batch_id = client.submit_batch(write_file(tmp_path / "b.jsonl", custom_ids)).id
    assert main(["batch", "pause", batch_id, "--json", *http_args(batch_api)]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "paused"
    hand_feeder(batch_api).tick()
    with pytest.raises(JobNotFound):  # a paused batch is not fed
        batch_api.store.get(batch_job_id(batch_id, "ok"))
    assert main(["batch", "resume", batch_id, "--json", *http_args(batch_api)]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "running"
    with (
        HandNode(batch_api, custom_ids, failing=frozenset({"bad"})),
        KilnClient(batch_api.url, batch_api.keys["alice"]) as client,
    ):
        assert client.wait_batch(batch_id, timeout=30, poll_s=0.05).outcome == "partial"
    capsys.readouterr()
    retry = ["batch", "retry", batch_id, "--include", "failed", "--json", *http_args(batch_api)]
    assert main(retry) == 0
    child = json.loads(capsys.readouterr().out)
    assert (child["parent_id"], child["counts"]["total"]) == (batch_id, 1)
    assert main(["batch", "retry", batch_id, "--include", "lost", *http_args(batch_api)]) == 2
    assert "--include 'lost'" in capsys.readouterr().err


def test_events_follow_a_batch_and_downloads_verify_and_resume(
    batch_api: Api, tmp_path: Path
) -> None:
    custom_ids = ["x", "y", "z"]
    folder = tmp_path / "downloads"  # (the store itself is tmp_path / "outputs")
    with KilnClient(batch_api.url, batch_api.keys["alice"]) as client:
        batch_id = client.submit_batch(write_file(tmp_path / "b.jsonl", custom_ids)).id
        with HandNode(batch_api, custom_ids):
            views = list(client.batch_events(batch_id))
        assert is_final_batch(views[-1].status)
        assert not any(is_final_batch(v.status) for v in views[:-1])
        assert views[-1].counts.succeeded == 3
        first = client.download_batch_results(batch_id, folder)
        assert (first.downloaded, first.kept, first.failed) == (3, 0, [])
        files = sorted(folder.glob("*/*"))
        assert [f.relative_to(folder).as_posix() for f in files] == [
            "x/0.png",
            "y/0.png",
            "z/0.png",
        ]
        assert files[0].read_bytes() == f"pixels of {batch_job_id(batch_id, 'x')}".encode()
        files[1].write_bytes(b"torn")  # an interrupted or damaged file is fetched again
        again = client.download_batch_results(batch_id, folder)
        assert (again.downloaded, again.kept, again.failed) == (1, 2, [])


def test_a_download_whose_bytes_do_not_match_their_sha256_leaves_no_file(
    s3_settings: StorageSettings, tmp_path: Path
) -> None:
    objects = open_object_store(s3_settings)
    good = objects.put(
        output_key(objects.prefix, "j1", 0, "png", attempt="1-0123abcd"),
        b"right bytes",
        "image/png",
    )
    bad = objects.put(
        output_key(objects.prefix, "j2", 0, "png", attempt="1-0123abcd"),
        b"other bytes",
        "image/png",
    )
    files = [
        OutputFile(objects.url(good.key), tmp_path / "a" / "0.png", good.sha256),
        OutputFile(
            objects.url(bad.key), tmp_path / "b" / "0.png", hashlib.sha256(b"x").hexdigest()
        ),
    ]
    report = download_outputs(files, workers=2)
    assert report.downloaded == 1
    assert len(report.failed) == 1
    assert "sha256" in report.failed[0]
    assert (tmp_path / "a" / "0.png").read_bytes() == b"right bytes"
    assert list((tmp_path / "b").iterdir()) == []  # neither the file nor its partial copy


def a_view(done: int, status: BatchStatus = BatchStatus.running) -> BatchView:
    counts = {
        "total": 4,
        "pending": 0,
        "queued": 4 - done,
        "running": 0,
        "succeeded": max(done - 1, 0),
        "failed": min(done, 1),
        "canceled": 0,
        "expired": 0,
        "invalid": 0,
    }
    return BatchView.model_validate(
        {
            "id": "b" * 32,
            "status": status,
            "counts": counts,
            "created_at": 0.0,
            "expires_at": 60.0,
            "completion_window_s": 60,
            "results_written": done,
            "throughput_per_s": 2.0 if done else None,
            "eta_s": (4 - done) / 2 if done else None,
        }
    )


def test_the_progress_bar_shows_done_of_total_rate_eta_and_failures() -> None:
    out = io.StringIO()
    with BatchProgress("live", out) as progress:
        for done in range(5):
            progress.show(a_view(done, BatchStatus.completed if done == 4 else BatchStatus.running))
    assert "completed" in out.getvalue()
    assert "4/4 2.0/s ETA 0s 1 not ok" in out.getvalue()
    quiet = io.StringIO()
    with BatchProgress("quiet", quiet) as progress:
        progress.show(a_view(2))
    assert quiet.getvalue() == ""
