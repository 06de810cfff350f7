"""CLI habits (issue 18 item 4, the CLI parts of item 5), each as a user meets it.

`kiln ...` runs in a subprocess against a real API (in a thread) and the real Redis namespace
behind it: short ids, `kiln batch wait`, KILN_API_URL / KILN_API_KEY, a closed pipe, --version,
help and usage, cancel of a finished job, views of finished jobs, refused JSONL lines.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from kiln.storage.records import NewJob
from kiln.tasks.cli.backends import HttpBackend
from kiln.tasks.cli.exits import EXIT_ALREADY_FINISHED, EXIT_PIPE_CLOSED, EXIT_USAGE
from kiln.tasks.cli.main import build_parser
from kiln.tasks.cli.progress import wait_for_jobs
from kiln.tasks.client import KilnClient
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.views import JobView
from tests.tasks.helpers import Api, ApiFactory, drive_to_success
from tests.tasks.test_cli_batch import HandNode, write_file

COMMAND_S = 60.0  # generous: a command that hangs would block for minutes


def kiln(
    api: Api, *args: str, remote: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """`kiln ARGS` as a user runs it, on the API's Redis namespace.

    `remote`: through the API as that key's holder (KILN_API_URL and KILN_API_KEY, no flags).
    """
    return subprocess.run(
        [sys.executable, "-m", "kiln.tasks.cli", *args],
        env={**_cli_env(api), **_remote_env(api, remote), **env},
        capture_output=True,
        text=True,
        timeout=COMMAND_S,
    )


def _cli_env(api: Api) -> dict[str, str]:
    stored = api.storage_settings
    keep = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    return {
        **keep,
        "KILN_REDIS_URL": stored.redis_url,
        "KILN_REDIS_NAMESPACE": stored.redis_namespace,
        "KILN_STORAGE_URL": stored.storage_url,
        "COLUMNS": "80",
    }


def _remote_env(api: Api, key_name: str | None) -> dict[str, str]:
    if key_name is None:
        return {}
    return {"KILN_API_URL": api.url, "KILN_API_KEY": api.keys[key_name]}


def job_with_id(api: Api, job_id: str, owner: str = "alice") -> str:
    """A queued job with this very id, created by `owner`'s key."""
    body = JobRequest(prompt="a kiln", width=64, height=64, pipeline="tiny").to_record()
    api.store.create_job(NewJob(id=job_id, request=body, owner=api.key_ids[owner]))
    return job_id


def test_a_unique_prefix_names_a_job_and_an_ambiguous_one_lists_the_candidates(
    api: Api,
) -> None:
    stem = uuid.uuid4().hex[:8]
    first = job_with_id(api, f"{stem}01{uuid.uuid4().hex[:22]}")
    second = job_with_id(api, f"{stem}02{uuid.uuid4().hex[:22]}")
    for remote in (None, "alice"):  # straight from Redis, then through the API
        found = kiln(api, "status", first[:10], "--json", remote=remote)
        assert found.returncode == 0, found.stderr
        assert json.loads(found.stdout)["id"] == first
        ambiguous = kiln(api, "status", stem, remote=remote)
        assert ambiguous.returncode == EXIT_USAGE, ambiguous.stderr
        assert first in ambiguous.stderr
        assert second in ambiguous.stderr
        assert ambiguous.stderr.count("\n") == 1  # one line, no traceback
    too_short = kiln(api, "status", stem[:5])
    assert too_short.returncode == EXIT_USAGE
    assert "at least 6 characters" in too_short.stderr
    # another key's jobs are no candidates: bob's prefix finds nothing of alice's
    hidden = kiln(api, "status", first[:10], remote="bob")
    assert hidden.returncode == 1
    assert first not in hidden.stderr


def test_api_url_and_key_come_from_the_environment(api: Api) -> None:
    job_id = job_with_id(api, uuid.uuid4().hex)
    nowhere = kiln(api, "status", job_id, KILN_API_URL="http://127.0.0.1:9")
    assert nowhere.returncode == 1  # it went to the API it was given, which is not there
    assert nowhere.stderr.startswith("kiln: GET /v1/jobs/"), nowhere.stderr
    as_bob = kiln(api, "status", job_id, remote="bob")
    assert as_bob.returncode == 1
    assert "another API key" in as_bob.stderr  # 403: bob's key was sent
    as_alice = kiln(api, "status", job_id, "--json", remote="alice")
    assert as_alice.returncode == 0, as_alice.stderr
    no_redis = kiln(api, "status", job_id, "--json", remote="alice", KILN_REDIS_URL="redis://:1")
    assert no_redis.returncode == 0, no_redis.stderr  # Redis is never touched


def test_cancel_of_a_finished_job_says_so_and_exits_5(api: Api) -> None:
    job_id = job_with_id(api, uuid.uuid4().hex)
    drive_to_success(api.store, job_id)
    for remote in (None, "alice"):
        result = kiln(api, "cancel", job_id[:8], remote=remote)
        assert result.returncode == EXIT_ALREADY_FINISHED, result.stderr
        assert f"job {job_id} had already finished (succeeded)" in result.stderr
    queued = job_with_id(api, uuid.uuid4().hex)
    assert kiln(api, "cancel", queued, remote="alice").returncode == 0


def test_a_finished_job_shows_no_stale_progress(api: Api) -> None:
    job_id = job_with_id(api, uuid.uuid4().hex)
    drive_to_success(api.store, job_id)  # its last progress write: denoising 3/3
    with KilnClient(api.url, api.keys["alice"]) as client:
        assert client.get(job_id).progress is None
    shown = kiln(api, "status", job_id)
    assert shown.returncode == 0, shown.stderr
    assert "progress" not in shown.stdout
    assert "denoising" not in shown.stdout
    assert job_id in shown.stdout


class SlowBackend(HttpBackend):
    """The API backend, each read slower than a progress bar's refresh (0.1 s)."""

    def get(self, job_id: str) -> JobView:
        """GET /v1/jobs/{id}, late."""
        import time

        time.sleep(0.3)
        return super().get(job_id)


def test_waiting_on_a_finished_job_never_draws_it_queued(api: Api) -> None:
    job_id = job_with_id(api, uuid.uuid4().hex)
    drive_to_success(api.store, job_id)
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=200, color_system=None)
    backend = SlowBackend(api.url, api.keys["alice"])
    try:
        views = wait_for_jobs(backend, [job_id], console=console)
    finally:
        backend.client.close()
    assert views[0].status == "succeeded"
    drawn = screen.getvalue()
    assert job_id in drawn  # the whole id, which every command takes
    assert "queued" not in drawn
    assert "0/1" not in drawn
    assert "succeeded" in drawn
    assert " 1/1 " in drawn


def test_batch_wait_reattaches_by_prefix_and_every_printed_id_is_whole(
    make_api: ApiFactory, tmp_path: Path
) -> None:
    api: Api = make_api(batch_progress_interval_s=0.0)
    custom_ids = ["a", "b"]
    with KilnClient(api.url, api.keys["alice"]) as client:
        batch = client.submit_batch(write_file(tmp_path / "b.jsonl", custom_ids))
    listed = kiln(api, "batch", "list", remote="alice")
    assert listed.returncode == 0, listed.stderr
    assert batch.id in listed.stdout  # never cut to fit the terminal
    with HandNode(api, custom_ids):
        waited = kiln(api, "batch", "wait", batch.id[:8], "--timeout", "30", remote="alice")
    assert waited.returncode == 0, waited.stderr
    assert f"batch {batch.id} " in waited.stderr  # the progress lines, as submit --wait draws
    assert "completed" in waited.stdout
    direct = kiln(api, "batch", "status", batch.id[:8], "--json")
    assert json.loads(direct.stdout)["id"] == batch.id


def test_a_closed_pipe_ends_quietly(api: Api) -> None:
    job_id = job_with_id(api, uuid.uuid4().hex)
    for args in (["status", job_id, "--json"], ["status", job_id]):
        process = subprocess.Popen(
            [sys.executable, "-m", "kiln.tasks.cli", *args],
            env=_cli_env(api),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        assert process.stderr is not None
        process.stdout.close()  # the reader is gone before the first byte (`| head -0`)
        with process.stderr:
            err = process.stderr.read()
        assert process.wait(timeout=COMMAND_S) == EXIT_PIPE_CLOSED, err
        assert err == ""


def test_version_and_a_subcommand_mistake_shows_that_subcommand(api: Api) -> None:
    version = kiln(api, "--version")
    assert version.returncode == 0
    assert version.stdout.startswith("kiln ")
    typo = kiln(api, "submit", "x", "--widht", "64")
    assert typo.returncode == EXIT_USAGE
    assert typo.stderr.startswith("usage: kiln submit ")
    assert "unrecognized arguments: --widht 64 (did you mean --width?)" in typo.stderr
    nested = kiln(api, "batch", "status", "abcdef", "--jsn")
    assert nested.stderr.startswith("usage: kiln batch status ")


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def test_every_option_has_help_that_shows_its_default() -> None:
    silent = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
    for parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, silent) or action.help == argparse.SUPPRESS:
                continue
            name = f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{name} has no help"
            unsaid = action.default in (None, False, argparse.SUPPRESS) or action.default == []
            if action.option_strings and not unsaid:
                shown = parser._get_formatter()._get_help_string(action)
                assert "default" in (shown or ""), f"{name} does not show its default"


BAD_JSON_LINE = '{"custom_id": "c", "prompt": "a kiln at dusk" "width": 64}'


@pytest.mark.parametrize("remote", [None, "alice"])
def test_a_bad_jsonl_line_gives_line_column_and_reason(
    api: Api, tmp_path: Path, remote: str | None
) -> None:
    path = write_file(tmp_path / "bad.jsonl", ["a", "b"])
    path.write_text(path.read_text() + BAD_JSON_LINE + "\n")
    refused = kiln(api, "batch", "submit", str(path), remote=remote)
    assert refused.returncode == EXIT_USAGE
    column = BAD_JSON_LINE.index('"width"') + 1
    assert f"kiln: line 3, column {column}: expecting ',' delimiter\n" in refused.stderr


def test_a_batch_wide_mistake_is_said_once(api: Api, tmp_path: Path) -> None:
    path = write_file(tmp_path / "b.jsonl", [f"c{n}" for n in range(5)])
    refused = kiln(api, "batch", "submit", str(path), "--pipeline", "nope", remote="alice")
    assert refused.returncode == EXIT_USAGE
    assert refused.stderr.count("unknown pipeline 'nope'") == 1, refused.stderr
    assert "every line, pipeline: unknown pipeline 'nope'" in refused.stderr
    assert "5 of 5 lines are invalid" in refused.stderr


def test_the_list_routes_filter_by_id_prefix_within_what_the_key_sees(
    api: Api, tmp_path: Path
) -> None:
    stem = uuid.uuid4().hex[:8]
    mine = job_with_id(api, f"{stem}{uuid.uuid4().hex[:24]}")
    job_with_id(api, uuid.uuid4().hex)  # alice's too, another prefix
    job_with_id(api, f"{stem}{uuid.uuid4().hex[:24]}", owner="bob")

    def listed(key: str, path: str, prefix: str) -> httpx.Response:
        return httpx.get(
            f"{api.url}{path}", params={"id_prefix": prefix}, headers=api.auth(key), timeout=10
        )

    assert [j["id"] for j in listed("alice", "/v1/jobs", stem).json()["jobs"]] == [mine]
    assert len(listed("admin", "/v1/jobs", stem).json()["jobs"]) == 2  # alice's and bob's
    for hostile in (stem[:5], f"{stem}*", f"{stem}[a]", "-" * 8):
        assert listed("alice", "/v1/jobs", hostile).status_code == 422, hostile
    with KilnClient(api.url, api.keys["alice"]) as client:
        batch = client.submit_batch(write_file(tmp_path / "b.jsonl", ["a"]))
    found = listed("alice", "/v1/batches", batch.id[:6]).json()["batches"]
    assert [b["id"] for b in found] == [batch.id]
    assert listed("bob", "/v1/batches", batch.id[:6]).json()["batches"] == []


def test_pause_and_resume_a_job_from_redis_and_through_the_api(api: Api) -> None:
    for remote in (None, "alice"):
        job_id = job_with_id(api, uuid.uuid4().hex)
        paused = kiln(api, "pause", job_id[:8], "--json", remote=remote)
        assert paused.returncode == 0, paused.stderr
        assert json.loads(paused.stdout)["status"] == "paused"
        assert api.store.get(job_id).state == "paused"
        resumed = kiln(api, "resume", job_id, "--json", remote=remote)
        assert resumed.returncode == 0, resumed.stderr
        assert json.loads(resumed.stdout)["status"] == "queued"
        assert [e.type for e in api.store.events(job_id)][-2:] == ["paused", "resumed"]
        drive_to_success(api.store, job_id)
        refused = kiln(api, "pause", job_id, remote=remote)
        assert refused.returncode == 1
        assert "is succeeded" in refused.stderr
        assert refused.stderr.count("\n") == 1  # one line, no traceback


@pytest.mark.parametrize("remote", [None, "alice"])
def test_submit_asks_for_its_own_checkpoint_cadence(api: Api, remote: str | None) -> None:
    small = ["a kiln", "--pipeline", "tiny", "--width", "64", "--height", "64"]
    for given, cadence in (("10", {"every_steps": 10}), ("90s", {"every_seconds": 90.0})):
        made = kiln(api, "submit", *small, "--checkpoint-every", given, remote=remote)
        assert made.returncode == 0, made.stderr
        stored = api.store.get(made.stdout.strip()).request
        assert stored["version"] == 2
        assert {k: v for k, v in stored["checkpoint"].items() if v is not None} == cadence
    for given, said in (("ten", "give steps (10) or seconds ending in s"), ("0", "every_steps")):
        refused = kiln(api, "submit", *small, "--checkpoint-every", given, remote=remote)
        assert refused.returncode == EXIT_USAGE, refused.stderr
        assert said in refused.stderr
