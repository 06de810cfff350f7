"""The Python client of the HTTP API: `KilnClient` and the errors it raises."""

from kiln.tasks.client.client import (
    ApiError,
    Forbidden,
    IdempotencyConflictError,
    JobNotFoundError,
    KilnClient,
    KilnConnectionError,
    KilnError,
    PayloadTooLarge,
    Unauthorized,
    ValidationFailed,
    WaitTimeout,
)

__all__ = [
    "ApiError",
    "Forbidden",
    "IdempotencyConflictError",
    "JobNotFoundError",
    "KilnClient",
    "KilnConnectionError",
    "KilnError",
    "PayloadTooLarge",
    "Unauthorized",
    "ValidationFailed",
    "WaitTimeout",
]
