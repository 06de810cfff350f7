"""Settings of the storage package: one pydantic-settings class, `KILN_` prefix."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kiln.common.env_lists import comma_or_json_list

# Outputs default to one absolute folder per user, so every process agrees on it whatever folder
# it starts in; shown as such in README's settings table (tests/docs/settings_tables.py).
DEFAULT_STORAGE_DOC = "file://<KILN_HOME>/outputs"


def data_home(kiln_home: Path | None = None) -> Path:
    """Kiln's data folder: `kiln_home`, else `$XDG_DATA_HOME/kiln`, else `~/.local/share/kiln`."""
    if kiln_home is not None:
        return kiln_home
    xdg = os.environ.get("XDG_DATA_HOME", "")
    # the XDG spec: a relative XDG_DATA_HOME is invalid and ignored
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".local" / "share"
    return base / "kiln"


def default_storage_url(kiln_home: Path | None = None) -> str:
    """`file://` URL of the default outputs folder: `<data home>/outputs`."""
    # "file://" + path, as the local store parses it back (no percent-encoding)
    return "file://" + str((data_home(kiln_home) / "outputs").expanduser().resolve())


def absolute_storage_url(url: str) -> str:
    """`url` if it is `s3://...` or an absolute `file://` URL (`~` expanded); else ValueError.

    A relative `file://` path is refused, not resolved: each process would resolve it against
    its own working folder, and a CLI, an API and a node started in different folders would
    write and read different places.
    """
    if url.startswith("s3://"):
        return url
    if not url.startswith("file://"):
        raise ValueError("storage_url must start with s3:// or file://")
    path = url[len("file://") :]
    if path.startswith("localhost/"):
        path = path[len("localhost") :]
    expanded = Path(path).expanduser()
    if not expanded.is_absolute():
        raise ValueError(
            f"storage_url {url!r} is relative: use file:///absolute/path (each process would "
            "resolve a relative one against its own folder)"
        )
    return "file://" + str(expanded.resolve())


def masked_url(url: str) -> str:
    """`url` with the password of its user info replaced by `***` (for logs and `kiln config`)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def checked_redis_url(url: str) -> str:
    """`url` if it is a redis://, rediss:// or unix:// URL with a valid port; else ValueError.

    A bare `host:port` is refused, not completed: the message shows the URL to write instead,
    so what `kiln config` shows is what every process uses.
    """
    if "://" not in url:
        suggestion = "redis://" + url + ("" if "/" in url else "/0")
        raise ValueError(
            f"redis_url has no scheme: write {masked_url(suggestion)!r} "
            "(rediss:// for TLS, unix:///path/to/redis.sock for a socket)"
        )
    if not url.startswith(REDIS_SCHEMES):
        raise ValueError(
            f"redis_url {masked_url(url)!r} must start with redis://, rediss:// or unix://"
        )
    try:
        urlsplit(url).port  # noqa: B018 - read for its ValueError: a port out of range or not a number
    except ValueError as error:  # (redis is not imported here: the client reads these settings)
        raise ValueError(f"redis_url {masked_url(url)!r}: {error}") from None
    return url


def sentinel_address(address: str) -> tuple[str, int]:
    """(host, port) of a `host:port` Sentinel address (`[v6]:port` too); else ValueError."""
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"redis_sentinels: {address!r} is not host:port")
    return host, int(port)


class StorageSettings(BaseSettings):
    """Where job state (Redis) and outputs (S3 or a local directory) live, and their lifetimes."""

    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore")

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis for job state: `redis://[user:password@]host:port/db`, `rediss://` "
        "(TLS) or `unix:///path`; a bare `host:port` is refused with the URL to write.",
    )
    redis_namespace: str = Field(
        default="kiln",
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="Prefix of every Redis key Kiln writes.",
    )
    redis_socket_timeout_s: float = Field(
        default=30.0, gt=0, description="Redis socket timeout; also caps blocking event reads."
    )
    redis_connect_timeout_s: float = Field(default=5.0, gt=0, description="Redis connect timeout.")
    redis_max_connections: int = Field(
        default=128, ge=1, description="Size of each process's Redis connection pool."
    )
    redis_sentinels: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Redis Sentinels as `host:port` (comma-separated): when set, every Redis "
        "client (store, API, broker) asks them for the primary of `redis_sentinel_master`; "
        "`redis_url` then gives only the database, user and password.",
    )
    redis_sentinel_master: str = Field(
        default="mymaster",
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="The master name the Sentinels monitor (with `redis_sentinels`).",
    )
    redis_retry_window_s: float = Field(
        default=0.0,
        ge=0,
        description="How long a blocking Redis call retries a lost connection before the store "
        "reports itself unavailable; 0: three quick retries. On nodes, set it above the "
        "Sentinels' failover time, so a job's transitions wait a failover out.",
    )
    redis_min_replicas_ack: int = Field(
        default=0,
        ge=0,
        description="Replicas that must acknowledge a job's creation, start and end (Redis "
        "`WAIT`) before Kiln answers or moves on; 0: off (docs/operations.md, Redis failover).",
    )
    redis_replica_ack_timeout_s: float = Field(
        default=1.0,
        gt=0,
        description="How long one `WAIT` for those replicas lasts; past it a creation is "
        "answered 503 (retryable) and a node's transition asks again, within the hold.",
    )
    redis_replica_ack_hold_s: float = Field(
        default=10.0,
        gt=0,
        description="How long a node holds a job's start or end (no compute, nothing reported) "
        "for its replicas, at most half the lease; past it a start is given back, an end "
        "reported with an error logged.",
    )
    home: Path | None = Field(
        default=None,
        description="Kiln's data folder (absolute); outputs default to `<KILN_HOME>/outputs`. "
        "Unset: `$XDG_DATA_HOME/kiln`, else `~/.local/share/kiln`.",
    )
    storage_url: str = Field(
        default_factory=lambda data: default_storage_url(data.get("home")),
        description="Where outputs go: `s3://bucket/prefix` or `file:///absolute/path` (a "
        "relative `file://` path is refused); each job output and each batch records the store "
        "it was written to, and readers follow the record.",
        json_schema_extra={"documented_default": DEFAULT_STORAGE_DOC},
    )
    s3_endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint URL.")
    s3_public_endpoint_url: str | None = Field(
        default=None,
        description="Endpoint written into presigned URLs, as clients reach the store "
        "(e.g. MinIO's published port); `s3_endpoint_url` when unset.",
    )
    s3_region: str | None = Field(default=None, description="S3 region.")
    s3_addressing_style: Literal["auto", "path", "virtual"] = Field(
        default="auto", description="S3 bucket addressing style."
    )
    s3_access_key_id: str | None = Field(
        default=None, description="S3 access key; boto3's credential chain when unset."
    )
    s3_secret_access_key: SecretStr | None = Field(default=None, description="S3 secret key.")
    s3_retry_mode: Literal["standard", "adaptive"] = Field(
        default="standard", description="botocore retry mode (throttling and 5xx are retried)."
    )
    object_store_max_attempts: int = Field(
        default=5, ge=1, description="Attempts per object-store call, first one included."
    )
    multipart_threshold_mb: int = Field(
        default=16, ge=5, description="Uploads above this size go multipart (S3 minimum part: 5)."
    )
    presign_expiry_s: int = Field(default=3600, gt=0, description="Lifetime of presigned URLs.")
    lease_ttl_s: float = Field(
        default=15.0, gt=0, description="Lease lifetime; a dead node's job is re-queued after it."
    )
    retention_s: int = Field(
        default=7 * 24 * 3600, gt=0, description="How long finished job records and events stay."
    )
    paused_retention_s: int = Field(
        default=7 * 24 * 3600,
        gt=0,
        description="How long a job stays paused; then it expires and its checkpoints go.",
    )
    event_stream_maxlen: int = Field(
        default=1000, ge=1, description="Events kept per job (older ones are trimmed)."
    )
    dead_letter_retention_s: int = Field(
        default=30 * 24 * 3600,
        gt=0,
        description="How long a failed job's dead letter stays (its record: retention_s).",
    )
    dead_letter_max: int = Field(
        default=10_000, ge=1, description="Dead letters kept at most; the oldest go first."
    )

    @field_validator("home")
    @classmethod
    def _absolute_home(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        expanded = value.expanduser()
        if not expanded.is_absolute():  # would differ between processes started elsewhere
            raise ValueError(f"home {str(value)!r} must be an absolute path")
        return expanded.resolve()

    @field_validator("redis_url")
    @classmethod
    def _redis_url_with_scheme(cls, value: str) -> str:
        return checked_redis_url(value)

    @field_validator("redis_sentinels", mode="before")
    @classmethod
    def _split_sentinels(cls, value: object) -> object:
        # env values are a plain comma list (h1:26379,h2:26379) or a JSON array
        return comma_or_json_list(value)

    @field_validator("redis_sentinels")
    @classmethod
    def _host_and_port(cls, value: list[str]) -> list[str]:
        for address in value:
            sentinel_address(address)  # ValueError naming the one that is not host:port
        return value

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """`redis_sentinels` as (host, port) pairs; empty: no Sentinel, `redis_url` is Redis."""
        return [sentinel_address(address) for address in self.redis_sentinels]

    @field_validator("storage_url")
    @classmethod
    def _absolute_file_url(cls, value: str) -> str:
        return absolute_storage_url(value)

    def describe(self) -> str:
        """What a long-running command logs at start: Redis (password masked), namespace, store."""
        redis = masked_url(self.redis_url)
        if self.redis_sentinels:
            redis = (
                f"sentinel master {self.redis_sentinel_master} via "
                f"{','.join(self.redis_sentinels)} ({redis})"
            )
        return f"redis {redis}, namespace {self.redis_namespace}, storage {self.storage_url}"

    @model_validator(mode="after")
    def _both_s3_keys_or_neither(self) -> StorageSettings:
        if (self.s3_access_key_id is None) != (self.s3_secret_access_key is None):
            raise ValueError("set both s3_access_key_id and s3_secret_access_key, or neither")
        return self
