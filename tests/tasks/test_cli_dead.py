"""`kiln dead list|show|redrive` as a user runs them: straight on Redis, and through the API."""

from __future__ import annotations

import json

import pytest

from tests.tasks.helpers import Api
from tests.tasks.test_cli_habits import kiln
from tests.tasks.test_dead_letter_routes import dead_jobs


@pytest.mark.parametrize("remote", [None, "alice"])
def test_list_show_and_a_dry_run_that_changes_nothing(api: Api, remote: str | None) -> None:
    ids = dead_jobs(api, 2)
    listed = kiln(api, "dead", "list", "--json", remote=remote)
    assert listed.returncode == 0, listed.stderr
    assert [d["id"] for d in json.loads(listed.stdout)["dead_letters"]] == ids[::-1]
    shown = kiln(api, "dead", "show", ids[0], remote=remote)
    assert shown.returncode == 0, shown.stderr
    assert f"job {ids[0]} failed" in shown.stdout
    assert "(poison: group_broken_twice)" in shown.stdout
    dry = kiln(api, "dead", "redrive", "--poison", "--dry-run", remote=remote)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[-1].startswith("2 would redrive")
    again = json.loads(kiln(api, "dead", "list", "--json", remote=remote).stdout)
    assert all(d["redriven_to"] is None for d in again["dead_letters"])


@pytest.mark.parametrize("remote", [None, "alice"])
def test_redrive_by_id_makes_a_job(api: Api, remote: str | None) -> None:
    [job_id] = dead_jobs(api, 1)
    done = kiln(api, "dead", "redrive", job_id, "--rate", "5", "--json", remote=remote)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    [item] = result["results"]
    assert item["outcome"] == "redriven"
    assert api.store.get(item["new_job_id"]).metadata["redrive_of"] == job_id


@pytest.mark.parametrize(
    "args",
    [
        ["dead", "redrive"],
        ["dead", "redrive", "a", "--error-type", "poison"],
        ["dead", "redrive", "a", "--rate", "0"],
        ["dead", "redrive", "a", "--rate", "x"],
        ["dead", "list", "--limit", "0"],
        ["dead", "show", "no-such-job"],
    ],
)
def test_mistakes_say_what_is_wrong_and_exit_2(api: Api, args: list[str]) -> None:
    got = kiln(api, *args)
    assert got.returncode == 2, (got.stdout, got.stderr)
    assert got.stderr.strip()
    assert "Traceback" not in got.stderr
