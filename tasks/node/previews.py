"""A job's previews on the node: encoded off the group's path, carried inline or by URL.

The ranks hand over raw pixels (`StepProgress.preview`); the progress writer's thread encodes the
newest one of each job (`JobPreviews.payload`: a typed `PreviewPayload`, so a preview neither
inline nor by URL is refused here, by its writer) and appends it as the job's `preview` event,
which replaces the previous one in Redis (storage/lua/live_event.lua). A preview of at most
`PREVIEW_INLINE_MAX` encoded bytes rides in its event as base64; a larger one is written to the
object store under the job's one preview key (replaced by each next one) and named by a URL that
lives `PREVIEW_URL_TTL_S`. When the attempt ends (`JobPreviews.close`) that object is deleted and
no later preview of the attempt is stored: a finished job leaves no preview object behind. What
a node killed mid-job leaves lies under the job's folder, which the outputs prefix's lifecycle
rule expires (docs/operations.md).
"""

from __future__ import annotations

import base64
import logging
import threading

import numpy as np

from kiln.common.previews import PREVIEW_INLINE_MAX
from kiln.gpu_worker.outputs import OutputSpec, encode
from kiln.storage.errors import StorageError
from kiln.storage.objects import ObjectStore, preview_key
from kiln.tasks.contract.events import PreviewPayload

log = logging.getLogger(__name__)

PREVIEW_URL_TTL_S = 600  # a preview is stale within seconds; its URL need not outlive the job


class PreviewsEnded(StorageError):
    """The attempt has ended: its previews are neither stored nor appended any more."""


class JobPreviews:
    """One attempt's previews of a job: encoded as asked, large ones stored, then removed.

    `payload` runs on the progress writer's thread, `close` on the job's task thread once the
    attempt is over; a lock orders them, so no preview object is written after `close` deleted
    the job's.
    """

    def __init__(self, objects: ObjectStore, job_id: str, preview_format: str) -> None:
        self.objects = objects
        self.job_id = job_id
        self.preview_format = preview_format
        self._lock = threading.Lock()
        self._stored: set[str] = set()  # the preview keys written (one per extension)
        self._closed = False

    def payload(self, step: int, total: int, pixels: np.ndarray) -> PreviewPayload:
        """The `preview` event's data for pixels (uint8 (H, W, 3)); PreviewsEnded once closed."""
        encoded = encode(pixels, OutputSpec(format=self.preview_format))

        def preview(image_b64: str | None, url: str | None) -> PreviewPayload:
            return PreviewPayload(
                step=step,
                total=total,
                width=encoded.width,
                height=encoded.height,
                format=self.preview_format,
                content_type=encoded.content_type,
                image_b64=image_b64,
                url=url,
            )

        if len(encoded.data) <= PREVIEW_INLINE_MAX:
            return preview(base64.b64encode(encoded.data).decode("ascii"), None)
        key = preview_key(self.objects.prefix, self.job_id, encoded.extension)
        metadata = {"job-id": self.job_id, "step": str(step)}
        with self._lock:
            if self._closed:
                raise PreviewsEnded(f"job {self.job_id}: the attempt has ended")
            self._stored.add(key)
            self.objects.put(key, encoded.data, encoded.content_type, metadata)
        return preview(None, self.objects.url(key, expires_s=PREVIEW_URL_TTL_S))

    def close(self, *, delete: bool = True) -> None:
        """Store no more previews; with `delete`, remove the one stored (best effort).

        `delete=False` for an attempt that lost its lease: the job's preview key may be the new
        holder's by now.
        """
        with self._lock:
            self._closed = True
            stored, self._stored = self._stored, set()
            if not delete:
                return
            for key in sorted(stored):
                try:
                    self.objects.delete(key)
                except StorageError as exc:  # the lifecycle rule removes it later
                    log.info("could not delete preview %s of job %s: %s", key, self.job_id, exc)
