"""`kiln submit --input image=@cat.png`: the file uploaded, its reference passed as the input.

With `--api` the file goes through `POST /v1/uploads` (the API key's own uploads); without, it is
written straight to the object store among the uploads of jobs without an owner, which is what
a job submitted straight to Redis is.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.tasks.cli.exits import UsageError


def upload_file(args: argparse.Namespace, path: str) -> str:
    """Upload the file at `path`; returns its reference (`upload:<id>`) for a job's input."""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if getattr(args, "api", None):
        from kiln.tasks.client.client import KilnClient

        with KilnClient(args.api, args.api_key) as client:
            return client.upload(data).ref
    return _store_directly(data)


def _store_directly(data: bytes) -> str:
    from kiln.common.media import UPLOAD_REF_PREFIX
    from kiln.storage.objects import open_object_store
    from kiln.storage.settings import StorageSettings
    from kiln.storage.uploaded_inputs import new_upload_id, upload_key
    from kiln.tasks.client.client import sniff_content_type

    objects = open_object_store(StorageSettings())
    upload_id = new_upload_id()
    key = upload_key(getattr(objects, "prefix", ""), None, upload_id)
    objects.put(key, data, sniff_content_type(data))
    return f"{UPLOAD_REF_PREFIX}{upload_id}"
