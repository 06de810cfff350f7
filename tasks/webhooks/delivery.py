"""One webhook delivery attempt: send the message pinned, classify, schedule, record.

`deliver_once` is what the Celery task in `webhooks.enqueue` runs; it never touches a job's state,
so a failing receiver cannot change a job's outcome (docs/contract.md §7). What a message says and
how it is signed is `webhooks.message`; the retry schedule is `contract.backoff.scheduled_delay`.
"""

from __future__ import annotations

import email.utils
import logging
import random
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC
from typing import Any, Literal

import httpx

from kiln.common.tracing import (
    JOB_ID_ATTRIBUTE,
    WEBHOOK_ATTEMPT_ATTRIBUTE,
    WEBHOOK_EVENT_ATTRIBUTE,
    WEBHOOK_OUTCOME_ATTRIBUTE,
    WEBHOOK_SPAN,
    Carrier,
    SpanKind,
    job_carrier,
    span,
)
from kiln.storage.errors import JobNotFound
from kiln.storage.job_store import JobEvent, JobRecord, JobStore
from kiln.storage.objects import ObjectStore
from kiln.storage.webhook_attempts import WebhookAttemptOps
from kiln.tasks.contract.backoff import scheduled_delay
from kiln.tasks.contract.job_spec import JobSpec, JobSpecRefused
from kiln.tasks.contract.responses import WebhookOutcome
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.webhooks.message import find_event, signed_headers, webhook_payload
from kiln.tasks.webhooks.ssrf import (
    UnresolvableHost,
    UnsafeUrl,
    check_url,
    pinned_client,
    policy_from,
)

log = logging.getLogger(__name__)
# an attempt's outcome: one the attempt log shows, or skipped (not recorded: the URL is gone)
Outcome = WebhookOutcome | Literal["skipped"]


@dataclass(frozen=True)
class Delivery:
    """One webhook message and where it is in its schedule (what the Celery task carries)."""

    job_id: str
    event: str
    webhook_id: str
    attempt: int = 1
    not_before: float | None = None
    source: JobEvent | None = None  # the job event reported, pinned when the webhook was queued
    body: str | None = None  # fixed by the first attempt; every later attempt sends these bytes

    def as_kwargs(self) -> dict[str, Any]:
        """Task keyword arguments."""
        return {
            "job_id": self.job_id,
            "event": self.event,
            "webhook_id": self.webhook_id,
            "attempt": self.attempt,
            "not_before": self.not_before,
            "source": None if self.source is None else asdict(self.source),
            "body": self.body,
        }


def event_from_kwargs(source: dict[str, Any] | None) -> JobEvent | None:
    """The pinned job event of a task message (None in messages queued before events were)."""
    if source is None:
        return None
    return JobEvent(
        seq=int(source["seq"]),
        type=str(source["type"]),
        time=float(source["time"]),
        payload=dict(source["payload"]),
    )


@dataclass(frozen=True)
class WebhookDeps:
    """What a delivery needs: settings, the job store and the object store (for output URLs)."""

    settings: KilnSettings
    store: JobStore
    objects: ObjectStore | None


@dataclass(frozen=True)
class AttemptResult:
    """How an attempt went."""

    outcome: Outcome
    status_code: int | None = None
    error: str | None = None
    latency_ms: float | None = None
    retry_after: float | None = None


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or HTTP date); None if absent or bad."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(when.timestamp() - now, 0.0)


def send(url: str, headers: dict[str, str], payload: str, settings: KilnSettings) -> AttemptResult:
    """POST once to a checked, pinned address; never follows redirects."""
    policy = policy_from(settings.webhook_allow_http, settings.webhook_allow_hosts)
    try:
        target = check_url(url, policy)
    except UnresolvableHost as exc:
        return AttemptResult("retrying", error=str(exc))
    except UnsafeUrl as exc:
        return AttemptResult("refused", error=str(exc))
    started = time.perf_counter()
    try:
        with pinned_client(target, settings.webhook_timeout_s) as client:
            response = client.post(url, content=payload.encode(), headers=headers)
    except httpx.HTTPError as exc:
        latency = (time.perf_counter() - started) * 1000
        return AttemptResult("retrying", error=f"{type(exc).__name__}: {exc}", latency_ms=latency)
    latency = (time.perf_counter() - started) * 1000
    code = response.status_code
    if 200 <= code < 300:
        return AttemptResult("delivered", status_code=code, latency_ms=latency)
    if code == 410:
        return AttemptResult("gone", status_code=code, latency_ms=latency, error="410 Gone")
    retry_after = parse_retry_after(response.headers.get("retry-after"), time.time())
    return AttemptResult(
        "retrying",
        status_code=code,
        latency_ms=latency,
        error=f"HTTP {code}",
        retry_after=retry_after,
    )


def endpoint_gone(store: WebhookAttemptOps, job_id: str, url: str) -> bool:
    """Whether this job's endpoint already answered 410 (then nothing more is sent to it)."""
    return any(
        a.get("outcome") == "gone" and a.get("url") == url for a in store.webhook_attempts(job_id)
    )


def with_body(
    deps: WebhookDeps, delivery: Delivery, record: JobRecord, spec: JobSpec
) -> Delivery | None:
    """The delivery with its body fixed: kept if an earlier attempt fixed it, else built now.

    None when there is no event to report (a message from before events were pinned whose event
    is gone).
    """
    if delivery.body is not None:
        return delivery
    # messages queued before events were pinned carry none: the newest such event stands in
    source = delivery.source or find_event(deps.store, delivery.job_id, delivery.event)
    if source is None:
        return None
    body = webhook_payload(record, spec, delivery.event, source, deps.objects)
    return replace(delivery, source=source, body=body)


def readable_spec(record: JobRecord) -> JobSpec | None:
    """The job's decoded spec; None (logged) when this release cannot read it.

    A newer release's spec names no webhook this worker may trust: guessing at the raw dict is
    what the spec ends, so such a job has no webhook here (its own nodes run it and report it).
    """
    try:
        return JobSpec.decode(record.request)
    except JobSpecRefused as exc:
        log.warning("job %s: its webhook is not read (%s)", record.id, exc)
        return None


def _attempt_once(
    deps: WebhookDeps, delivery: Delivery, url: str, body: str, trace: Carrier
) -> AttemptResult:
    if endpoint_gone(deps.store, delivery.job_id, url):
        return AttemptResult("skipped", error="endpoint answered 410 Gone earlier")
    secret = deps.settings.webhook_secret
    if secret is None or not secret.get_secret_value():
        return AttemptResult("refused", error="no webhook secret configured (KILN_WEBHOOK_SECRET)")
    headers = signed_headers(secret.get_secret_value(), delivery.webhook_id, body, time.time())
    return send(url, {**headers, **trace}, body, deps.settings)


def _schedule(
    settings: KilnSettings, delivery: Delivery, result: AttemptResult, rng: random.Random
) -> tuple[Outcome, Delivery | None]:
    """The attempt's final outcome and the retry to send, if any (it carries the same body)."""
    if result.outcome != "retrying":
        return result.outcome, None
    delay = scheduled_delay(
        delivery.attempt,
        settings.webhook_retry_schedule_s,
        jitter=settings.webhook_retry_jitter,
        rng=rng,
        retry_after=result.retry_after,
        retry_after_max=settings.webhook_retry_after_max_s,
    )
    if delay is None:
        return "gave_up", None
    return "retrying", replace(
        delivery, attempt=delivery.attempt + 1, not_before=time.time() + delay
    )


def deliver_once(
    deps: WebhookDeps, delivery: Delivery, rng: random.Random | None = None
) -> Delivery | None:
    """Make one attempt, record it, and return the next delivery to schedule (or None)."""
    try:
        record = deps.store.get(delivery.job_id)
    except JobNotFound:
        log.warning("webhook %s: job %s is gone", delivery.webhook_id, delivery.job_id)
        return None
    # the job's spec, decoded once per message; one this release cannot read (a newer release
    # wrote it) names no URL this worker may trust, so the message is dropped, logged, unsent
    spec = readable_spec(record)
    webhook = None if spec is None else spec.webhook
    if spec is None or webhook is None:
        return None
    fixed = with_body(deps, delivery, record, spec)
    if fixed is None or fixed.body is None:
        log.warning("webhook %s: no %s event to report", delivery.webhook_id, delivery.event)
        return None
    facts = {
        JOB_ID_ATTRIBUTE: delivery.job_id,
        WEBHOOK_EVENT_ATTRIBUTE: str(delivery.event),
        WEBHOOK_ATTEMPT_ATTRIBUTE: delivery.attempt,
    }
    with span(WEBHOOK_SPAN, record.trace, kind=SpanKind.CLIENT, attributes=facts) as attempt:
        # the receiver's `traceparent`: this attempt's span, else the job's context as stored
        trace = job_carrier(attempt, record.trace)
        result = _attempt_once(deps, fixed, webhook.url, fixed.body, trace)
        if attempt is not None:
            attempt.set_attribute(WEBHOOK_OUTCOME_ATTRIBUTE, result.outcome)
    outcome, following = _schedule(deps.settings, fixed, result, rng or random.Random())
    if outcome != "skipped":
        _record(deps.store, fixed, webhook.url, replace(result, outcome=outcome), following)
    return following


def _record(
    store: WebhookAttemptOps,
    delivery: Delivery,
    url: str,
    result: AttemptResult,
    following: Delivery | None,
) -> None:
    attempt = {
        "webhook_id": delivery.webhook_id,
        "event": delivery.event,
        "attempt": delivery.attempt,
        "url": url,
        "time": time.time(),
        "status_code": result.status_code,
        "latency_ms": None if result.latency_ms is None else round(result.latency_ms, 3),
        "error": result.error,
        "outcome": result.outcome,
        "next_attempt_at": following.not_before if following else None,
    }
    store.record_webhook_attempt(delivery.job_id, attempt)


def hop_seconds(settings: KilnSettings) -> float:
    """Longest countdown one message may carry (half the visibility timeout)."""
    return max(1.0, settings.visibility_timeout_s / 2)
