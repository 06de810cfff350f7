"""Bearer API keys: generation, hashing (keys are stored only as HMAC-SHA256), and the caller.

A key looks like `kiln_<43 url-safe chars>`; only its hash reaches Redis. A job belongs to the key
that created it (the key's id is the job's `owner`); admin keys see every job. With auth switched
off every caller is the anonymous admin.

A live key's record is kept in memory for `cache_s` (KILN_API_KEY_CACHE_S), sparing every request
a Redis read; a revoked key is therefore refused at the latest `cache_s` after its revocation.
Only live keys are kept: an unknown or revoked one is looked up again on every request.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from kiln.storage.apikeys import ApiKeyStore

KEY_PREFIX = "kiln_"
# live keys kept at most; past it the cache starts over (bounds memory whatever the callers send)
MAX_CACHED_KEYS = 10_000


class AuthError(Exception):
    """The request carries no usable credentials (401)."""


class Forbidden(Exception):
    """The caller is known but may not do this (403)."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key id (a job's owner) and whether it is an admin."""

    key_id: str | None
    admin: bool
    name: str = ""
    max_queued: int | None = None  # the key's own caps; None: the server's defaults apply
    max_running: int | None = None

    def may_see(self, owner: str | None) -> bool:
        """Whether this caller may read or cancel a job owned by `owner`."""
        return self.admin or (self.key_id is not None and owner == self.key_id)


ANONYMOUS_ADMIN = Principal(key_id=None, admin=True, name="anonymous (auth disabled)")


def new_api_key() -> str:
    """A fresh random API key (shown once, never stored)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str, pepper: str = "") -> str:
    """HMAC-SHA256 of a key under the server's pepper, hex; what the key store indexes."""
    return hmac.new(pepper.encode(), key.encode(), hashlib.sha256).hexdigest()


def bearer_token(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header; raises `AuthError`."""
    if not authorization:
        raise AuthError("missing Authorization header (expected: Bearer <api key>)")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError("malformed Authorization header (expected: Bearer <api key>)")
    return token.strip()


class Authenticator:
    """Turns an Authorization header into a `Principal` (or the anonymous admin when off)."""

    def __init__(
        self,
        keys: ApiKeyStore,
        enabled: bool,
        pepper: str = "",
        *,
        cache_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keys = keys
        self.enabled = enabled
        self.pepper = pepper
        self.cache_s = cache_s
        self._clock = clock
        # the raw `Authorization` header -> (read at, its caller): hashing a key costs more than
        # the rest of a cache hit, so the header itself is what a hit is found by
        self._cached: dict[str, tuple[float, Principal]] = {}

    def principal(self, authorization: str | None) -> Principal:
        """The caller behind a header; raises `AuthError` for missing, unknown or revoked keys."""
        cached = self.cached_principal(authorization)
        if cached is not None:
            return cached
        key = self.keys.lookup(hash_api_key(bearer_token(authorization), self.pepper))
        if key is None or key.revoked:
            raise AuthError("unknown or revoked API key")
        caller = Principal(
            key_id=key.id,
            admin=key.admin,
            name=key.name,
            max_queued=key.max_queued,
            max_running=key.max_running,
        )
        if self.cache_s > 0 and authorization is not None:
            if len(self._cached) >= MAX_CACHED_KEYS:
                self._cached.clear()
            self._cached[authorization] = (self._clock(), caller)
        return caller

    def cached_principal(self, authorization: str | None) -> Principal | None:
        """The caller if known without reading Redis (auth off, a fresh cache entry), else None.

        Raises `AuthError` for a missing or malformed header.
        """
        if not self.enabled:
            return ANONYMOUS_ADMIN
        bearer_token(authorization)
        hit = self._cached.get(authorization or "")
        if hit is not None:
            if self._clock() - hit[0] < self.cache_s:
                return hit[1]
            self._cached.pop(authorization or "", None)
        return None
