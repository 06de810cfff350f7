"""The sweeper's pass (tasks/control/sweeper.py), on real Redis with a recording publish."""

from __future__ import annotations

from kiln.storage.job_store import JobStore
from kiln.tasks.control.sweeper import sweep_unpublished
from tests.storage.helpers import new_job
from tests.tasks.control.conftest import QUEUE, ControlFactory


def test_a_control_process_publishes_what_it_owes_with_its_sweeper(
    make_control: ControlFactory, job_store: JobStore
) -> None:
    # `kiln control` runs no node loops: its own failed re-publishes go with the sweeper's pass
    harness = make_control()
    record, _ = job_store.create_job(new_job(queue=QUEUE))
    job_store.mark_published(record.id)  # confirmed: no sweep of unconfirmed jobs publishes it
    harness.ctx.submitter.owe(record.id)
    sweep_unpublished(harness.ctx)
    assert [job_id for job_id, _, _ in harness.published] == [record.id]
    assert harness.ctx.submitter.owed() == []
