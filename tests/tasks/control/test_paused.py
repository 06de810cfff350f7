"""A job paused past KILN_PAUSED_RETENTION_S expires, its step checkpoints deleted."""

from __future__ import annotations

from kiln.common.states import JobState
from kiln.storage.checkpoints import Checkpoints
from kiln.storage.objects import new_attempt_name
from kiln.tasks.control.paused import expire_paused
from tests.tasks.control.conftest import ControlFactory
from tests.tasks.helpers import queued_job, start_job


def test_a_job_paused_past_its_retention_expires_and_loses_its_checkpoints(
    make_control: ControlFactory,
) -> None:
    ctx = make_control().ctx
    store = ctx.store
    old, kept = queued_job(store), queued_job(store)
    token = start_job(store, old)
    checkpoint = Checkpoints(store, ctx.objects).write(
        old, token, new_attempt_name(token), 3, b"latents"
    )
    store.pause(old)
    store.pause_stopped(old, token)
    store.pause(kept)
    assert expire_paused(ctx) == 0  # both paused just now
    store.redis.hset(store.keys.job(old), "paused_at", "1000.0")  # paused long ago

    assert expire_paused(ctx) == 1
    record = store.get(old)
    assert record.state == JobState.EXPIRED
    assert store.events(old)[-1].payload["reason"] == "paused_retention"
    assert ctx.objects.head(checkpoint.key) is None  # no attempt reads it now
    assert store.get(kept).state == JobState.PAUSED
    assert expire_paused(ctx) == 0
