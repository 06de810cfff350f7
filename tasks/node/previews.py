"""A job's previews on the node: encoded off the group's path, carried inline or by URL.

The ranks hand over raw pixels (`StepProgress.preview`); the progress writer's thread encodes the
newest one of each job (`preview_payload`) and appends it as the job's `preview` event, which
replaces the previous one in Redis (storage/lua/live_event.lua). A preview of at most
`PREVIEW_INLINE_MAX` encoded bytes rides in its event as base64; a larger one is written to the
object store under the job's one preview key (replaced by each next one) and named by a URL that
lives `PREVIEW_URL_TTL_S`.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from kiln.common.previews import PREVIEW_INLINE_MAX
from kiln.gpu_worker.outputs import OutputSpec, encode
from kiln.storage.objects import ObjectStore, preview_key

PREVIEW_URL_TTL_S = 600  # a preview is stale within seconds; its URL need not outlive the job


def preview_payload(
    job_id: str,
    step: int,
    total: int,
    pixels: np.ndarray,
    preview_format: str,
    objects: ObjectStore,
) -> dict[str, Any]:
    """The `preview` event's data for these pixels (uint8 (H, W, 3)), encoded as asked."""
    encoded = encode(pixels, OutputSpec(format=preview_format))
    payload: dict[str, Any] = {
        "step": step,
        "total": total,
        "width": encoded.width,
        "height": encoded.height,
        "format": preview_format,
        "content_type": encoded.content_type,
        "image_b64": None,
        "url": None,
    }
    if len(encoded.data) <= PREVIEW_INLINE_MAX:
        payload["image_b64"] = base64.b64encode(encoded.data).decode("ascii")
        return payload
    key = preview_key(objects.prefix, job_id, encoded.extension)
    objects.put(key, encoded.data, encoded.content_type, {"job-id": job_id, "step": str(step)})
    payload["url"] = objects.url(key, expires_s=PREVIEW_URL_TTL_S)
    return payload
