"""`kiln control` as a process: it runs its loops, exits 0 on SIGTERM, refuses bad settings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.common.states import JobState
from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.cli.main import main
from tests.storage.helpers import job_in_state, lapse_lease
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_a_bad_setting_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KILN_REAPER_INTERVAL_S", "soon")
    assert main(["control"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kiln: invalid setting KILN_REAPER_INTERVAL_S")


def test_it_reaps_a_lapsed_job_and_exits_0_on_sigterm(
    storage_settings: StorageSettings, job_store: JobStore, tmp_path: Path
) -> None:
    job_id, _ = job_in_state(job_store, JobState.RUNNING)
    lapse_lease(job_store, job_id)  # its node died and the lease lapsed
    env = {
        **os.environ,
        "KILN_REDIS_URL": storage_settings.redis_url,
        "KILN_REDIS_NAMESPACE": storage_settings.redis_namespace,
        "KILN_STORAGE_URL": storage_settings.storage_url,
        "KILN_REAPER_INTERVAL_S": "0.1",
    }
    log_path = tmp_path / "control.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kiln.tasks.cli", "control"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
        )
    try:
        wait_until(
            lambda: job_store.get(job_id).state,
            lambda state: state == JobState.QUEUED,
            timeout_s=60,
            what="the control process reaped the job",
        )
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert f"reaped job {job_id}" in log_path.read_text()
