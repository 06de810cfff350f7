"""What applies to a whole batch, as `POST /v1/batches` takes it: query parameters or JSON fields.

The same options arrive as query parameters (a JSONL body) or as fields of a JSON body naming an
upload (`batch_uploads`); `batch_options` checks them the same way either way, and a refusal is a
422 naming the parameter where it was given (`["query", <name>]` or `["body", <name>]`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kiln.common.defaults import BATCH_LANE
from kiln.common.request import Lane
from kiln.tasks.api.auth import Principal
from kiln.tasks.api.deps import field_error
from kiln.tasks.api.json_guard import body_errors
from kiln.tasks.batches.intake import LineDefaults
from kiln.tasks.batches.service import BatchOptions, BatchService
from kiln.tasks.contract.batches import DEFAULT_COMPLETION_WINDOW, parse_completion_window
from kiln.tasks.contract.schemas import JobRequest, WebhookEvent, WebhookSpec


@dataclass(frozen=True)
class BatchParams:
    """The batch options as given (not checked yet)."""

    pipeline: str | None = None
    priority: Lane = BATCH_LANE
    completion_window: str = DEFAULT_COMPLETION_WINDOW
    skip_invalid: bool = False
    metadata: str | None = None  # JSON text of an object
    webhook_url: str | None = None
    webhook_events: str | None = None  # comma-separated


def _metadata(text: str | None, max_depth: int, where: str) -> dict[str, str]:
    if text is None:
        return {}
    strict = body_errors(text.encode("utf-8", "surrogatepass"), max_depth)
    if strict:
        msg = f"metadata is not strict JSON: {strict[0]['msg']}"
        raise field_error((where, "metadata"), msg, strict[0]["type"], None)
    try:
        parsed = json.loads(text)
        checked = JobRequest.model_validate({"prompt": "-", "metadata": parsed}).metadata
    except (ValueError, ValidationError) as exc:
        msg = f"metadata must be a JSON object of strings within the job limits: {exc}"
        raise field_error((where, "metadata"), msg, "metadata", text) from exc
    return dict(checked)


def _webhook(url: str | None, events: str | None, where: str) -> dict[str, Any] | None:
    if url is None:
        if events is not None:
            raise field_error((where, "webhook_events"), "needs webhook_url", "missing", events)
        return None
    chosen = [e.strip() for e in events.split(",")] if events else [WebhookEvent.completed]
    try:
        spec = WebhookSpec.model_validate({"url": url, "events": chosen})
    except ValidationError as exc:
        raise field_error((where, "webhook_url"), str(exc), "webhook", url) from exc
    return spec.model_dump(mode="json")


def _check_webhook(service: BatchService, webhook: dict[str, Any] | None, where: str) -> None:
    """The batch's webhook against the intake's webhook rule (its lines inherit it)."""
    if webhook is None:
        return
    url = str(webhook["url"])
    refusal = service.intake.webhook_refusal(url, (where, "webhook_url"))
    if refusal is not None:
        raise field_error(refusal.loc, refusal.message, refusal.code, url)


def batch_options(
    service: BatchService, caller: Principal, params: BatchParams, where: str = "query"
) -> BatchOptions:
    """The checked options (422 naming the parameter); resolves the webhook's host: a thread."""
    webhook = _webhook(params.webhook_url, params.webhook_events, where)
    _check_webhook(service, webhook, where)
    try:
        window_s = parse_completion_window(params.completion_window)
    except ValueError as exc:
        loc = (where, "completion_window")
        raise field_error(loc, str(exc), "completion_window", params.completion_window) from exc
    defaults = LineDefaults(
        pipeline=params.pipeline,
        priority=str(params.priority),
        webhook=webhook,
        metadata=_metadata(params.metadata, service.settings.max_json_depth, where),
    )
    return BatchOptions(defaults, window_s, params.skip_invalid, caller.key_id)
