"""Everything Kiln relies on inside kombu's Redis transport, behind one wall.

kombu documents its Redis transport's options, not how it stores messages. Kiln reads and
writes that storage directly in four ways, and mends one way its channel closes, each one a fact
about kombu's code rather than its API; this module is the only one that knows them,
pyproject.toml bounds kombu's version, and tests/tasks/test_kombu_contract.py fails when an
installed kombu changes any of the first four (the fifth: tests/e2e/test_recovery.py):

1. **Queue lists** (`queue_list_keys`). A message waiting in queue `q` is an LPUSHed JSON
   envelope (`Channel._put`) in the list `prefix + q` for priority 0, `prefix + q + sep + step`
   for the other `priority_steps` (`Channel._q_for_pri`).
2. **The push, captured** (`PushCapture`). A channel whose `_put` hands back the list key and
   the serialized envelope instead of pushing them: the job creation script pushes that message
   itself, with the record (tasks/queue/messages.py).
3. **The `unacked` layout** (`unacked_keys`, `run_job_id`). `QoS.append` records a delivery
   in the hash `unacked` (delivery tag -> JSON `[envelope, exchange, routing key]`) and the
   sorted set `unacked_index` (tag -> the consumer's `time()`, in seconds), in one pipeline.
4. **The order of delivery and recording.** `Channel._brpop_read` pops a message (BRPOP), then
   `_deliver` runs the consumer's wrapper, which calls `QoS.append` before the consumer's own
   callback (Celery's task strategy, tasks/node/held.py). Two consequences Kiln's recovery is
   built on: a message the strategy sees is already in `unacked` (a node killed before it lists
   the message is found there: tasks/control/unacked.py), and a message between the pop and the
   record is in neither place (a node killed there loses it: tasks/control/audit.py).
5. **A channel closed after a broken connection** (`Transport`, `SentinelTransport`: every
   Kiln process's transports for its Redis broker, registered by tasks/queue/app.py). A
   consumer whose connection breaks with a BRPOP in flight closes its channel twice: first in
   `Connection.collect`, where `Channel.close` reads that BRPOP's reply, meets the broken
   socket and raises, leaving the channel open; then in `Connection.close`, after `collect`
   took the transport's client away, where restoring the unacknowledged messages builds a
   connection pool from that missing client and raises AttributeError, which stops Celery's
   consumer and so the node (kombu issues #582, #970: every Redis restart did, on an idle node
   holding a countdown). The channels here read that reply themselves first, ignoring the
   broken connection, so the first close goes through: the restore is tried once, while the
   client is there (a failed restore leaves the messages in `unacked`: the jobs Celery had are
   owed a message, tasks/node/held.py; the others are the restart audit's,
   tasks/control/audit.py `audit_after_restart`).

The envelope's fields Kiln reads (`properties.body_encoding` base64, `properties.delivery_tag`,
`headers.task`, `content-type`, `content-encoding`) are kombu's virtual transport's and Celery's
message protocol 2; `envelope_parts` and `run_job_id` are their only readers.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
from queue import Empty
from typing import Any

from celery import Celery
from kombu import Connection, Producer
from kombu.serialization import loads
from kombu.transport import redis as redis_transport
from kombu.utils.json import dumps

from kiln.tasks.queue.app import RUN_JOB_TASK

log = logging.getLogger(__name__)


def _options(app: Celery) -> dict[str, Any]:
    return dict(app.conf.broker_transport_options or {})


def queue_list_keys(app: Celery, queue: str) -> list[str]:
    """The Redis lists kombu keeps `queue`'s waiting messages in: one per priority step."""
    options = _options(app)
    prefix = str(options.get("global_keyprefix", ""))
    sep = str(options.get("sep", redis_transport.Channel.sep))
    steps = options.get("priority_steps", redis_transport.Channel.priority_steps)
    # Channel._q_for_pri: priority 0 is the bare queue name
    return [prefix + (f"{queue}{sep}{step}" if step else queue) for step in steps]


def unacked_keys(app: Celery) -> tuple[str, str]:
    """The `unacked_index` and `unacked` keys of kombu for `app`'s broker (with its key prefix)."""
    options = _options(app)
    prefix = str(options.get("global_keyprefix", ""))
    index = str(options.get("unacked_index_key", redis_transport.Channel.unacked_index_key))
    deliveries = str(options.get("unacked_key", redis_transport.Channel.unacked_key))
    return prefix + index, prefix + deliveries


def run_job_id(delivery: str) -> str | None:
    """The job id of a `run_job` delivery as kombu records it in `unacked`.

    None for another task's message or one that does not decode (it is left to kombu).
    """
    try:
        message = json.loads(delivery)[0]  # [envelope, exchange, routing key]
        if message["headers"].get("task") != RUN_JOB_TASK:
            return None
        body = message["body"]
        if message["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = loads(body, message["content-type"], message["content-encoding"])[0]
        return str(args[0])
    except (ValueError, LookupError, TypeError, AttributeError):
        log.warning("an unacked delivery that does not decode as a kiln message; left to kombu")
        return None


def listed_run_job_id(entry: str) -> str | None:
    """The job id of a queue list entry (an envelope alone), or None (not a `run_job` message)."""
    return run_job_id(f"[{entry}]")


def envelope_parts(envelope: dict[str, Any]) -> tuple[str, str]:
    """The encoded body and the delivery tag of a parsed envelope that kombu would push.

    Raises ValueError unless the body is base64, the only encoding whose text a job's message
    is built from (tasks/queue/messages.py `_Template`).
    """
    if envelope["properties"].get("body_encoding") != "base64":
        raise ValueError("kombu no longer encodes Redis message bodies as base64")
    return str(envelope["body"]), str(envelope["properties"]["delivery_tag"])


class _ClosingChannel(redis_transport.Channel):
    """kombu's Redis channel, whose close survives a broken connection (item 5)."""

    def close(self) -> None:
        """Read a BRPOP in flight (ignoring a broken connection), then close as kombu does."""
        if self._in_poll:  # type: ignore[attr-defined]
            with contextlib.suppress(Empty, *self.connection_errors):  # type: ignore[attr-defined]
                self._brpop_read()  # type: ignore[attr-defined]
        super().close()


class Transport(redis_transport.Transport):
    """kombu's Redis transport with `_ClosingChannel` (a `redis://` or `rediss://` broker)."""

    Channel = _ClosingChannel


class _ClosingSentinelChannel(_ClosingChannel, redis_transport.SentinelChannel):
    """`_ClosingChannel` on a `sentinel://` broker."""


class SentinelTransport(redis_transport.SentinelTransport):
    """kombu's Sentinel transport with `_ClosingSentinelChannel`."""

    Channel = _ClosingSentinelChannel


class _CapturingChannel(redis_transport.Channel):
    """A Redis transport channel that keeps the messages it would push instead of pushing them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.captured: list[tuple[str, str]] = []

    def _put(self, queue: str, message: dict[str, Any], **_kwargs: Any) -> None:
        # what kombu's `_put` pushes, and where: (the stubs lack these attributes)
        if self._expires and queue in self._expires:  # type: ignore[attr-defined]
            raise ValueError(f"queue {queue!r} expires: its messages are published by kombu")
        priority = self._get_message_priority(message, reverse=False)
        key = self._q_for_pri(queue, priority)  # type: ignore[attr-defined]
        self.captured.append((self.global_keyprefix + key, dumps(message)))


class _CapturingTransport(redis_transport.Transport):
    Channel = _CapturingChannel


class _CapturingSentinelChannel(_CapturingChannel, redis_transport.SentinelChannel):
    """`_CapturingChannel` on a `sentinel://` broker: it connects (one PING) to the primary."""


class _CapturingSentinelTransport(redis_transport.SentinelTransport):
    Channel = _CapturingSentinelChannel


class PushCapture:
    """A producer on `app`'s broker whose messages are kept, not pushed: (list key, envelope).

    One thread at a time (a kombu channel is); the caller holds the lock.
    """

    def __init__(self, app: Celery) -> None:
        self._connection = Connection(
            app.conf.broker_url,
            transport=(
                _CapturingSentinelTransport
                if str(app.conf.broker_url).startswith("sentinel://")
                else _CapturingTransport
            ),
            transport_options=_options(app),
        )
        self._channel: _CapturingChannel | None = None
        self._producer: Producer | None = None

    def producer(self) -> Producer:
        """The producer to publish through (its channel opened on first use)."""
        if self._producer is None:
            channel = self._connection.channel()
            assert isinstance(channel, _CapturingChannel)
            self._channel, self._producer = channel, Producer(channel)
        return self._producer

    def take(self) -> list[tuple[str, str]]:
        """The (list key, serialized envelope) pairs captured since the last call."""
        if self._channel is None:
            return []
        captured = list(self._channel.captured)
        self._channel.captured.clear()
        return captured

    def close(self) -> None:
        """Release the channel's Redis connections."""
        self._connection.release()
