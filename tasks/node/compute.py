"""From a job record to the worker group and back: the request the group runs, the run's metrics.

The record holds the effective request (the contract's defaults and the drawn seed filled in at
submit), so every field is read as recorded, with no default of the node's own.
"""

from __future__ import annotations

import time

from kiln.gpu_worker.protocol import AdapterRef, GenerationRequest, GenerationResult
from kiln.storage.status import JobRecord


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
    )


def run_metrics(
    record: JobRecord, result: GenerationResult, encode_s: float, upload_s: float
) -> dict[str, float]:
    """The `metrics` of a succeeded job: `record` is the one its start returned."""
    started = record.started_at or time.time()
    metrics = {
        "queue_s": round(started - record.created_at, 4),
        "encode_s": round(encode_s, 4),
        "upload_s": round(upload_s, 4),
    }
    if result.metrics is not None:
        metrics["run_s"] = round(result.metrics.run_s, 4)
        metrics["peak_memory_mb"] = round(result.metrics.peak_memory_mb, 1)
        if result.metrics.wake_s > 0:  # this job's batch woke the sleeping group first
            metrics["wake_s"] = round(result.metrics.wake_s, 4)
    return metrics
