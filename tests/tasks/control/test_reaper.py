"""The reaper is safe with several processes running it: each lapsed job is reaped once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from kiln.common.states import JobState
from kiln.storage.job_store import JobStore
from kiln.tasks.control.reaper import reap_expired
from tests.storage.helpers import job_in_state, lapse_lease
from tests.tasks.control.conftest import ControlFactory


def test_two_reapers_reap_each_lapsed_job_once(
    make_control: ControlFactory, job_store: JobStore
) -> None:
    jobs = [job_in_state(job_store, JobState.RUNNING)[0] for _ in range(20)]
    live, _ = job_in_state(job_store, JobState.RUNNING)  # its lease is held: left alone
    for job_id in jobs:
        lapse_lease(job_store, job_id)
    first, second = make_control(), make_control()
    with ThreadPoolExecutor(2) as pool:
        counts = list(pool.map(reap_expired, [first.ctx, second.ctx]))
    assert sum(counts) == len(jobs)
    published = [job_id for job_id, _, _ in first.published + second.published]
    assert sorted(published) == sorted(jobs)  # each once, by whichever reaper won it
    assert {r.state for r in job_store.get_many(jobs) if r} == {JobState.QUEUED}
    assert job_store.get(live).state == JobState.RUNNING
