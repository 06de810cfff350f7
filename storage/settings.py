"""Settings of the storage package: one pydantic-settings class, `KILN_` prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def resolve_storage_url(url: str) -> str:
    """Return `url` with a relative `file://` path made absolute (against the working directory)."""
    if not url.startswith("file://"):
        return url
    path = url[len("file://") :]
    if path.startswith("localhost/"):
        path = path[len("localhost") :]
    return "file://" + str(Path(path).expanduser().resolve())


class StorageSettings(BaseSettings):
    """Where job state (Redis) and outputs (S3 or a local directory) live, and their lifetimes."""

    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore")

    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis for job state.")
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
    storage_url: str = Field(
        default="file://./kiln-outputs",
        description="Where outputs go: `s3://bucket/prefix` or `file:///absolute/path`.",
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
    event_stream_maxlen: int = Field(
        default=1000, ge=1, description="Events kept per job (older ones are trimmed)."
    )

    @field_validator("storage_url")
    @classmethod
    def _absolute_file_url(cls, value: str) -> str:
        if not value.startswith(("s3://", "file://")):
            raise ValueError("storage_url must start with s3:// or file://")
        return resolve_storage_url(value)

    @model_validator(mode="after")
    def _both_s3_keys_or_neither(self) -> StorageSettings:
        if (self.s3_access_key_id is None) != (self.s3_secret_access_key is None):
            raise ValueError("set both s3_access_key_id and s3_secret_access_key, or neither")
        return self
