"""Step checkpoints in the object store, recorded on the job by the lease token that wrote them.

A checkpoint is written like an output: into its attempt's own folder
(`{prefix}/{job_id}/{attempt}/checkpoints/{steps_done}.ckpt`, a create-only put), so no attempt
overwrites another's, and the store's sha256 of the bytes is checked against the writer's. Then
`checkpoint.lua` records it on the job (the `checkpoints` field: newest first, a few kept),
fenced by the lease token: a writer that lost its lease records nothing, and its object, which
no record names, is deleted. A write may be tried again after a transient error (the node's
writer does): the put then finds its own earlier one (the same bytes) and takes it, and the
record names a checkpoint once however often it is recorded.

Reading (`latest`) walks the recorded checkpoints newest first and hands each one's bytes to the
caller's `accept` (the node parses and checks the identity there); a checkpoint that is missing,
not the bytes recorded, not in a folder of the token recorded with it, or refused by `accept`
is passed over with a logged reason, and the next older one is tried. None left: the job starts
from step 0. A checkpoint never fails a job.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kiln.storage.base import StoreBase, dumps
from kiln.storage.boundary import redis_boundary
from kiln.storage.errors import ObjectExists, ObjectNotFound, ObjectStoreError, StaleLease
from kiln.storage.object_base import ObjectStore, attempt_folder
from kiln.storage.records import CHECKPOINTS_FIELD

log = logging.getLogger(__name__)

CONTENT_TYPE = "application/vnd.kiln.checkpoint"
KEPT = 3  # entries on a record: the newest, and older ones to fall back on
T = TypeVar("T")


def checkpoint_key(prefix: str, job_id: str, attempt: str, steps_done: int) -> str:
    """`{prefix}/{job_id}/{attempt}/checkpoints/{steps_done}.ckpt` (checked like an output key)."""
    if isinstance(steps_done, bool) or not isinstance(steps_done, int) or steps_done < 1:
        raise ValueError(f"invalid steps done {steps_done!r}")
    return f"{attempt_folder(prefix, job_id, attempt)}/checkpoints/{steps_done}.ckpt"


def attempt_token(attempt: str) -> int:
    """The lease token an attempt folder `{token}-{nonce}` was named for."""
    return int(attempt.split("-", 1)[0])


@dataclass(frozen=True)
class CheckpointRef:
    """One recorded checkpoint: where it is, what it holds, and the lease that wrote it."""

    key: str
    sha256: str
    size: int
    steps_done: int
    lease_token: int
    attempt: str
    written_at: str  # the Redis clock when recorded, '<s>.<us>'

    @classmethod
    def from_json(cls, entry: object) -> CheckpointRef | None:
        """The entry as recorded; None for one that is not (a damaged record is passed over)."""
        try:
            assert isinstance(entry, dict)
            return cls(
                key=str(entry["key"]),
                sha256=str(entry["sha256"]),
                size=int(entry["size"]),
                steps_done=int(entry["steps_done"]),
                lease_token=int(entry["lease_token"]),
                attempt=str(entry["attempt"]),
                written_at=str(entry["written_at"]),
            )
        except (AssertionError, KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a job resumes from (what `accept` made of it), and those passed over."""

    ref: CheckpointRef | None
    refusals: list[str]


@redis_boundary
def record_checkpoint(
    store: StoreBase, job_id: str, lease_token: int, entry: dict[str, object]
) -> tuple[str, list[str]]:
    """Record `entry` on the running job `lease_token` holds; its time, and the keys dropped.

    The time is the Redis clock's; the keys are those of the entries that fell off the record.

    StaleLease when the token is not the job's current one (nothing recorded), IllegalTransition
    when the job is not running, JobNotFound.
    """
    store._require_id(job_id)
    reply = json.loads(
        store._run(
            "checkpoint",
            [store.keys.job(job_id)],
            [job_id, str(lease_token), dumps(entry), KEPT],
        )
    )
    dropped = reply["dropped"]  # cjson writes an empty list as {}
    return str(reply["written_at"]), [str(key) for key in dropped] if dropped else []


@redis_boundary
def recorded_checkpoints(store: StoreBase, job_id: str) -> list[CheckpointRef]:
    """The job's recorded checkpoints, newest first (entries that do not parse left out)."""
    store._require_id(job_id)
    raw = store.redis.hget(store.keys.job(job_id), CHECKPOINTS_FIELD)
    try:
        entries = json.loads(raw) if raw else []
    except ValueError:
        entries = []
    refs = [CheckpointRef.from_json(entry) for entry in entries if isinstance(entries, list)]
    return [ref for ref in refs if ref is not None]


class Checkpoints:
    """A job's checkpoints: written to `objects`, recorded through `store`."""

    def __init__(self, store: StoreBase, objects: ObjectStore) -> None:
        self.store = store
        self.objects = objects

    def write(
        self, job_id: str, lease_token: int, attempt: str, steps_done: int, data: bytes
    ) -> CheckpointRef:
        """Put `data` in the attempt's folder and record it (see the module docstring).

        StaleLease when the lease was lost meanwhile: nothing is recorded and the object is
        deleted. ObjectStoreError when the store did not keep the bytes sent; ObjectExists when
        the key holds other bytes. Safe to call again with the same arguments after an error.
        """
        if attempt_token(attempt) != lease_token:
            raise ValueError(f"attempt {attempt!r} is not a folder of lease token {lease_token}")
        key = checkpoint_key(self.objects.prefix, job_id, attempt, steps_done)
        sha256 = hashlib.sha256(data).hexdigest()
        try:
            stored = self.objects.put(key, data, CONTENT_TYPE, create_only=True)
        except ObjectExists:  # an earlier try of this write stored it, and its answer was lost?
            earlier = self.objects.head(key)
            if earlier is None or earlier.sha256 != sha256:
                raise
            stored = earlier
        if stored.sha256 != sha256 or stored.size != len(data):
            raise ObjectStoreError(f"checkpoint {key}: the store kept other bytes than sent")
        entry: dict[str, object] = {
            "key": key,
            "sha256": sha256,
            "size": len(data),
            "steps_done": steps_done,
            "lease_token": lease_token,
            "attempt": attempt,
        }
        try:
            written_at, dropped = record_checkpoint(self.store, job_id, lease_token, entry)
        except StaleLease:
            self._delete(key)  # no record names it: it would only take space
            raise
        for old in dropped:
            self._delete(old)
        return CheckpointRef(key, sha256, len(data), steps_done, lease_token, attempt, written_at)

    def latest(
        self, job_id: str, accept: Callable[[CheckpointRef, bytes], T]
    ) -> tuple[T | None, Resumed]:
        """What `accept` makes of the newest valid recorded checkpoint, or None; why not others.

        `accept(ref, data)` raises ValueError (the node's CheckpointRefused) for a checkpoint it
        will not resume from.
        """
        readable, refusals = self.readable(job_id)
        for ref, data in readable:
            try:
                return accept(ref, data), Resumed(ref, refusals)
            except ValueError as exc:
                self._refuse(job_id, ref, str(exc), refusals)
        return None, Resumed(None, refusals)

    def readable(self, job_id: str) -> tuple[list[tuple[CheckpointRef, bytes]], list[str]]:
        """The recorded checkpoints whose bytes are as recorded, newest first, with those bytes.

        Also why the others were passed over (each one logged too).
        """
        readable: list[tuple[CheckpointRef, bytes]] = []
        refusals: list[str] = []
        for ref in recorded_checkpoints(self.store, job_id):
            reason, data = self._check(job_id, ref)
            if reason is None:
                readable.append((ref, data))
            else:
                self._refuse(job_id, ref, reason, refusals)
        return readable, refusals

    @staticmethod
    def _refuse(job_id: str, ref: CheckpointRef, reason: str, refusals: list[str]) -> None:
        refusals.append(f"{ref.key}: {reason}")
        log.warning("job %s: checkpoint %s refused: %s", job_id, ref.key, reason)

    def discard(self, job_id: str) -> None:
        """Delete the objects of the job's recorded checkpoints (once it succeeded: none is needed).

        The record keeps naming them; only a later attempt reads them, and a finished job has
        none. A delete that fails is logged: it costs space, never correctness.
        """
        for ref in recorded_checkpoints(self.store, job_id):
            self._delete(ref.key)

    def _check(self, job_id: str, ref: CheckpointRef) -> tuple[str | None, bytes]:
        try:
            expected = checkpoint_key(self.objects.prefix, job_id, ref.attempt, ref.steps_done)
        except (ValueError, ObjectStoreError) as exc:
            return f"not a checkpoint key: {exc}", b""
        if ref.key != expected or attempt_token(ref.attempt) != ref.lease_token:
            return f"not in a folder of lease token {ref.lease_token}", b""
        try:
            data = self.objects.get(ref.key)
        except ObjectNotFound:
            return "missing from the object store", b""
        except ObjectStoreError as exc:
            return f"unreadable: {exc}", b""
        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
            return f"corrupt: {len(data)} bytes, not the {ref.size} recorded with their sha256", b""
        return None, data

    def _delete(self, key: str) -> None:
        try:
            self.objects.delete(key)
        except ObjectStoreError as exc:  # a leftover object costs space, never correctness
            log.warning("checkpoint %s not deleted: %s", key, exc)
