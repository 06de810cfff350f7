"""The CLI says what is true: unserved pipelines, wait timeouts, settings, a dying demo worker.

Every command runs as a user would run it (`kiln ...` in a subprocess) against a real Redis
namespace; no node serves anything here unless a test starts one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

from kiln.tasks.cli.main import EXIT_NOT_SERVED, EXIT_USAGE, EXIT_WAIT_TIMEOUT
from tests.e2e.cluster import Cluster

SMALL = ("--width", "64", "--height", "64", "--steps", "2")
# Generous bounds on how long a command may take before the test gives up on it; a command that
# kept waiting (the bugs these tests guard against) would block for minutes, not seconds.
PROMPT_S = 60.0


def test_wait_on_a_pipeline_no_live_node_serves_says_so_at_once(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory()
    result = cluster.run_cli("submit", "a red fox", *SMALL, "--wait", timeout_s=PROMPT_S)
    assert result.returncode == EXIT_NOT_SERVED, result.stderr
    assert "no live node serves pipeline 'default'" in result.stderr
    assert "--wait-for-node" in result.stderr


def test_the_job_view_says_why_a_queued_job_waits(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory()
    job_id = cluster.run_cli("submit", "a red fox", *SMALL).stdout.strip()
    view = json.loads(cluster.run_cli("status", job_id, "--json").stdout)
    assert view["status"] == "queued"
    assert "no live node serves pipeline 'default'" in view["waiting_for"]


def test_wait_for_node_keeps_waiting_and_a_timeout_has_its_own_exit_code(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory()
    job_id = cluster.run_cli("submit", "a red fox", *SMALL).stdout.strip()
    result = cluster.run_cli(
        "wait", job_id, "--wait-for-node", "--timeout", "1", timeout_s=PROMPT_S
    )
    assert result.returncode == EXIT_WAIT_TIMEOUT, result.stderr
    assert result.stderr.strip().count("\n") == 0  # one line, no traceback
    assert "not finished after 1.0s" in result.stderr


def test_list_settings_take_the_comma_form(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(KILN_PIPELINES="default,tiny,extra-model")
    result = cluster.run_cli("submit", "x", "--pipeline", "extra-model", *SMALL)
    assert result.returncode == 0, result.stderr  # accepted: the comma list was parsed


def test_a_bad_setting_is_one_line_naming_the_variable(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory()
    result = subprocess.run(
        [sys.executable, "-m", "kiln.tasks.cli", "submit", "x", *SMALL],
        env={**cluster.env, "KILN_LEASE_TTL_S": "soon"},
        capture_output=True,
        text=True,
        timeout=PROMPT_S,
    )
    assert result.returncode == EXIT_USAGE
    assert result.stderr.startswith("kiln: invalid setting KILN_LEASE_TTL_S: ")
    assert result.stderr.strip().count("\n") == 0
    assert "invalid job" not in result.stderr


def test_the_demo_stops_when_its_worker_dies_and_shows_why(
    cluster_factory: Callable[..., Cluster],
) -> None:
    # The worker (only it reads this setting) exits at start; the demo must not wait 180 s.
    cluster = cluster_factory(KILN_CPU_THREADS_PER_RANK="lots")
    result = cluster.run_cli("demo", timeout_s=PROMPT_S)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the demo worker exited" in result.stderr
    assert "KILN_CPU_THREADS_PER_RANK" in result.stderr  # the worker's own last line, shown
