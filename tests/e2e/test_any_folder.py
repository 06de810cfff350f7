"""API, node and CLI started from three different folders on the default storage setting.

The first-hour defect this pins: the old default `file://./kiln-outputs` meant another folder to
each process, so a batch submitted from one folder never started on a node started in another
(the node looked for `input.jsonl` under its own folder, forever). With one absolute home
(`~/.local/share/kiln/outputs` here, HOME being the test's own), the batch runs and its outputs
and results are where every process, and the CLI's `kiln status`, say they are.

Real `kiln api`, `kiln worker` and `kiln` CLI processes, real Redis; no KILN_STORAGE_URL at all.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import pytest

from kiln.tasks.cli.embedded import free_port, wait_for_port
from tests.e2e.cluster import REPO_ROOT, SLEEPY, Cluster, WorkerProcess

pytestmark = pytest.mark.timeout(300)

KILN = str(Path(sys.executable).parent / "kiln")
LINES = 6


def default_storage_env(cluster: Cluster, home: Path) -> dict[str, str]:
    """The cluster's Redis namespace, but no storage setting at all: the default applies."""
    env = {
        name: value
        for name, value in cluster.env.items()
        if not name.startswith("KILN_S3_")
        and name not in ("KILN_STORAGE_URL", "KILN_HOME", "XDG_DATA_HOME", "PYTHONPATH")
    }
    # the fixture pipeline lives in the checkout; the folders below are not the checkout
    return {**env, "HOME": str(home), "PYTHONPATH": str(REPO_ROOT)}


def test_a_batch_from_another_folder_runs_on_the_default_storage(
    cluster_factory: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = cluster_factory(KILN_AUTH_ENABLED="false")
    home = tmp_path / "home"
    api_dir, node_dir, cli_dir = (tmp_path / name for name in ("api", "node", "cli"))
    for folder in (home, api_dir, node_dir, cli_dir):
        folder.mkdir()
    env = default_storage_env(cluster, home)
    outputs_home = home / ".local" / "share" / "kiln" / "outputs"

    node_id = "node-anyfolder"
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [KILN, "worker", "--pipeline", f"default={SLEEPY}", "--node-id", node_id],
            cwd=node_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    worker = WorkerProcess(process, node_id, log_path, cluster.store)
    cluster.workers.append(worker)
    worker.wait_ready()
    assert f"storage file://{outputs_home}" in worker.output(), worker.log()

    port = free_port()
    with (tmp_path / "api.log").open("wb") as log:
        api = subprocess.Popen(
            [KILN, "api", "--port", str(port)], cwd=api_dir, env=env, stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for_port(port, 60)
        batch_file = cli_dir / "lines.jsonl"
        batch_file.write_text(
            "".join(
                json.dumps({"custom_id": f"line-{n}", "prompt": f"p{n}", "steps": 1}) + "\n"
                for n in range(LINES)
            )
        )

        def kiln(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [KILN, *args], cwd=cli_dir, env=env, capture_output=True,
                text=True, timeout=180,
            )  # fmt: skip

        # straight to Redis and the store, as the CLI without --api writes the input itself
        submitted = kiln("batch", "submit", "lines.jsonl", "--wait", "--timeout", "150", "--json")
        assert submitted.returncode == 0, submitted.stderr + worker.log()
        batch = json.loads(submitted.stdout)
        assert (batch["status"], batch["counts"]["succeeded"]) == ("completed", LINES), batch

        # through the API started in its own folder
        results = kiln("batch", "results", batch["id"], "--api", f"http://127.0.0.1:{port}")
        assert results.returncode == 0, results.stderr
        lines = [json.loads(line) for line in results.stdout.splitlines() if line.strip()]
        lines = [line for line in lines if line["type"] == "result"]
        urls = [o["url"] for line in lines for o in line["outputs"]]
        assert len(urls) == LINES, results.stdout
        for url in urls:  # every process agrees where outputs are: the one absolute home
            path = Path(urlparse(url).path)
            assert path.is_relative_to(outputs_home), url
            assert path.is_file(), url

        # `kiln status` from the CLI's folder names a file that exists
        job_id = lines[0]["job_id"]
        status = kiln("status", job_id, "--json")
        assert status.returncode == 0, status.stderr
        (output,) = json.loads(status.stdout)["outputs"]
        assert Path(urlparse(output["url"]).path).is_file(), output
        for folder in (api_dir, node_dir, cli_dir):  # nothing written relative to any of them
            assert list(folder.iterdir()) == ([batch_file] if folder == cli_dir else [])
    finally:
        api.send_signal(signal.SIGTERM)
        api.wait(30)
