"""The Redis boundary: redis-py errors and script errors become storage.errors types."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import redis.exceptions

from kiln.storage import errors

P = ParamSpec("P")
R = TypeVar("R")

# `KILN_<CODE>` raised by the Lua scripts (storage/lua/, `raise` in _prelude.lua)
_SCRIPT_ERRORS: dict[str, type[errors.StorageError]] = {
    "KILN_NOTFOUND": errors.JobNotFound,
    "KILN_NOBATCH": errors.BatchNotFound,
    "KILN_ILLEGAL": errors.IllegalTransition,
    "KILN_STALE": errors.StaleLease,
    "KILN_LEASEHELD": errors.LeaseHeld,
    "KILN_CONFLICT": errors.IdempotencyConflict,
    "KILN_QUOTA": errors.QuotaExceeded,
}

# server answers that mean "not now" rather than "never" (redis-py strips some codes into types)
# (OutOfMemoryError is looked up by name: the installed type stubs predate it)
_TRANSIENT_TYPES: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    getattr(redis.exceptions, "OutOfMemoryError", redis.exceptions.ConnectionError),
    redis.exceptions.ReadOnlyError,
    redis.exceptions.MasterDownError,
    redis.exceptions.TryAgainError,
)
_TRANSIENT_PREFIXES = ("BUSY", "MASTERDOWN", "TRYAGAIN")


def _script_error(message: str) -> errors.StorageError | None:
    code, _, detail = message.partition(" ")
    kind = _SCRIPT_ERRORS.get(code)
    if kind is None:
        return None
    # Redis appends " script: <sha>, on @user_script:<line>." to errors raised from scripts
    detail = detail.split(" script: ", 1)[0]
    return kind(_describe(code, detail))


def _describe(code: str, detail: str) -> str:
    words = detail.split()
    if code == "KILN_ILLEGAL" and len(words) == 3:
        return f"job {words[0]}: {words[1]} -> {words[2]} is not allowed"
    if code == "KILN_STALE" and len(words) == 2:
        return f"job {words[0]}: lease token {words[1]} is not the current one"
    if code == "KILN_LEASEHELD" and len(words) >= 2:
        return f"job {words[0]}: lease held by {' '.join(words[1:])}"
    if code == "KILN_QUOTA" and len(words) == 3:
        return f"owner {words[0]} has {words[2]} {words[1]} jobs, its maximum"
    if code == "KILN_CONFLICT":
        return f"idempotency key {detail!r} is bound to another request"
    return detail


def translate(exc: redis.exceptions.RedisError) -> errors.StorageError:
    """Return the storage error for a redis-py exception."""
    message = str(exc)
    if isinstance(exc, _TRANSIENT_TYPES):
        return errors.StorageUnavailable(f"redis unavailable: {type(exc).__name__}: {message}")
    scripted = _script_error(message)
    if scripted is not None:
        return scripted
    if message.startswith(_TRANSIENT_PREFIXES):
        return errors.StorageUnavailable(f"redis busy: {message}")
    return errors.StorageError(f"redis error: {message}")


def redis_boundary(func: Callable[P, R]) -> Callable[P, R]:
    """Decorate a public store method so redis errors leave it as storage errors."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except redis.exceptions.RedisError as exc:
            raise translate(exc) from exc

    return wrapper
