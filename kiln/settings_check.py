"""Kiln's settings as a whole: every `KILN_*` name, the check for unknown ones, effective values.

Three pydantic-settings classes read the `KILN_` prefix (storage, gpu_worker, tasks), each
ignoring the others' names, so none of them alone can tell a typo from a sibling's setting. This
module knows all three (it sits above the packages, so every layer's class is visible here) and
the names only the tests and deploy files read, declared one by one below. The CLI runs
`unknown_settings` before every command (tasks/cli/config.py) and prints `effective_settings`
for `kiln config`.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import SecretStr
from pydantic_settings import BaseSettings

from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.storage.settings import StorageSettings, masked_url
from kiln.tasks.contract.settings import KilnSettings

PREFIX = "KILN_"
SETTINGS_CLASSES: tuple[type[BaseSettings], ...] = (
    StorageSettings,
    GpuWorkerSettings,
    KilnSettings,
)
# KILN_* names that are no setting of Kiln's: read only by the test suite, its benchmarks and
# the Makefile / .ci scripts. Each one is declared (no pattern), so a typo of one is caught too.
TEST_AND_DEPLOY_NAMES: dict[str, str] = {
    "KILN_TEST_REDIS_URL": "the Redis the tests use (.ci/ensure-redis, Makefile)",
    "KILN_TEST_COLD_CACHE": "`make test` promises empty model caches (tests/gpu_worker)",
    "KILN_TEST_STEP_SECONDS": "test pipelines: sleep per denoising step (tests/e2e/pipelines.py)",
    "KILN_TEST_STEP_LOG": "test pipelines: file of the steps taken (tests/e2e/pipelines.py)",
    "KILN_TEST_COMPLETIONS": "test pipelines: file of the finished requests",
    "KILN_TEST_COUNT_LOG": "counting pipeline: file of the rows computed (tests/gpu_worker)",
    "KILN_TEST_RACE_ROUNDS": "rounds of the output fencing race (tests/e2e/test_output_fencing.py)",
    "KILN_TEST_ARTIFACTS": "folder the browser test copies its screenshot to (test_console.py)",
    "KILN_TEST_PROBE": "probe pipeline: a value each rank reports from its environment",
    "KILN_TEST_PROBE_DIR": "probe pipeline: folder of each rank's report (tests/gpu_worker)",
    "KILN_BATCH_CRASH_LINES": "size of the batch crash test (`make test-soak`)",
    "KILN_FUZZ_EXAMPLES": "examples of the API fuzz test",
    "KILN_HOSTILE_EXAMPLES": "examples of the API hostile-input test",
    "KILN_BENCH_FORWARDS": "benchmarks: file of the forwards a busy pipeline ran",
    "KILN_BENCH_SLEEP_S": "benchmarks: the busy pipeline's sleep per request",
    "KILN_BENCH_SMOKE": "benchmarks: shrink the CUDA DiT to check it on a CPU",
    "KILN_BENCH_TORCH_THREADS": "benchmarks: torch threads of each side",
}
# values never shown in full: SecretStr fields and anything named like a credential
_SECRET_NAME = re.compile(r"secret|password|pepper|token|(^|_)api_key$")

Source = Literal["default", "environment", "flag"]


class UnknownSetting(ValueError):
    """A `KILN_*` variable that no settings class and no declared test or deploy name has."""


def setting_names() -> dict[str, tuple[type[BaseSettings], str]]:
    """Every settings variable (`KILN_REDIS_URL`) → its class and field name."""
    return {
        f"{PREFIX}{field}".upper(): (cls, field)
        for cls in SETTINGS_CLASSES
        for field in cls.model_fields
    }


def known_names() -> frozenset[str]:
    """Every `KILN_*` name allowed in the environment: the settings and the declared others."""
    return frozenset(setting_names()) | frozenset(TEST_AND_DEPLOY_NAMES)


def closest_setting(name: str) -> str | None:
    """The known name `name` most likely misspells, if any is close."""
    # compared without the shared prefix, which would make every pair look alike
    bare = {known.removeprefix(PREFIX): known for known in known_names()}
    word = name.upper().removeprefix(PREFIX)
    matches = difflib.get_close_matches(word, sorted(bare), n=1, cutoff=0.6)
    return bare[matches[0]] if matches else None


def unknown_settings(environ: Mapping[str, str]) -> list[str]:
    """The `KILN_*` variables of `environ` that are no known name (case as pydantic reads it)."""
    known = known_names()
    return sorted(
        name for name in environ if name.upper().startswith(PREFIX) and name.upper() not in known
    )


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise UnknownSetting naming each unknown `KILN_*` variable and its closest setting."""
    unknown = unknown_settings(os.environ if environ is None else environ)
    if not unknown:
        return
    parts = []
    for name in unknown:
        guess = closest_setting(name)
        parts.append(f"{name} (did you mean {guess}?)" if guess else name)
    noun = "setting" if len(unknown) == 1 else "settings"
    raise UnknownSetting(f"unknown {noun} " + ", ".join(parts))


@dataclass(frozen=True)
class EffectiveSetting:
    """One setting as a process would use it: its variable, shown value and where it came from."""

    name: str
    value: str
    source: Source


def effective_settings(
    environ: Mapping[str, str] | None = None, flags: Mapping[str, str] | None = None
) -> list[EffectiveSetting]:
    """Every setting's effective value (secrets masked) and source; `flags` override by field."""
    environ = os.environ if environ is None else environ
    flags = flags or {}
    in_env = {name.upper() for name in environ}
    rows = []
    for cls in SETTINGS_CLASSES:
        given: dict[str, Any] = {f: v for f, v in flags.items() if f in cls.model_fields}
        instance = cls(**given)
        for field in cls.model_fields:
            name = f"{PREFIX}{field}".upper()
            source: Source = (
                "flag" if field in given else "environment" if name in in_env else "default"
            )
            value = shown_value(field, getattr(instance, field))
            rows.append(EffectiveSetting(name, value, source))
    return rows


def shown_value(field: str, value: Any) -> str:
    """A setting's value as `kiln config` and logs show it: secrets masked, lists comma-joined."""
    if value is None:
        return "(unset)"
    if isinstance(value, SecretStr):
        return "***" if value.get_secret_value() else ""
    if isinstance(value, list):
        return ",".join(str(item) for item in value)
    text = str(value)
    if _SECRET_NAME.search(field) and text:
        return "***"
    return masked_url(text) if "://" in text else text
