"""What a `kiln` command loads: only what it uses, so a command starts in about half a second.

Each command runs as a user runs it (`python -m kiln.tasks.cli`, a fresh interpreter), on the
test Redis, and lists the modules it had loaded when it exited. Listing jobs needs no intake and
no Celery; a command sent to a remote API loads no Redis client; learning that a failure was not
one of the CLI's known ones imports nothing (the intake and Celery cost 0.4 CPU s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kiln.storage.settings import StorageSettings

# Runs the CLI as its console script does, then prints what it loaded as its last stderr line.
PROBE = (
    "import atexit, json, runpy, sys\n"
    "atexit.register(lambda: print(json.dumps(sorted(sys.modules)), file=sys.stderr))\n"
    "sys.argv = ['kiln', *sys.argv[1:]]\n"
    "runpy.run_module('kiln.tasks.cli', run_name='__main__')\n"
)
# what only submitting a job needs: the intake's checks and Celery (kombu beneath it)
SUBMITTING = ("kiln.tasks.intake.intake", "celery", "kombu")


def loaded_by(
    storage_settings: StorageSettings, *args: str, **env: str
) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """`kiln ARGS` on the test namespace, and the top-level packages and Kiln modules it loaded."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        env={
            **keep,
            "KILN_REDIS_URL": storage_settings.redis_url,
            "KILN_REDIS_NAMESPACE": storage_settings.redis_namespace,
            "KILN_STORAGE_URL": storage_settings.storage_url,
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    modules = json.loads(done.stderr.splitlines()[-1])
    return done, {m for m in modules if m.startswith("kiln.")} | {m.split(".")[0] for m in modules}


def test_listing_jobs_on_redis_loads_no_intake_and_no_celery(
    storage_settings: StorageSettings,
) -> None:
    done, loaded = loaded_by(storage_settings, "jobs", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"jobs": [], "next_cursor": None}
    assert "redis" in loaded  # the probe sees what the command used
    assert [m for m in SUBMITTING if m in loaded] == []


def test_a_command_for_an_unreachable_api_fails_in_one_line_without_redis_or_the_intake(
    storage_settings: StorageSettings,
) -> None:
    done, loaded = loaded_by(
        storage_settings,
        "status",
        "abcdef12",
        KILN_API_URL="http://127.0.0.1:9",  # the discard port: nothing listens there
        KILN_API_KEY="kiln_test_key",
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[0].startswith("kiln: ")
    assert "Traceback" not in done.stderr
    assert "httpx" in loaded
    assert [m for m in ("redis", *SUBMITTING) if m in loaded] == []


def test_an_unknown_job_is_one_line_and_loads_no_intake(storage_settings: StorageSettings) -> None:
    done, loaded = loaded_by(storage_settings, "status", "abcdef12")
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[0] == "kiln: no such job: abcdef12"
    assert "kiln.tasks.intake.intake" not in loaded


def test_a_command_loads_no_other_commands_module(storage_settings: StorageSettings) -> None:
    # Its parser alone is built (tasks/cli/main.py COMMANDS): `kiln status` needs no batch,
    # admin, usage, dead-letter, control or pipeline-check command, nor their parsers' imports.
    done, loaded = loaded_by(storage_settings, "status", "abcdef12", "--json")
    assert done.returncode == 1, done.stderr
    assert "kiln.tasks.cli.commands" in loaded  # the probe sees the command's own module
    others = ("admin", "batch", "usage", "dead", "control", "pipeline")
    assert [m for m in others if f"kiln.tasks.cli.{m}" in loaded] == []
