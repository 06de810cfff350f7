"""`kiln submit --speed exact|balanced|fast`: sent as the request's `speed`, default shown.

Submitted directly to Redis as the CLI does without `--api`; the pipelines' modes are announced
as a node's heartbeat announces them, so the submit checks the mode as the API does.
"""

from __future__ import annotations

import argparse

import pytest

from kiln.common.request import SPEED_KEY, SPEED_MODES
from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.cli.main import EXIT_USAGE, build_parser, main
from tests.tasks.test_inputs import TINY_SCHEMA

SMALL = ["--width", "64", "--height", "64"]


def submit_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    (subcommands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    submit: argparse.ArgumentParser = subcommands.choices["submit"]
    return submit


def test_the_help_names_the_modes_and_the_default() -> None:
    parser = submit_parser()
    (speed,) = [a for a in parser._actions if a.option_strings == ["--speed"]]
    assert tuple(speed.choices or ()) == SPEED_MODES
    assert speed.default is None  # left out of the request: the contract's default applies
    assert "(default: exact)" in " ".join(parser.format_help().split())
    assert build_parser().parse_args(["submit", "p", "--speed", "fast"]).speed == "fast"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["submit", "p", "--speed", "ludicrous"])


def test_the_mode_is_submitted_and_checked_as_the_api_checks_it(
    job_store: JobStore,
    storage_settings: StorageSettings,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KILN_REDIS_URL", storage_settings.redis_url)
    monkeypatch.setenv("KILN_REDIS_NAMESPACE", storage_settings.redis_namespace)
    monkeypatch.setenv("KILN_STORAGE_URL", storage_settings.storage_url)
    inputs = {
        "tiny": {**TINY_SCHEMA, SPEED_KEY: ["exact"]},
        "tiny-dit": {**TINY_SCHEMA, SPEED_KEY: list(SPEED_MODES)},
    }
    job_store.publish_node("node-a", {"pipelines": list(inputs), "inputs": inputs}, 30)

    assert main(["submit", "a fox", "--pipeline", "tiny-dit", *SMALL, "--speed", "fast"]) == 0
    fast = capsys.readouterr().out.strip()
    assert job_store.get(fast).request["speed"] == "fast"
    assert main(["submit", "a fox", "--pipeline", "tiny-dit", *SMALL]) == 0
    default = capsys.readouterr().out.strip()
    assert job_store.get(default).request.get("speed", "exact") == "exact"  # the default

    assert main(["submit", "a fox", "--pipeline", "tiny", *SMALL, "--speed", "fast"]) == EXIT_USAGE
    refused = capsys.readouterr().err.strip()
    assert refused.startswith("kiln: invalid job: speed:"), refused
    assert "exact" in refused
