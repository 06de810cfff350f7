"""`kiln usage` as a user runs it: straight on Redis, and through the API.

On Redis it shows every key's; through the API a key's own, an admin's every key's. Its CSV for
two keys equals the sums of the jobs' records.
"""

from __future__ import annotations

import csv
import io
import math

import pytest

from kiln.common.accounting import AttemptSteps
from kiln.common.ledger import AttemptUsage
from tests.tasks.helpers import Api, start_job
from tests.tasks.test_cli_habits import kiln
from tests.tasks.test_usage_api import submit

# the GPU-seconds of each attempt, by key: uneven shares of batches, as a node charges them
ATTEMPTS = {"alice": [0.731, 1.2, 0.0417], "bob": [2.5, 0.333333]}


def run_jobs(api: Api) -> dict[str, list[str]]:
    store, jobs = api.store, dict[str, list[str]]()
    for who, charges in ATTEMPTS.items():
        jobs[who] = []
        for index, gpu_s in enumerate(charges):
            job_id = submit(api, who, "tiny" if index % 2 == 0 else "tiny-video")
            pipeline = store.get(job_id).request["pipeline"]
            usage = AttemptUsage(pipeline=pipeline, gpu_s=gpu_s).as_dict()
            store.succeed(job_id, start_job(store, job_id), [], {}, AttemptSteps(0, 1, 0.1, usage))
            jobs[who].append(job_id)
    return jobs


def rows(text: str) -> dict[str, dict[str, str]]:
    return {row["key_id"]: row for row in csv.DictReader(io.StringIO(text))}


@pytest.mark.parametrize("remote", [None, "admin"])
def test_csv_of_two_keys_equals_their_records_sums(api: Api, remote: str | None) -> None:
    jobs = run_jobs(api)
    got = kiln(api, "usage", "--since", "24h", "--csv", remote=remote)
    assert got.returncode == 0, got.stderr
    table = rows(got.stdout)
    for who, job_ids in jobs.items():
        records = [api.store.get(job_id) for job_id in job_ids]
        row = table[api.key_ids[who]]
        assert float(row["gpu_s"]) == pytest.approx(math.fsum(r.ledger.gpu_s for r in records))
        assert int(row["attempts"]) == sum(r.attempts for r in records)
        assert row["energy_j"] == ""  # no NVML here: not measured


def test_through_the_api_a_key_sees_its_own_row_only(api: Api) -> None:
    run_jobs(api)
    got = kiln(api, "usage", "--csv", "--group-by", "pipeline", remote="bob")
    assert got.returncode == 0, got.stderr
    table = list(csv.DictReader(io.StringIO(got.stdout)))
    assert [(r["pipeline"], float(r["gpu_s"])) for r in table] == [
        ("tiny", 2.5),
        ("tiny-video", 0.333333),
    ]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--since", "nan"], "--since"),
        (["--since", "1h", "--until", "2h"], "--since"),
        (["--until", "soon"], "--until"),
        (["--group-by", "owner"], "--group-by"),
    ],
)
def test_a_malformed_range_is_exit_2_naming_the_flag(api: Api, args: list[str], says: str) -> None:
    got = kiln(api, "usage", *args)
    assert got.returncode == 2, (got.stdout, got.stderr)
    assert says in got.stderr
    assert "Traceback" not in got.stderr
