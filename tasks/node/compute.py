"""From a job record to the worker group and back: the request the group runs, the run's metrics.

The record holds the effective request (the contract's defaults and the drawn seed filled in at
submit), so every field is read as recorded, with no default of the node's own.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from kiln.common.request import DEFAULT_SPEED
from kiln.gpu_worker.protocol import AdapterRef, GenerationRequest, GenerationResult, PreviewSpec
from kiln.storage.job_store import JobRecord


def generation_request(record: JobRecord) -> GenerationRequest:
    """The compute part of a stored job request."""
    r = record.request
    return GenerationRequest(
        request_id=record.id,
        pipeline=str(r["pipeline"]),
        prompt=str(r["prompt"]),
        negative_prompt=r["negative_prompt"],
        width=int(r["width"]),
        height=int(r["height"]),
        steps=int(r["steps"]),
        seed=int(r["seed"]),
        num_frames=int(r["num_frames"]),
        guidance_scale=float(r["guidance_scale"]),
        num_outputs=int(r["num_outputs"]),
        extra_inputs=dict(r.get("inputs") or {}),  # absent from records made before `inputs`
        loras=tuple(AdapterRef(str(a["name"]), float(a["scale"])) for a in r.get("loras") or ()),
        speed=str(r.get("speed") or DEFAULT_SPEED),  # recorded only when not the default
        preview=preview_spec(r.get("preview")),
    )


def preview_spec(recorded: Any) -> PreviewSpec | None:
    """The recorded `preview` field as the ranks take it (None: no previews)."""
    if not isinstance(recorded, dict):
        return None
    return PreviewSpec(
        every_steps=int(recorded["every_steps"]),
        max_side=int(recorded["max_side"]),
        format=str(recorded["format"]),
    )


def run_metrics(
    record: JobRecord, result: GenerationResult, encode_s: float, upload_s: float
) -> dict[str, Any]:
    """The `metrics` of a succeeded job: `record` is the one its start returned."""
    started = record.started_at or time.time()
    metrics: dict[str, Any] = {
        "queue_s": round(started - record.created_at, 4),
        "encode_s": round(encode_s, 4),
        "upload_s": round(upload_s, 4),
    }
    if result.metrics is not None:
        metrics["run_s"] = round(result.metrics.run_s, 4)
        metrics["peak_memory_mb"] = round(result.metrics.peak_memory_mb, 1)
        if result.metrics.wake_s > 0:  # this job's batch woke the sleeping group first
            metrics["wake_s"] = round(result.metrics.wake_s, 4)
        if result.metrics.speed is not None:  # the mode's effective configuration, skips
            metrics["speed"] = asdict(result.metrics.speed)
    return metrics
