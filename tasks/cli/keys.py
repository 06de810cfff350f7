"""`kiln keys create NAME [--admin] | list | revoke ID`: API keys, shown once, stored hashed."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from kiln.storage.apikeys import ApiKey, ApiKeyStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.api.auth import hash_api_key, new_api_key
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.process import ProcessParts


def create_key(
    keys: ApiKeyStore,
    name: str,
    admin: bool,
    pepper: str = "",
    *,
    max_queued: int | None = None,
    max_running: int | None = None,
) -> tuple[ApiKey, str]:
    """Make a key; returns its record and the secret (which is stored only as a hash)."""
    secret = new_api_key()
    caps = {"max_queued": max_queued, "max_running": max_running}
    return keys.create(hash_api_key(secret, pepper), name, admin, **caps), secret


def _key_dict(key: ApiKey) -> dict[str, object]:
    return {
        "id": key.id,
        "name": key.name,
        "admin": key.admin,
        "created_at": key.created_at,
        "revoked": key.revoked,
        "max_queued": key.max_queued,
        "max_running": key.max_running,
    }


def run(
    action: str,
    name_or_id: str | None,
    *,
    admin: bool = False,
    as_json: bool = False,
    settings: KilnSettings | None = None,
    storage_settings: StorageSettings | None = None,
    out: TextIO | None = None,
    max_queued: int | None = None,
    max_running: int | None = None,
) -> int:
    """Run one `kiln keys` action; returns the exit code (2 for a usage mistake)."""
    out = out or sys.stdout
    if (max_queued is not None or max_running is not None) and action != "create":
        print("kiln: --max-queued and --max-running go with keys create", file=sys.stderr)
        return 2
    if any(cap is not None and cap < 1 for cap in (max_queued, max_running)):
        print("kiln: --max-queued and --max-running must be at least 1", file=sys.stderr)
        return 2
    parts = ProcessParts(settings, storage_settings)  # either left out: the environment's
    settings, keys = parts.settings, parts.api_keys
    if action == "create":
        pepper = settings.api_key_pepper.get_secret_value()
        caps = (max_queued, max_running)
        return _create(keys, name_or_id, admin, pepper, as_json, out, caps)
    if action == "list":
        return _list(keys, as_json, out)
    if action == "revoke":
        return _revoke(keys, name_or_id, out)
    print(f"kiln: unknown keys action {action!r}", file=sys.stderr)
    return 2


def _create(
    keys: ApiKeyStore,
    name: str | None,
    admin: bool,
    pepper: str,
    as_json: bool,
    out: TextIO,
    caps: tuple[int | None, int | None] = (None, None),
) -> int:
    if not name:
        print("kiln: keys create needs a NAME", file=sys.stderr)
        return 2
    max_queued, max_running = caps
    key, secret = create_key(
        keys, name, admin, pepper, max_queued=max_queued, max_running=max_running
    )
    if as_json:
        print(json.dumps({**_key_dict(key), "key": secret}), file=out)
    else:
        kind = "admin key" if key.admin else "key"
        print(f"created {kind} {key.id} ({key.name}); it is shown only now:", file=out)
        print(secret, file=out)
    return 0


def _list(keys: ApiKeyStore, as_json: bool, out: TextIO) -> int:
    listed = keys.list()
    if as_json:
        print(json.dumps([_key_dict(k) for k in listed]), file=out)
        return 0
    for key in listed:
        flags = " ".join(f for f, on in (("admin", key.admin), ("revoked", key.revoked)) if on)
        caps = " ".join(
            f"{name}={cap}"
            for name, cap in (("max_queued", key.max_queued), ("max_running", key.max_running))
            if cap is not None
        )
        print(f"{key.id}\t{key.name}\t{flags}\t{caps}".rstrip(), file=out)
    return 0


def _revoke(keys: ApiKeyStore, key_id: str | None, out: TextIO) -> int:
    if not key_id:
        print("kiln: keys revoke needs a key ID (see `kiln keys list`)", file=sys.stderr)
        return 2
    revoked = keys.revoke(key_id)
    print(f"revoked {key_id}" if revoked else f"no live key {key_id}", file=out)
    return 0 if revoked else 1
