"""The Celery app and its reliability configuration (docs/operations.md §5).

Importing this module never imports torch: producers publish by task name, and only the node
worker imports `node.jobs`, where the GPU work lives.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from celery import Celery
from kombu import Queue
from kombu.transport import TRANSPORT_ALIASES

from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.lanes import WEBHOOKS_QUEUE, LanePriorityCycle

RUN_JOB_TASK = "kiln.run_job"


def transport_options(settings: KilnSettings, namespace: str) -> dict[str, Any]:
    """Redis transport options; the visibility timeout is the same everywhere it is read."""
    return {
        # Queues live under the same namespace as Kiln's own keys: deployments sharing one
        # Redis never see each other's tasks.
        "global_keyprefix": f"{namespace}:celery:",
        "visibility_timeout": settings.visibility_timeout_s,
        # Restore unacked messages of dead workers promptly once the visibility timeout passes.
        "unacked_restore_interval": 5,
        "unacked_restore_throttle": 1,
        "queue_order_strategy": f"{LanePriorityCycle.__module__}:{LanePriorityCycle.__name__}",
    }


def broker_url(settings: KilnSettings, storage_settings: StorageSettings) -> str:
    """KILN_BROKER_URL, else Kiln's Redis: `redis_url`, or kombu's `sentinel://` list for it.

    Through Sentinels the broker finds the same primary the store does (its database, user and
    password from `redis_url`), so a job's message and its record stay on one Redis.
    """
    if settings.broker_url:
        return settings.broker_url
    if not storage_settings.redis_sentinels:
        return storage_settings.redis_url
    parts = urlsplit(storage_settings.redis_url)
    credentials = parts.netloc.rpartition("@")[0]
    user_info = f"{credentials}@" if credentials else ""
    return ";".join(
        f"sentinel://{user_info}{address}{parts.path}"
        for address in storage_settings.redis_sentinels
    )


# kombu's Redis transports with a channel whose close survives a broken connection (named, not
# imported: tasks/queue/kombu_redis.py, item 5, imports this module). Registered under kombu's
# own scheme names, so what kombu derives from the name still holds: TLS for `rediss://`, and the
# transport of a `;`-separated list of URLs after kombu switches to the next one.
KILN_TRANSPORTS = {
    "redis": "kiln.tasks.queue.kombu_redis:Transport",
    "rediss": "kiln.tasks.queue.kombu_redis:Transport",
    "sentinel": "kiln.tasks.queue.kombu_redis:SentinelTransport",
}


def make_celery_app(settings: KilnSettings, storage_settings: StorageSettings) -> Celery:
    """A Celery app for producers and workers alike; status lives in Kiln's store, not here."""
    TRANSPORT_ALIASES.update(KILN_TRANSPORTS)  # for every kombu connection of this process
    broker = broker_url(settings, storage_settings)
    options = transport_options(settings, storage_settings.redis_namespace)
    if broker.startswith("sentinel://"):  # kombu's Sentinel transport asks for this primary
        options["master_name"] = storage_settings.redis_sentinel_master
    app = Celery("kiln", broker=broker, set_as_current=False)
    LanePriorityCycle.bulk_every = settings.bulk_share_every
    app.conf.update(
        task_acks_late=True,
        # A task that raises (a failed job ends FAILURE: tasks/node/outcomes.py) is acknowledged
        # like one that returns; only a lost worker's messages are delivered again.
        task_acks_on_failure=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        result_backend=None,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        broker_transport_options=options,
        broker_connection_retry_on_startup=True,
        task_default_queue=WEBHOOKS_QUEUE,
        task_queues=[Queue(WEBHOOKS_QUEUE)],
        task_create_missing_queues=True,
        # Task events for Flower (KILN_TASK_EVENTS): workers send received/started/succeeded/
        # failed/retried/revoked, producers task-sent.
        worker_send_task_events=settings.task_events,
        task_send_sent_event=settings.task_events,
        # Kiln's time limits are its own (the threads pool enforces none).
        task_time_limit=None,
        task_soft_time_limit=None,
        include=["kiln.tasks.webhooks.enqueue"],
    )
    return app
