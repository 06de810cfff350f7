"""Each job records where its outputs were written; readers build URLs from that record.

A node with one store, readers with another (a CLI or API started in another folder, with
another KILN_STORAGE_URL): the job's view still names the files the node wrote. On real Redis
and a real local object store, with a fake worker group; `kiln status` through the console script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from kiln.common.states import JobState
from kiln.storage.local_store import LocalObjectStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.batches.results import _fresh_urls
from kiln.tasks.contract.views import job_view
from tests.tasks.node.conftest import NodeHarness

KILN = Path(sys.executable).with_name("kiln")


def test_a_job_records_the_store_its_outputs_were_written_to(harness: NodeHarness) -> None:
    job_id = harness.submit()
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    assert record.state == JobState.SUCCEEDED
    (output,) = record.outputs
    assert output["storage_url"] == harness.node.storage_settings.storage_url


def test_a_reader_with_another_store_names_the_file_the_node_wrote(
    harness: NodeHarness, tmp_path: Path
) -> None:
    job_id = harness.submit()
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    elsewhere = LocalObjectStore(tmp_path / "elsewhere")
    (output,) = job_view(record, elsewhere).outputs
    written = Path(harness.node.storage_settings.storage_url.removeprefix("file://"))
    assert output.url == (written / output.key).as_uri()
    assert Path(output.url.removeprefix("file://")).read_bytes()  # the node's file, there


def test_kiln_status_from_another_folder_names_the_file_the_node_wrote(
    harness: NodeHarness, storage_settings: StorageSettings, tmp_path: Path
) -> None:
    job_id = harness.submit()
    harness.deliver(job_id)
    folder = tmp_path / "another-folder"
    folder.mkdir()
    env = {
        **os.environ,
        "KILN_REDIS_URL": storage_settings.redis_url,
        "KILN_REDIS_NAMESPACE": storage_settings.redis_namespace,
        "KILN_STORAGE_URL": f"file://{tmp_path / 'the-cli-store'}",
    }
    done = subprocess.run(
        [str(KILN), "status", job_id, "--json"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    (output,) = json.loads(done.stdout)["outputs"]
    path = Path(output["url"].removeprefix("file://"))
    assert path.is_file(), output["url"]
    assert path.is_relative_to(storage_settings.storage_url.removeprefix("file://"))


def test_an_old_record_without_a_location_uses_the_readers_store(
    harness: NodeHarness, tmp_path: Path
) -> None:
    job_id = harness.submit()
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    old = [{k: v for k, v in o.items() if k != "storage_url"} for o in record.outputs]
    reader = LocalObjectStore(tmp_path / "reader")
    (output,) = job_view(replace(record, outputs=old), reader).outputs
    assert output.url == reader.url(output.key)


def test_batch_results_keep_the_file_urls_their_lines_were_written_with(
    harness: NodeHarness, tmp_path: Path
) -> None:
    job_id = harness.submit()
    harness.deliver(job_id)
    (output,) = job_view(harness.store.get(job_id), harness.node.objects).outputs
    line = json.dumps({"line": 1, "outputs": [output.model_dump(mode="json")]}).encode()
    reader = LocalObjectStore(tmp_path / "reader")  # the results are read by another process
    (fresh,) = json.loads(_fresh_urls(line, reader))["outputs"]
    assert fresh["url"] == output.url
