"""The storage package's one exception tree; redis and botocore errors are translated into it."""

from __future__ import annotations


class StorageError(Exception):
    """Base of every error raised by the storage package."""

    retryable: bool = False


class StorageUnavailable(StorageError):
    """Redis could not be reached or timed out; trying again later may work."""

    retryable = True


class JobNotFound(StorageError):
    """No job record with this id (never created, or expired after retention)."""


class BatchNotFound(StorageError):
    """No batch record with this id."""


class IllegalTransition(StorageError):
    """The job's current state does not allow the requested transition."""


class LeaseHeld(StorageError):
    """A live lease on the job is held by another owner."""


class StaleLease(StorageError):
    """The lease token presented is not the job's current one (fenced off)."""


class QuotaExceeded(StorageError):
    """The job's owner is at its cap of queued or running jobs; nothing was written."""

    retryable = True


class IdempotencyConflict(StorageError):
    """The idempotency key is already bound to a request with another fingerprint."""


class ObjectStoreError(StorageError):
    """An object-store operation failed."""


class ObjectStoreUnavailable(ObjectStoreError):
    """The object store could not be reached, throttled or answered 5xx after all retries."""

    retryable = True


class ObjectNotFound(ObjectStoreError):
    """No object under this key."""


class ObjectExists(ObjectStoreError):
    """A create-only put found the key taken (S3 412 to If-None-Match, or an existing file)."""


class InvalidObjectKey(ObjectStoreError, ValueError):
    """The key (or a part of it) could escape the store's prefix or has odd characters."""
