"""Batch counters and the queued counter equal a recount after any sequence of operations."""

from __future__ import annotations

import secrets
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kiln.common.states import JobState
from kiln.storage.errors import IllegalTransition, LeaseHeld, StaleLease
from kiln.storage.job_store import JobStore, NewJob
from kiln.storage.settings import StorageSettings
from tests.conftest import delete_keys
from tests.storage.fed_batches import record_fed_batch

EXPECTED = (IllegalTransition, StaleLease, LeaseHeld)
ERROR = {"type": "x", "message": "x", "retryable": True}


class CountersMachine(RuleBasedStateMachine):
    """Random creations and transitions on one batch; counters are checked after each step."""

    base_settings: StorageSettings  # set by the test: Redis URL and namespace to derive from
    jobs = Bundle("jobs")

    def __init__(self) -> None:
        super().__init__()
        # deleted all at once by the test (one SCAN instead of one per example)
        self.namespace = f"{self.base_settings.redis_namespace}-ex{secrets.token_hex(4)}"
        self.store = JobStore.from_settings(
            self.base_settings.model_copy(update={"redis_namespace": self.namespace})
        )
        self.ids: list[str] = []
        self.tokens: dict[str, int] = {}

    @initialize()
    def make_batch(self) -> None:
        self.batches = record_fed_batch(self.store, "batch", 1000)

    @rule(target=jobs, bulk=st.integers(0, 3))
    def create(self, bulk: int) -> str:
        first = len(self.ids)
        news = [
            NewJob(id=f"j{first + i}", request={}, batch_id="batch") for i in range(max(bulk, 1))
        ]
        if bulk:
            self.store.create_jobs(news, chunk_size=2)
        else:
            self.store.create_job(news[0])
        self.ids += [n.id for n in news]
        return news[0].id

    @rule(job=jobs)
    def start(self, job: str) -> None:
        try:
            token = self.store.acquire_lease(job, "w")
            self.store.start(job, token)
            self.tokens[job] = token
        except EXPECTED:
            pass

    @rule(job=jobs, op=st.sampled_from(["succeed", "fail", "requeue", "finish_canceled"]))
    def finish(self, job: str, op: str) -> None:
        token = self.tokens.get(job, 0)
        try:
            if op == "succeed":
                self.store.succeed(job, token, [], {})
            elif op == "fail":
                self.store.fail(job, token or None, ERROR)
            elif op == "requeue":
                self.store.requeue(job, token, ERROR)
            else:
                self.store.finish_canceled(job, token)
        except EXPECTED:
            pass

    @rule(job=jobs, op=st.sampled_from(["cancel", "expire", "reap"]))
    def unfenced(self, job: str, op: str) -> None:
        try:
            if op == "cancel":
                self.store.cancel(job)
            elif op == "expire":
                self.store.expire(job)
            else:
                self.store.release_lease(job, self.tokens.get(job, 0))
                self.store.reap(job)
        except EXPECTED:
            pass

    @rule()
    def reaper_pass(self) -> None:
        reaped = self.store.reap_lapsed()  # running jobs only, each moved once
        after = self.store.get_many(reaped)
        back = (JobState.QUEUED, JobState.CANCELED, JobState.PAUSED)
        assert all(r is not None and r.state in back for r in after)
        assert not set(reaped) & set(self.store.reap_lapsed())

    @invariant()
    def counters_match(self) -> None:
        states = Counter(r.state for r in self.store.get_many(self.ids) if r)
        counts = self.batches.get_fed("batch").counts
        assert counts == {s: states.get(s, 0) for s in JobState}
        assert self.store.queue_depth() == states.get(JobState.QUEUED, 0)

    def teardown(self) -> None:
        self.store.redis.close()


def test_counters_equal_recount(storage_settings: StorageSettings) -> None:
    CountersMachine.base_settings = storage_settings
    try:
        run_state_machine_as_test(
            CountersMachine,
            settings=settings(
                max_examples=25,
                stateful_step_count=25,
                deadline=None,
                database=None,  # no example database written into the working tree
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        delete_keys(storage_settings.redis_url, f"{storage_settings.redis_namespace}-ex*:*")
