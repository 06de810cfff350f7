"""Settings are checked as a whole, through the real console script.

Unknown `KILN_*` names stop every command, `kiln config` shows each setting's value and source
with secrets masked, long-running commands say at start which Redis, namespace and store they use.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.settings_check import TEST_AND_DEPLOY_NAMES, known_names
from kiln.storage.boundary import _SCRIPT_ERRORS
from kiln.storage.settings import StorageSettings
from tests.waiting import wait_for_line

KILN = Path(sys.executable).with_name("kiln")  # the console script installed next to python
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0
# Nothing listens on port 1: a command that got past the check would fail on Redis instead.
NO_REDIS = "redis://127.0.0.1:1/0"


def run_kiln(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`kiln ARGS...` to completion with `env` over this process's environment."""
    return subprocess.run(
        [str(KILN), *args],
        env={**os.environ, "KILN_REDIS_URL": NO_REDIS, **env},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.mark.parametrize(
    "args",
    [("status", "0123456789ab"), ("submit", "a fox", "--width", "64"), ("config",)],
)
def test_an_unknown_setting_stops_the_command_naming_the_closest_one(args: tuple[str]) -> None:
    done = run_kiln(*args, KILN_REDIS_UR="redis://127.0.0.1:6401/0")
    assert done.returncode == 2, done.stderr
    assert done.stderr == "kiln: unknown setting KILN_REDIS_UR (did you mean KILN_REDIS_URL?)\n"
    assert done.stdout == ""


def test_several_unknown_settings_are_one_line() -> None:
    done = run_kiln("config", KILN_WEBHOK_SECRET="x", KILN_ZZZZZZ="1")
    assert done.returncode == 2
    assert done.stderr == (
        "kiln: unknown settings KILN_WEBHOK_SECRET (did you mean KILN_WEBHOOK_SECRET?), "
        "KILN_ZZZZZZ\n"
    )


def test_the_declared_test_and_deploy_names_pass() -> None:
    declared = {name: "1" for name in TEST_AND_DEPLOY_NAMES}
    done = run_kiln("config", **declared)
    assert done.returncode == 0, done.stderr
    # declared, not exempted by a pattern: a made-up name of the same shape is still refused
    assert run_kiln("config", KILN_TEST_NOSUCH="1").returncode == 2


def test_every_kiln_name_the_tests_and_deploy_files_use_is_known() -> None:
    sources = [REPO / p for p in ("tests", "deploy", ".ci")] + [
        REPO / p for p in ("docker-compose.yml", "Dockerfile", "Makefile")
    ]
    files = [f for s in sources for f in ([s] if s.is_file() else s.rglob("*")) if f.is_file()]
    used = set()
    for path in files:
        if path.suffix in {".pyc", ".png", ".safetensors", ".bin"} or path == Path(__file__):
            continue  # this file's misspellings are on purpose
        used |= set(re.findall(r"\bKILN_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="ignore")))
    not_settings = set(_SCRIPT_ERRORS)  # error codes of the Lua scripts, not variables
    # what Kubernetes' Service links would inject: the manifests turn the links off and the
    # manifest lint refuses these names (tests/deploy), so they are named there on purpose
    not_settings |= {"KILN_API_SERVICE_HOST", "KILN_REDIS_PORT"}
    assert sorted(used - not_settings - known_names()) == []


def test_kiln_config_shows_values_sources_and_masks_secrets() -> None:
    done = run_kiln(
        "config",
        "--json",
        "--set",
        "KILN_API_PORT=9123",
        "--set",
        "lease_ttl_s=7",
        KILN_REDIS_URL="redis://kiln:hunter2@db.example:6380/2",
        KILN_WEBHOOK_SECRET="whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        KILN_API_KEY_PEPPER="pepper-value",
        KILN_S3_ACCESS_KEY_ID="AKIDEXAMPLE",
        KILN_S3_SECRET_ACCESS_KEY="s3-secret-value",
        KILN_LEASE_TTL_S="9",
    )
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: (row["value"], row["source"]) for row in json.loads(done.stdout)}
    assert rows["KILN_REDIS_URL"] == ("redis://kiln:***@db.example:6380/2", "environment")
    assert rows["KILN_WEBHOOK_SECRET"] == ("***", "environment")
    assert rows["KILN_API_KEY_PEPPER"] == ("***", "environment")
    assert rows["KILN_S3_SECRET_ACCESS_KEY"] == ("***", "environment")
    assert rows["KILN_S3_ACCESS_KEY_ID"] == ("AKIDEXAMPLE", "environment")  # an id, not a secret
    assert rows["KILN_API_PORT"] == ("9123", "flag")
    assert rows["KILN_LEASE_TTL_S"] == ("7.0", "flag")  # a flag wins over the environment
    assert rows["KILN_MAX_ATTEMPTS"] == ("3", "default")
    for secret in ("hunter2", "MfKQ9r8", "pepper-value", "s3-secret-value"):
        assert secret not in done.stdout


def test_kiln_config_text_is_one_line_per_setting(tmp_path: Path) -> None:
    done = run_kiln("config", KILN_HOME=str(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()}
    assert lines["KILN_HOME"] == ["environment", str(tmp_path)]
    assert lines["KILN_STORAGE_URL"] == ["default", f"file://{tmp_path}/outputs"]


def test_a_setting_name_kiln_config_does_not_know_is_a_usage_error() -> None:
    done = run_kiln("config", "--set", "KILN_API_PROT=1")
    assert done.returncode == 2
    assert done.stderr == (
        "kiln: --set 'KILN_API_PROT=1': expected NAME=VALUE with a known setting "
        "(did you mean KILN_API_PORT?)\n"
    )


def test_a_relative_storage_url_stops_the_command_in_one_line() -> None:
    done = run_kiln("status", "0123456789ab", KILN_STORAGE_URL="file://./kiln-outputs")
    assert done.returncode == 2
    assert done.stderr.startswith("kiln: invalid setting KILN_STORAGE_URL: ")
    assert "is relative" in done.stderr
    assert len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("command", [("api", "--port", "0"), ("worker", "--concurrency", "1")])
def test_a_long_running_command_logs_redis_namespace_and_storage_at_start(
    command: tuple[str, ...], storage_settings: StorageSettings, tmp_path: Path
) -> None:
    # a password the test Redis does not check, to see it masked
    url = storage_settings.redis_url.replace("redis://", "redis://default:hunter2@", 1)
    env = {
        **os.environ,
        "KILN_REDIS_URL": url,
        "KILN_REDIS_NAMESPACE": storage_settings.redis_namespace,
        "KILN_STORAGE_URL": storage_settings.storage_url,
    }
    log = tmp_path / "stderr.log"
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [str(KILN), *command], env=env, stdout=subprocess.DEVNULL, stderr=stderr
        )
    try:
        line = wait_for_line(log, f"kiln {command[0]}: redis ", process, timeout_s=TIMEOUT_S)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(TIMEOUT_S)
    masked = url.replace("hunter2", "***")
    assert line.endswith(
        f"kiln {command[0]}: redis {masked}, namespace {storage_settings.redis_namespace}, "
        f"storage {storage_settings.storage_url}"
    )
    assert "hunter2" not in log.read_text()
