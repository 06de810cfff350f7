"""The botocore boundary: client and transport errors become storage.errors types."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import botocore.exceptions
from boto3.exceptions import S3UploadFailedError

from kiln.storage.errors import (
    ObjectExists,
    ObjectNotFound,
    ObjectStoreError,
    ObjectStoreUnavailable,
)

_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
# the answer to a create-only put (If-None-Match: *) on a key that exists
_EXISTS_CODES = frozenset({"412", "PreconditionFailed"})
# answers that mean "not now": botocore already retried them; the caller may retry later
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
        # a conditional write raced another one on the same key; S3 says to try again
        "ConditionalRequestConflict",
    }
)


def translate_client_error(exc: botocore.exceptions.ClientError, key: str) -> ObjectStoreError:
    """Return the storage error for an S3 error answer about `key`."""
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    if code in _NOT_FOUND_CODES:
        return ObjectNotFound(key)
    if code in _EXISTS_CODES or status == 412:
        return ObjectExists(f"object {key!r} exists already")
    if code in _TRANSIENT_CODES or status >= 500:
        return ObjectStoreUnavailable(f"object store unavailable for {key!r}: {exc}")
    return ObjectStoreError(f"object store refused {key!r}: {exc}")


@contextmanager
def s3_errors(key: str) -> Iterator[None]:
    """Translate whatever boto3 raises inside the block into storage errors."""
    try:
        yield
    except botocore.exceptions.ClientError as exc:
        raise translate_client_error(exc, key) from exc
    except S3UploadFailedError as exc:
        # boto3's transfer manager wraps the ClientError of a failed part
        cause = exc.__context__
        if isinstance(cause, botocore.exceptions.ClientError):
            raise translate_client_error(cause, key) from exc
        raise ObjectStoreError(f"upload of {key!r} failed: {exc}") from exc
    except (
        botocore.exceptions.ConnectionError,
        botocore.exceptions.HTTPClientError,
    ) as exc:
        raise ObjectStoreUnavailable(f"object store unreachable for {key!r}: {exc}") from exc
    except botocore.exceptions.BotoCoreError as exc:
        raise ObjectStoreError(f"object store call for {key!r} failed: {exc}") from exc
