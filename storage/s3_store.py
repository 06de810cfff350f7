"""S3-compatible object store via boto3: multipart above a threshold, sha256, presigned GETs."""

from __future__ import annotations

import base64
import contextlib
import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import boto3
import botocore.config

from kiln.storage.errors import ObjectNotFound, ObjectStoreError
from kiln.storage.object_base import (
    SHA256_METADATA_KEY,
    STREAM_CHUNK,
    StoredObject,
    check_key,
    check_metadata,
)
from kiln.storage.s3_errors import s3_errors
from kiln.storage.settings import StorageSettings

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

MIB = 1024 * 1024
# parts of a multipart upload; S3 needs >= 5 MiB, larger parts mean fewer requests
_PART_SIZE = 8 * MIB
_PART_CONCURRENCY = 4  # parts of one upload in flight at once


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix` → ("bucket", "some/prefix")."""
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {url!r}")
    return bucket, prefix.strip("/")


def s3_client(settings: StorageSettings, endpoint_url: str | None = None) -> S3Client:
    """A boto3 S3 client configured from settings (retries for throttling and 5xx included).

    `endpoint_url` replaces `settings.s3_endpoint_url` (the public one, for presigning).
    """
    config = botocore.config.Config(
        retries={
            "mode": settings.s3_retry_mode,
            "total_max_attempts": settings.object_store_max_attempts,
        },
        s3={"addressing_style": settings.s3_addressing_style},
        # presigned URLs with SigV4 (SigV2 query auth is deprecated and region-blind)
        signature_version="s3v4",
        connect_timeout=10,
        read_timeout=60,
    )
    secret = settings.s3_secret_access_key
    client: S3Client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url or settings.s3_endpoint_url,
        region_name=settings.s3_region,
        aws_access_key_id=settings.s3_access_key_id,
        aws_secret_access_key=secret.get_secret_value() if secret else None,
        config=config,
    )
    return client


class S3ObjectStore:
    """Objects in an S3 bucket under a prefix."""

    def __init__(
        self,
        client: S3Client,
        bucket: str,
        prefix: str = "",
        *,
        multipart_threshold_bytes: int = 16 * MIB,
        presign_expiry_s: int = 3600,
        presign_client: S3Client | None = None,
    ) -> None:
        self.client = client
        # SigV4 signs the host: a URL for clients outside the store's network (compose's
        # http://minio:9000 is unreachable from a browser) is signed for their endpoint.
        self.presign_client = presign_client or client
        self.bucket = bucket
        self.prefix = prefix
        self.multipart_threshold_bytes = multipart_threshold_bytes
        self.presign_expiry_s = presign_expiry_s

    @classmethod
    def from_settings(cls, settings: StorageSettings) -> S3ObjectStore:
        """The store named by `settings.storage_url` (`s3://bucket/prefix`)."""
        bucket, prefix = parse_s3_url(settings.storage_url)
        public = settings.s3_public_endpoint_url
        return cls(
            s3_client(settings),
            bucket,
            prefix,
            multipart_threshold_bytes=settings.multipart_threshold_mb * MIB,
            presign_expiry_s=settings.presign_expiry_s,
            presign_client=s3_client(settings, public) if public else None,
        )

    def put(
        self,
        key: str,
        data: bytes,
        content_type: str,
        metadata: dict[str, str] | None = None,
        *,
        create_only: bool = False,
    ) -> StoredObject:
        """Upload (multipart above the threshold) with a SHA256 checksum S3 verifies on receipt.

        A single-part upload is `checksum_verified` when the store's answer echoes the checksum
        it checked (S3, MinIO); multipart ones and stores that ignore checksums are not.
        `create_only` sends `If-None-Match: *` (on the completion of a multipart upload): a key
        that exists already is refused (412) as ObjectExists and left as it was.
        """
        check_key(self.prefix, key)
        user_metadata = dict(check_metadata(metadata or {}))
        digest = hashlib.sha256(data).hexdigest()
        extra: dict[str, Any] = {
            "ContentType": content_type,
            "Metadata": {**user_metadata, SHA256_METADATA_KEY: digest},
            "ChecksumAlgorithm": "SHA256",
        }
        condition: dict[str, Any] = {"IfNoneMatch": "*"} if create_only else {}
        with s3_errors(key):
            if len(data) >= self.multipart_threshold_bytes:
                # by hand: boto3's transfer manager cannot send If-None-Match on the completion
                self._put_multipart(key, data, extra, condition)
                return StoredObject(key, len(data), digest, content_type, user_metadata)
            # Our digest, not one botocore computes while sending: the store then checks the
            # bytes it received against what we hashed (BadDigest otherwise), and a store that
            # did check says so by echoing it back.
            sent = base64.b64encode(bytes.fromhex(digest)).decode()
            answer = self.client.put_object(
                Bucket=self.bucket, Key=key, Body=data, ChecksumSHA256=sent, **extra, **condition
            )
        verified = answer.get("ChecksumSHA256") == sent
        return StoredObject(key, len(data), digest, content_type, user_metadata, verified)

    def _put_multipart(
        self, key: str, data: bytes, extra: dict[str, Any], condition: dict[str, Any]
    ) -> None:
        """A multipart upload whose completion carries `condition`; aborted if anything fails."""
        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=key, **extra)[
            "UploadId"
        ]

        def upload_part(number: int) -> CompletedPartTypeDef:
            chunk = data[(number - 1) * _PART_SIZE : number * _PART_SIZE]
            sent = base64.b64encode(hashlib.sha256(chunk).digest()).decode()
            answer = self.client.upload_part(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=chunk,
                ChecksumSHA256=sent,
            )
            return {"PartNumber": number, "ETag": answer["ETag"], "ChecksumSHA256": sent}

        numbers = range(1, -(-len(data) // _PART_SIZE) + 1)
        try:
            with ThreadPoolExecutor(max_workers=_PART_CONCURRENCY) as pool:
                parts = list(pool.map(upload_part, numbers))
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **condition,
            )
        except BaseException:
            with contextlib.suppress(Exception):  # parts left behind cost storage, not safety
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    def head(self, key: str) -> StoredObject | None:
        """What is stored under `key`, or None."""
        check_key(self.prefix, key)
        try:
            with s3_errors(key):
                answer = self.client.head_object(
                    Bucket=self.bucket, Key=key, ChecksumMode="ENABLED"
                )
        except ObjectNotFound:
            return None
        metadata = dict(answer.get("Metadata", {}))
        digest = metadata.pop(SHA256_METADATA_KEY, "") or _full_object_sha256(answer)
        return StoredObject(
            key,
            int(answer["ContentLength"]),
            digest,
            answer.get("ContentType", "application/octet-stream"),
            metadata,
        )

    def get(self, key: str) -> bytes:
        """The bytes under `key`, checked against the stored sha256; ObjectNotFound if none."""
        check_key(self.prefix, key)
        with s3_errors(key):
            answer = self.client.get_object(Bucket=self.bucket, Key=key)
            data = answer["Body"].read()
        expected = answer.get("Metadata", {}).get(SHA256_METADATA_KEY)
        if expected and hashlib.sha256(data).hexdigest() != expected:
            raise ObjectStoreError(f"object {key!r} does not match its sha256")
        return data

    def stream(
        self, key: str, start: int, stop: int, chunk_size: int = STREAM_CHUNK
    ) -> Iterator[bytes]:
        """Bytes `start` up to `stop` (exclusive) of `key`: one ranged GET, read as consumed.

        The GET is sent at the call (ObjectNotFound then, not at the first chunk); its body is
        closed when the iterator ends or is closed.
        """
        check_key(self.prefix, key)
        if stop <= start:
            return iter(())
        with s3_errors(key):
            answer = self.client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={start}-{stop - 1}"
            )
        return _body_chunks(answer["Body"], key, chunk_size)

    def delete(self, key: str) -> None:
        """Remove `key` (no error if absent)."""
        check_key(self.prefix, key)
        with s3_errors(key):
            self.client.delete_object(Bucket=self.bucket, Key=key)

    def list_keys(self, folder: str) -> Iterator[str]:
        """Every key under `folder/`, page by page (S3 lists keys in UTF-8 binary order)."""
        check_key(self.prefix, folder)
        pages = self.client.get_paginator("list_objects_v2")
        with s3_errors(folder):
            for page in pages.paginate(Bucket=self.bucket, Prefix=folder + "/"):
                for entry in page.get("Contents", ()):
                    yield entry["Key"]

    def url(self, key: str, expires_s: int | None = None) -> str:
        """A presigned GET URL valid for `expires_s` (default: the store's presign expiry)."""
        check_key(self.prefix, key)
        with s3_errors(key):
            return self.presign_client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": key},
                ExpiresIn=expires_s or self.presign_expiry_s,
            )


def _body_chunks(body: Any, key: str, chunk_size: int) -> Iterator[bytes]:
    """An S3 answer's body in chunks; closes it however the reading ends."""
    try:
        with s3_errors(key):
            yield from body.iter_chunks(chunk_size)
    finally:
        body.close()


def _full_object_sha256(answer: Any) -> str:
    # only a single-part upload's checksum is the sha256 of the whole object ("...-N" is not)
    checksum = answer.get("ChecksumSHA256") or ""
    if not checksum or "-" in checksum:
        return ""
    return base64.b64decode(checksum).hex()
