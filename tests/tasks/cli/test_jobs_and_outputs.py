"""`kiln jobs`, `kiln get`, `kiln admin nodes` and 80-column tables, as a user runs them.

Each command runs in a subprocess (`tests.tasks.test_cli_habits.kiln`, COLUMNS=80) against a
real API in a thread and the real Redis namespace and object store behind it: straight to Redis
(no `--api`) and through the API (KILN_API_URL/KILN_API_KEY of a key's holder).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from rich.console import Console

from kiln.storage.job_store import JobStore
from kiln.storage.object_base import output_key
from kiln.storage.objects import open_object_store
from kiln.storage.settings import StorageSettings
from kiln.tasks.batches.intake import batch_job_id
from kiln.tasks.cli.demo import results_table
from kiln.tasks.cli.main import build_parser
from kiln.tasks.client import KilnClient
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.views import with_storage_url
from tests.conftest import S3_KEY_ID, S3_REGION, S3_SECRET
from tests.tasks.helpers import Api, queued_job, start_job
from tests.tasks.test_cli_batch import LINE, finish, hand_feeder
from tests.tasks.test_cli_habits import COMMAND_S, kiln

SPEED = {
    "mode": "fast",
    "cache": "first_block",
    "threshold": 0.1,
    "tf32": False,
    "block_calls": 40,
    "block_calls_skipped": 12,
}


def job_for(api: Api, pipeline: str, owner: str = "alice", prompt: str = "a kiln") -> str:
    """A queued job of `pipeline`, created by `owner`'s key."""
    request = JobRequest(prompt=prompt, width=64, height=64, pipeline=pipeline)
    return queued_job(api.store, request, owner=api.key_ids[owner])


def listed(api: Api, *args: str, remote: str | None = None) -> list[str]:
    """The ids `kiln jobs --json ARGS` prints."""
    done = kiln(api, "jobs", "--json", *args, remote=remote)
    assert done.returncode == 0, done.stderr
    return [job["id"] for job in json.loads(done.stdout)["jobs"]]


@pytest.mark.parametrize("remote", [None, "alice"])
def test_jobs_lists_with_filters_and_pages(api: Api, remote: str | None) -> None:
    tiny = job_for(api, "tiny", prompt="a red fox in snow, in the style of an old woodcut print")
    default = job_for(api, "default")
    finish(api, default)
    video = job_for(api, "tiny-video")
    bobs = job_for(api, "tiny", owner="bob")
    mine = {tiny, default, video} | ({bobs} if remote is None else set())  # Redis sees all

    assert set(listed(api, remote=remote)) == mine
    assert listed(api, "--status", "succeeded", remote=remote) == [default]
    assert set(listed(api, "--pipeline", "tiny", remote=remote)) == mine & {tiny, bobs}
    assert set(listed(api, "--since", "1h", remote=remote)) == mine
    assert listed(api, "--since", "2999-01-01T00:00", remote=remote) == []
    # pages of one: each `more: --cursor` goes on exactly after the last job listed
    seen: list[str] = []
    cursor: list[str] = []
    for _ in range(len(mine) + 1):
        page = kiln(api, "jobs", "--limit", "1", *cursor, remote=remote)
        assert page.returncode == 0, page.stderr
        seen += [job for job in mine if job in page.stdout]
        more = [line for line in page.stdout.splitlines() if line.startswith("more: ")]
        if not more:
            break
        cursor = more[0].removeprefix("more: ").split()
    assert sorted(seen) == sorted(mine)

    table = kiln(api, "jobs", remote=remote)  # at 80 columns
    assert table.returncode == 0, table.stderr
    for job in mine:
        assert job in table.stdout  # whole ids
    assert "succeeded" in table.stdout  # whole states
    assert "queued" in table.stdout
    refused = kiln(api, "jobs", "--since", "yesterday", remote=remote)
    assert refused.returncode == 2
    assert refused.stderr.startswith("kiln: --since 'yesterday': an age such as 90m")


def stored_output(api: Api, job_id: str) -> Path:
    """Where the local store keeps the job's first output."""
    (output,) = api.store.get(job_id).outputs
    assert api.ctx.objects is not None
    return Path(api.ctx.objects.url(output["key"]).removeprefix("file://"))


@pytest.mark.parametrize("remote", [None, "alice"])
def test_get_fetches_the_outputs_verified(api: Api, tmp_path: Path, remote: str | None) -> None:
    job_id = job_for(api, "tiny")
    finish(api, job_id)
    got = kiln(api, "get", job_id[:8], str(tmp_path / "out"), remote=remote)
    assert got.returncode == 0, got.stderr
    fetched = tmp_path / "out" / f"{job_id}-0.png"
    assert got.stdout == f"{fetched}\n"
    assert fetched.read_bytes() == f"pixels of {job_id}".encode()

    again = kiln(api, "get", job_id, str(tmp_path / "out"), "--json", remote=remote)
    report = json.loads(again.stdout)
    assert (report["downloaded"], report["kept"], report["files"]) == (0, 1, [str(fetched)])

    stored_output(api, job_id).write_bytes(b"other bytes")  # the store no longer matches
    fetched.unlink()
    bad = kiln(api, "get", job_id, str(tmp_path / "out"), remote=remote)
    assert bad.returncode == 1
    assert "sha256" in bad.stderr
    assert not fetched.exists()  # only a verified file takes its name

    unfinished = job_for(api, "tiny")
    none = kiln(api, "get", unfinished, str(tmp_path / "out"), remote=remote)
    assert none.returncode == 1
    assert none.stderr == f"kiln: job {unfinished} is queued: it has no outputs to get\n"


def test_get_through_the_api_refuses_another_keys_job(api: Api, tmp_path: Path) -> None:
    job_id = job_for(api, "tiny", owner="bob")
    finish(api, job_id)
    got = kiln(api, "get", job_id, str(tmp_path / "got"), remote="alice")
    assert got.returncode == 1
    assert got.stderr.startswith("kiln: HTTP 403")
    assert not (tmp_path / "got").exists()


def test_status_at_80_columns_prints_whole_paths_and_speed_in_words(api: Api) -> None:
    job_id = job_for(api, "tiny")
    token = start_job(api.store, job_id)
    assert api.ctx.objects is not None
    key = output_key(api.ctx.objects.prefix, job_id, 0, "png", attempt="1-0123abcd")
    stored = api.ctx.objects.put(key, b"pixels", "image/png")
    output = {"key": key, "content_type": "image/png", "bytes": 6, "sha256": stored.sha256}
    api.store.succeed(job_id, token, [output], {"run_s": 0.25, "speed": SPEED})
    url = api.ctx.objects.url(key)
    assert len(url) > 80

    shown = kiln(api, "status", job_id)
    assert shown.returncode == 0, shown.stderr
    assert f"output 0: {url}\n" in shown.stdout  # whole, on a line of its own
    words = " ".join(shown.stdout.replace("│", " ").split())
    assert "speed fast: 12 of 40 block calls skipped (first_block cache, threshold 0.1)" in words
    assert "{" not in shown.stdout
    assert "…" not in shown.stdout


@pytest.mark.parametrize("remote", [None, "admin"])
def test_admin_nodes_lists_live_nodes(api: Api, remote: str | None) -> None:
    api.store.publish_node(
        "gpu-node-7-long-host-name-1234",
        {"pipelines": ["tiny", "tiny-video"], "jobs_running": 2, "draining": False},
        60,
    )
    draining = {"pipelines": ["default"], "jobs_running": 0, "draining": True}
    api.store.publish_node("n2", draining, 60)
    shown = kiln(api, "admin", "nodes", remote=remote)
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines()[2:]}
    long_id = rows["gpu-node-7-long-host-name-1234"]  # whole, its pipelines wrapped if need be
    assert (long_id[1], long_id[-5:-2], long_id[-1]) == ("tiny,", ["serving", "2", "-"], "ago")
    assert "tiny-video" in shown.stdout
    assert rows["n2"][:5] + rows["n2"][-1:] == ["n2", "default", "draining", "0", "-", "ago"]
    for row in (long_id, rows["n2"]):
        assert re.fullmatch(r"\d+s", row[-2])  # the age of its last heartbeat

    as_json = json.loads(kiln(api, "admin", "nodes", "--json", remote=remote).stdout)
    nodes = {node["node_id"]: node for node in as_json["nodes"]}
    assert nodes["n2"]["draining"] is True
    assert isinstance(nodes["n2"]["heartbeat_at"], float)


def test_every_command_that_prints_data_prints_json(api: Api, tmp_path: Path) -> None:
    job_id = job_for(api, "tiny")
    finish(api, job_id)
    api.store.publish_node("n1", {"pipelines": ["tiny"], "jobs_running": 0}, 60)
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"custom_id": "a", "prompt": "x", "width": 64, "height": 64}))
    commands = [
        ("status", job_id),
        ("wait", job_id),
        ("jobs",),
        ("get", job_id, str(tmp_path / "got")),
        ("admin", "nodes"),
        ("admin", "queues"),
        ("batch", "list"),
        ("keys", "list"),
        ("config",),
    ]
    for command in commands:
        done = kiln(api, *command, "--json")
        assert done.returncode == 0, (command, done.stderr)
        json.loads(done.stdout)  # JSON and nothing else
    submitted = kiln(api, "batch", "submit", str(batch), "--pipeline", "tiny", "--json")
    assert submitted.returncode == 0, submitted.stderr
    batch_id = json.loads(submitted.stdout)["id"]
    status = kiln(api, "batch", "status", batch_id, "--json")
    assert json.loads(status.stdout)["id"] == batch_id
    table = kiln(api, "batch", "status", batch_id)  # at 80 columns, a narrow table
    assert f"batch {batch_id}\n" in table.stdout  # its title whole, on one line
    listed = kiln(api, "batch", "list")
    assert batch_id in listed.stdout
    assert "running" in listed.stdout
    assert "…" not in listed.stdout
    results = kiln(api, "batch", "results", batch_id, "--json")
    assert results.returncode == 0, results.stderr
    for line in results.stdout.splitlines():  # JSON lines
        json.loads(line)


def test_new_commands_refuse_a_bad_redis_url_in_one_line(api: Api, tmp_path: Path) -> None:
    job_id = uuid.uuid4().hex
    for command in (("jobs",), ("get", job_id, str(tmp_path)), ("admin", "nodes")):
        done = kiln(api, *command, KILN_REDIS_URL="127.0.0.1:6420")
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.splitlines()) == 1
        assert done.stderr.startswith("kiln: invalid setting KILN_REDIS_URL: ")


def test_every_command_but_the_services_takes_json() -> None:
    services = {"worker", "api", "control", "demo"}  # they serve; they print no data
    missing = []
    for path, parser in _commands(build_parser(), ()):
        options = {option for action in parser._actions for option in action.option_strings}
        if path[0] not in services and "--json" not in options:
            missing.append(" ".join(path))
    assert missing == []


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every leaf command of `parser` with its words (`admin nodes`)."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield path, parser
        return
    for name, child in subparsers[0].choices.items():
        yield from _commands(child, (*path, name))


def test_the_demo_table_keeps_states_whole_at_80_columns(api: Api) -> None:
    job_id = job_for(api, "tiny-video")
    finish(api, job_id)
    with KilnClient(api.url, api.keys["alice"]) as client:
        view = client.get(job_id)
    console = Console(width=80, record=True)
    console.print(results_table([view, view]))
    drawn = console.export_text()
    assert drawn.count("succeeded") == 2
    assert "…" not in drawn


def test_get_without_the_api_reads_the_store_the_record_names(
    job_store: JobStore, storage_settings: StorageSettings, s3_settings: StorageSettings,
    s3_bucket: str, tmp_path: Path,
) -> None:  # fmt: skip
    written = s3_settings.model_copy(update={"redis_namespace": storage_settings.redis_namespace})
    job_id = queued_job(job_store)
    token = start_job(job_store, job_id)
    objects = open_object_store(written)
    key = output_key(objects.prefix, job_id, 0, "png", attempt="1-0123abcd")
    stored = objects.put(key, b"pixels in the bucket", "image/png")
    output = {
        "key": key,
        "content_type": "image/png",
        "bytes": stored.size,
        "sha256": stored.sha256,
    }
    job_store.succeed(job_id, token, with_storage_url([output], written.storage_url), {})
    # the CLI's own store is another bucket: the record, not the setting, says where it is
    other = f"{s3_bucket}-now"
    boto3.client(
        "s3", endpoint_url=s3_settings.s3_endpoint_url, region_name=S3_REGION,
        aws_access_key_id=S3_KEY_ID, aws_secret_access_key=S3_SECRET,
    ).create_bucket(Bucket=other)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(
        KILN_REDIS_URL=storage_settings.redis_url,
        KILN_REDIS_NAMESPACE=storage_settings.redis_namespace,
        KILN_STORAGE_URL=f"s3://{other}/outputs",
        KILN_S3_ENDPOINT_URL=str(s3_settings.s3_endpoint_url),
        KILN_S3_REGION=S3_REGION,
        KILN_S3_ADDRESSING_STYLE="path",
        KILN_S3_ACCESS_KEY_ID=S3_KEY_ID,
        KILN_S3_SECRET_ACCESS_KEY=S3_SECRET,
    )
    got = subprocess.run(
        [sys.executable, "-m", "kiln.tasks.cli", "get", job_id, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=COMMAND_S,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert (tmp_path / f"{job_id}-0.png").read_bytes() == b"pixels in the bucket"


def test_jobs_at_80_columns_cut_only_the_prompt(api: Api) -> None:
    long_name = job_for(api, "diffusers-sd3-medium-custom", prompt="a lighthouse at dusk " * 4)
    done = job_for(api, "tiny", prompt="a fox")
    finish(api, done)
    table = kiln(api, "jobs")
    assert table.returncode == 0, table.stderr
    rows = [row.rstrip() for row in table.stdout.splitlines()]
    assert len(rows[0]) <= 80
    (first,) = [row for row in rows if row.startswith(long_name)]
    assert first.split()[1] == "queued"
    assert first.endswith("…")  # the prompt, cut to the line
    (second,) = [row for row in rows if row.startswith(done)]
    assert second.split()[1:5] == ["succeeded", "tiny", "1", "output"]
    assert second.split()[-2:] == ["a", "fox"]


@pytest.mark.parametrize("remote", [None, "alice"])
def test_jobs_of_a_batch_named_by_a_prefix(api: Api, tmp_path: Path, remote: str | None) -> None:
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps({**LINE, "custom_id": c}) + "\n" for c in ("a", "b")))
    submitted = kiln(api, "batch", "submit", str(path), "--pipeline", "tiny", remote=remote)
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()
    hand_feeder(api).tick()  # its lines become queued jobs
    job_for(api, "tiny")  # not of the batch
    fed = {batch_job_id(batch_id, custom_id) for custom_id in ("a", "b")}
    assert set(listed(api, "--batch", batch_id[:8], remote=remote)) == fed
