"""From a job record to the worker group and back: the request the group runs, the run's metrics.

A delivery decodes its job's stored spec once (`DeliveredJob.decode`): the spec is the effective
request (the contract's defaults and the drawn seed filled in at submit), so every field is read
as recorded, with no default of the node's own, and the group's request is built from it once.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from kiln.gpu_worker.protocol import AdapterRef, GenerationRequest, GenerationResult, PreviewSpec
from kiln.storage.job_store import JobRecord
from kiln.tasks.contract.job_spec import JobSpec
from kiln.tasks.contract.schemas import PreviewRequest


@dataclass(frozen=True)
class DeliveredJob:
    """One delivery's job, decoded once: its spec, and the request its group runs."""

    spec: JobSpec
    compute: GenerationRequest  # its image inputs are added by the attempt (`with_images`)

    @classmethod
    def decode(cls, record: JobRecord) -> DeliveredJob:
        """The record's spec and compute request; JobSpecRefused when the spec is unreadable."""
        spec = JobSpec.decode(record.request)
        return cls(spec, generation_request(record.id, spec))


def generation_request(job_id: str, spec: JobSpec) -> GenerationRequest:
    """The compute part of a job's spec."""
    return GenerationRequest(
        request_id=job_id,
        pipeline=spec.pipeline,
        prompt=spec.prompt,
        negative_prompt=spec.negative_prompt,
        width=spec.width,
        height=spec.height,
        steps=spec.steps,
        seed=spec.seed,
        num_frames=spec.num_frames,
        guidance_scale=spec.guidance_scale,
        num_outputs=spec.num_outputs,
        extra_inputs=dict(spec.inputs),
        loras=tuple(AdapterRef(lora.name, lora.scale) for lora in spec.loras),
        speed=spec.speed,
        preview=preview_spec(spec.preview),
    )


def preview_spec(preview: PreviewRequest | None) -> PreviewSpec | None:
    """The spec's `preview` as the ranks take it (None: no previews)."""
    if preview is None:
        return None
    return PreviewSpec(
        every_steps=preview.every_steps, max_side=preview.max_side, format=preview.format
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
        if result.metrics.resumed_at_step or result.metrics.checkpoint_refusals:
            # a run that resumed from a step checkpoint, or was offered some (node/checkpoints.py)
            metrics["steps_restored"] = result.metrics.resumed_at_step
            metrics["steps_computed"] = result.metrics.steps_run
            metrics["checkpoints_refused"] = list(result.metrics.checkpoint_refusals)
    return metrics
