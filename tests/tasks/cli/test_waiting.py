"""Waiting from the CLI: Ctrl-C names the job and how to follow it, and more.

`--wait-for-node` waits for a node to announce the pipeline; `--skip-invalid --wait` judges only
the lines it accepted.

The commands run in subprocesses without a terminal (pipes), against a real API in a thread and
its Redis namespace. A Ctrl-C is sent once the command is seen polling the job in Redis (its
reads, watched with MONITOR), so it lands in the wait and not during start-up.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
import redis

from kiln.tasks.cli.exits import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_WAIT_TIMEOUT
from kiln.tasks.cli.main import main
from tests.tasks.helpers import Api, ApiFactory, drive_to_success, queued_job
from tests.tasks.test_cli_batch import LINE, HandNode, http_args
from tests.tasks.test_cli_habits import COMMAND_S, _cli_env, _remote_env, kiln
from tests.waiting import wait_until

READS_IN_THE_WAIT = 3  # the wait loop reads the record every poll; start-up reads it at most twice


# A shell starts a foreground command with SIGINT at its default disposition and unblocked,
# whatever the shell's own state. A child inherits an ignored or blocked SIGINT from its parent, and
# a test process's may be either by then (library code run in it earlier): a `kiln` that never
# sees the Ctrl-C hangs the test. So the command starts as a shell would start it, then execs
# `kiln` in place (same pid: the test's SIGINT reaches the command itself).
AS_A_SHELL_STARTS_IT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); "
    "os.execv(sys.executable, [sys.executable, '-m', 'kiln.tasks.cli', *sys.argv[1:]])"
)


def start_kiln(api: Api, *args: str, remote: str | None = None) -> subprocess.Popen[str]:
    """`kiln ARGS` started without a terminal, as `kiln` in test_cli_habits runs it."""
    return subprocess.Popen(
        [sys.executable, "-c", AS_A_SHELL_STARTS_IT, *args],
        env={**_cli_env(api), **_remote_env(api, remote)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def ended(process: subprocess.Popen[str]) -> None:
    """Make sure the process is gone and its pipes closed (it may have ended already)."""
    process.kill()
    process.wait(timeout=COMMAND_S)
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def record_reads(api: Api, prefix: str) -> Iterator[str]:
    """Ids of the records under `prefix` read (HGETALL) in the API's namespace, as they are."""
    client = redis.Redis.from_url(api.storage_settings.redis_url, socket_timeout=COMMAND_S)
    with client.monitor() as monitor:
        for command in monitor.listen():
            words = str(command["command"]).split()
            if words[0].upper() == "HGETALL" and words[1].startswith(prefix):
                yield words[1].removeprefix(prefix)


def polled(api: Api, prefix: str, record_id: str | None = None) -> str:
    """The record (`record_id`, or any) under `prefix` once read READS_IN_THE_WAIT times."""
    counts: dict[str, int] = {}
    for read in record_reads(api, prefix):
        if record_id is None or read == record_id:
            counts[read] = counts.get(read, 0) + 1
            if counts[read] >= READS_IN_THE_WAIT:
                return read
    raise AssertionError("the monitor ended")


def polled_job(api: Api, job_id: str | None = None) -> str:
    """The job (`job_id`, or any) once the wait is seen reading it."""
    return polled(api, api.store.keys.job(""), job_id)


def interrupted(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    """Ctrl-C the process; its exit code, stdout and stderr."""
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=COMMAND_S)
    return process.returncode, out, err


@pytest.mark.parametrize("remote", [None, "alice"])
def test_ctrl_c_in_submit_wait_names_the_job_and_how_to_follow_it(
    api: Api, remote: str | None
) -> None:
    process = start_kiln(api, "submit", "a fox", "--wait", "--wait-for-node", remote=remote)
    try:
        job_id = polled_job(api)
        code, out, err = interrupted(process)
    finally:
        ended(process)
    assert (code, out) == (EXIT_INTERRUPTED, "")
    remote_api = f" --api {api.url}" if remote else ""
    assert err == (
        f"kiln: stopped waiting; job {job_id} goes on — follow with: "
        f"kiln wait {job_id}{remote_api}\n"
    )
    assert api.store.get(job_id).state == "queued"  # it goes on


def test_ctrl_c_in_wait_names_every_job(api: Api) -> None:
    first, second = queued_job(api.store), queued_job(api.store)
    process = start_kiln(api, "wait", first[:8], second, "--wait-for-node")
    try:
        polled_job(api, second)
        code, _, err = interrupted(process)
    finally:
        ended(process)
    assert code == EXIT_INTERRUPTED
    assert err == (
        f"kiln: stopped waiting; jobs {first} {second} go on — follow with: "
        f"kiln wait {first} {second}\n"
    )


def test_ctrl_c_in_batch_wait_names_the_batch(api: Api, tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    path.write_text(json.dumps({**LINE, "custom_id": "a"}) + "\n")
    submitted = kiln(api, "batch", "submit", str(path), "--pipeline", "tiny")
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()
    process = start_kiln(api, "batch", "wait", batch_id[:8])
    try:
        polled(api, api.store.keys.batch(""), batch_id)
        code, _, err = interrupted(process)
    finally:
        ended(process)
    assert code == EXIT_INTERRUPTED
    assert err.splitlines()[-1] == (
        f"kiln: stopped waiting; batch {batch_id} goes on — follow with: kiln batch wait {batch_id}"
    )


class Lines:
    """The lines of a stream as they come, read in a thread until it ends."""

    def __init__(self, stream: IO[str]) -> None:
        self.got: queue.Queue[str] = queue.Queue()
        self.thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.thread.start()

    def _pump(self, stream: IO[str]) -> None:
        try:
            for line in stream:
                self.got.put(line)
        except ValueError:  # closed by the test once the process is gone: nothing more comes
            pass

    def next(self) -> str:
        """The next line (waits for it)."""
        return self.got.get(timeout=COMMAND_S)

    def rest(self) -> str:
        """Every line still to come, once the stream has ended."""
        self.thread.join(timeout=COMMAND_S)
        return "".join(self.got.get_nowait() for _ in range(self.got.qsize()))


@pytest.mark.parametrize("remote", [None, "alice"])
def test_wait_for_node_waits_for_the_pipeline_to_be_announced(api: Api, remote: str | None) -> None:
    refused = kiln(api, "submit", "a fox", "--pipeline", "grad", "--wait", remote=remote)
    assert refused.returncode == 1
    assert "unknown pipeline 'grad'" in refused.stderr

    process = start_kiln(
        api, "submit", "a fox", "--pipeline", "grad", "--wait", "--wait-for-node", "--json",
        remote=remote,
    )  # fmt: skip
    try:
        said = Lines(process.stderr).next()  # type: ignore[arg-type]
        assert (
            said == "kiln: no node serves pipeline 'grad' yet; waiting for one (--wait-for-node)\n"
        )
        api.store.publish_node("node-grad", {"pipelines": ["grad"]}, 60)
        job_id = wait_until(
            lambda: [v.id for v in api.store.list_jobs()[0]],
            lambda ids: len(ids) == 1,
            timeout_s=COMMAND_S,
            what="the job submitted once the node announced its pipeline",
        )[0]
        drive_to_success(api.store, job_id)
        out = Lines(process.stdout).rest()  # type: ignore[arg-type]
        code = process.wait(timeout=COMMAND_S)
    finally:
        ended(process)
    assert code == 0
    view = json.loads(out)
    assert (view["id"], view["status"], view["parameters"]["pipeline"]) == (
        job_id,
        "succeeded",
        "grad",
    )


def test_ctrl_c_while_waiting_for_a_node_submits_nothing(api: Api) -> None:
    process = start_kiln(api, "submit", "a fox", "--pipeline", "grad", "--wait-for-node")
    try:
        err = Lines(process.stderr)  # type: ignore[arg-type]
        assert err.next().startswith("kiln: no node serves pipeline 'grad' yet")
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=COMMAND_S)
    finally:
        ended(process)
    assert code == EXIT_INTERRUPTED
    assert err.rest() == "kiln: stopped waiting for a node; nothing was submitted\n"
    assert api.store.list_jobs()[0] == []


def test_wait_for_node_ends_at_the_timeout_with_nothing_submitted(api: Api) -> None:
    done = kiln(
        api, "submit", "a fox", "--pipeline", "grad", "--wait", "--wait-for-node",
        "--timeout", "0.5",
    )  # fmt: skip
    assert done.returncode == EXIT_WAIT_TIMEOUT
    assert done.stderr.splitlines()[-1] == (
        "kiln: no node announced pipeline 'grad' within 0.5 s; nothing was submitted"
    )
    assert api.store.list_jobs()[0] == []


def test_skip_invalid_lines_are_reported_not_failures(
    make_api: ApiFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api = make_api(batch_progress_interval_s=0.0)
    path = tmp_path / "b.jsonl"
    path.write_text(
        json.dumps({**LINE, "custom_id": "a"}) + "\n"
        + json.dumps({**LINE, "custom_id": "bad", "width": 7}) + "\n"
        + json.dumps({**LINE, "custom_id": "b"}) + "\n"
    )  # fmt: skip
    args = ["batch", "submit", str(path), "--skip-invalid", "--wait", "--json", *http_args(api)]
    with HandNode(api, ["a", "b"]):
        assert main(args) == 0
    out, err = capsys.readouterr()
    view = json.loads(out)
    assert (view["outcome"], view["counts"]["succeeded"], view["counts"]["invalid"]) == (
        "partial",
        2,
        1,
    )
    assert err == (
        f"kiln: batch {view['id']}: 1 invalid line(s) skipped, not run "
        f"(kiln batch results {view['id']} names them)\n"
    )
    with HandNode(api, ["a", "b"], failing=frozenset({"b"})):
        assert main(args) == EXIT_JOB_FAILED  # an accepted line that failed is a failure
