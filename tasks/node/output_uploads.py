"""Encode a job's frames and upload them, verified, under keys of the attempt's own.

Every attempt writes into its own folder (`{job}/{lease token}-{nonce}/`) and only creates
objects, never replaces one: an attempt that lost its lease and writes late cannot touch the
outputs another attempt committed. The job's fenced `succeed` is what makes an attempt's outputs
the job's; an attempt that fails, or whose `succeed` is refused, deletes its own (best effort).
Runs on the job's task thread, so it overlaps the group's compute of the next job.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from kiln.common.tracing import ENCODE_SPAN, UPLOAD_SPAN, span
from kiln.gpu_worker.outputs import EncodedOutput, OutputSpec, encode
from kiln.storage.errors import ObjectExists, ObjectStoreUnavailable, StorageError
from kiln.storage.objects import ObjectStore, output_key
from kiln.tasks.contract.backoff import doubling_delay
from kiln.tasks.contract.job_spec import JobSpec

log = logging.getLogger(__name__)

MAX_STORAGE_PAUSE_S = 8.0
# KILN_UPLOAD_VERIFY: read every upload back, or trust a store that checked the sent checksum
UploadVerify = Literal["checksum", "head"]


class OutputVerificationFailed(ObjectStoreUnavailable):
    """An uploaded object does not read back with the size and sha256 we sent (retryable)."""


@dataclass(frozen=True)
class UploadReport:
    """The job-view output entries plus how long encoding and uploading took."""

    outputs: list[dict[str, Any]]
    encode_s: float
    upload_s: float


def output_spec(spec: JobSpec) -> OutputSpec:
    """The encoding options of a job's spec.

    The spec is the effective request (the contract's defaults filled in at submit), so format
    and fps are read as recorded. The contract has no quality field: each codec's own.
    """
    return OutputSpec(format=spec.output_format, fps=spec.fps)


def put_verified(
    objects: ObjectStore,
    key: str,
    data: bytes,
    content_type: str,
    metadata: dict[str, str],
    verify: UploadVerify = "head",
) -> str:
    """Create `key` (never replacing an object) and verify it; returns the sha256 hex.

    Raises OutputVerificationFailed on a mismatch. `head` reads the head back; `checksum` does
    so only when the store did not confirm that it checked the sha256 sent with the put
    (StoredObject.checksum_verified). An existing key is taken for this put's own earlier try
    (its answer lost, so the put was retried) when it holds these very bytes; else ObjectExists.
    """
    sha256 = hashlib.sha256(data).hexdigest()
    try:
        stored = objects.put(key, data, content_type, metadata, create_only=True)
    except ObjectExists:
        stored = None
    trusted = stored is not None and stored.checksum_verified and stored.sha256 == sha256
    if verify == "checksum" and trusted:
        return sha256
    head = objects.head(key)
    if stored is None and (head is None or head.sha256 != sha256):
        raise ObjectExists(f"object {key} exists already with other bytes")
    if head is None or head.size != len(data) or head.sha256 != sha256:
        raise OutputVerificationFailed(f"object {key} did not verify after upload")
    return sha256


def retry_storage(
    call: Callable[[], str],
    *,
    deadline: float,
    pause_s: float = 0.5,
    on_retry: Callable[[], None] | None = None,
) -> str:
    """Retry a retryable storage call with backoff until `deadline` (monotonic).

    The pause before retry n is `doubling_delay(n, pause_s, MAX_STORAGE_PAUSE_S)`.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except StorageError as exc:
            pause = doubling_delay(attempt, pause_s, MAX_STORAGE_PAUSE_S)
            if not exc.retryable or time.monotonic() + pause > deadline:
                raise
            if on_retry is not None:
                on_retry()
            time.sleep(pause)


def encode_and_upload(
    objects: ObjectStore,
    job_id: str,
    spec: JobSpec,
    frames_per_output: Sequence[np.ndarray],
    *,
    attempt: str,
    retry_for_s: float,
    on_stage: Callable[[str, int, int], None],
    on_retry: Callable[[], None] | None = None,
    verify: UploadVerify = "head",
    on_output: Callable[[int, dict[str, Any]], None] | None = None,
) -> UploadReport:
    """Encode every output, create each at `{prefix}/{job_id}/{attempt}/{index}.{ext}`, verify.

    `attempt` is the attempt's own folder (`new_attempt_name`). When any output fails, those
    already stored are deleted (best effort) before the error is raised: no record names them.
    `on_output(index, entry)` hears of each output once it is stored and verified, before the
    next one is encoded.
    """
    encoding = output_spec(spec)
    deadline = time.monotonic() + retry_for_s
    outputs: list[dict[str, Any]] = []
    encode_s = upload_s = 0.0
    total = len(frames_per_output)
    try:
        for index, frames in enumerate(frames_per_output):
            on_stage("encoding", index + 1, total)
            started = time.perf_counter()
            with span(ENCODE_SPAN, attributes={"kiln.output": index}):
                encoded = encode(frames, encoding)
            encode_s += time.perf_counter() - started
            on_stage("uploading", index + 1, total)
            started = time.perf_counter()
            key = output_key(objects.prefix, job_id, index, encoded.extension, attempt=attempt)
            metadata = {"job-id": job_id, "index": str(index), "seed": str(spec.seed)}
            upload = functools.partial(
                put_verified, objects, key, encoded.data, encoded.content_type, metadata, verify
            )
            facts = {"kiln.output": index, "kiln.bytes": len(encoded.data)}
            with span(UPLOAD_SPAN, attributes=facts):
                sha256 = retry_storage(upload, deadline=deadline, on_retry=on_retry)
            upload_s += time.perf_counter() - started
            outputs.append(output_entry(key, encoded, sha256))
            if on_output is not None:
                on_output(index, outputs[-1])
    except BaseException:
        discard_outputs(objects, outputs)
        raise
    return UploadReport(outputs, encode_s, upload_s)


def discard_outputs(objects: ObjectStore, outputs: Sequence[Mapping[str, Any]]) -> None:
    """Delete the stored outputs of an attempt that no record names (best effort).

    What stays behind (a store that is down, a node killed mid-upload) is never referenced;
    docs/operations.md says how a lifecycle rule on the attempt folders removes it.
    """
    for output in outputs:
        key = str(output["key"])
        try:
            objects.delete(key)
        except StorageError as exc:
            log.info("could not delete unreferenced output %s: %s", key, exc)


def output_entry(key: str, encoded: EncodedOutput, sha256: str) -> dict[str, Any]:
    """What the job record keeps of one verified output (its URL is presigned at read time)."""
    return {
        "key": key,
        "content_type": encoded.content_type,
        "bytes": len(encoded.data),
        "sha256": sha256,
        "width": encoded.width,
        "height": encoded.height,
        "frames": encoded.frames,
    }
