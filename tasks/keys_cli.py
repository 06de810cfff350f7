"""`kiln keys create NAME [--admin] | list | revoke ID`: API keys, shown once, stored hashed."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from storage.apikeys import ApiKey, ApiKeyStore
from storage.settings import StorageSettings
from tasks.auth import hash_api_key, new_api_key
from tasks.settings import KilnSettings


def create_key(keys: ApiKeyStore, name: str, admin: bool, pepper: str = "") -> tuple[ApiKey, str]:
    """Make a key; returns its record and the secret (which is stored only as a hash)."""
    secret = new_api_key()
    return keys.create(hash_api_key(secret, pepper), name, admin), secret


def _key_dict(key: ApiKey) -> dict[str, object]:
    return {
        "id": key.id,
        "name": key.name,
        "admin": key.admin,
        "created_at": key.created_at,
        "revoked": key.revoked,
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
) -> int:
    """Run one `kiln keys` action; returns the exit code (2 for a usage mistake)."""
    out = out or sys.stdout
    settings = settings or KilnSettings()
    keys = ApiKeyStore.from_settings(storage_settings or StorageSettings())
    pepper = settings.api_key_pepper.get_secret_value()
    if action == "create":
        if not name_or_id:
            print("kiln: keys create needs a NAME", file=sys.stderr)
            return 2
        key, secret = create_key(keys, name_or_id, admin, pepper)
        if as_json:
            print(json.dumps({**_key_dict(key), "key": secret}), file=out)
        else:
            kind = "admin key" if key.admin else "key"
            print(f"created {kind} {key.id} ({key.name}); it is shown only now:", file=out)
            print(secret, file=out)
        return 0
    if action == "list":
        listed = keys.list()
        if as_json:
            print(json.dumps([_key_dict(k) for k in listed]), file=out)
        for key in [] if as_json else listed:
            flags = " ".join(f for f, on in (("admin", key.admin), ("revoked", key.revoked)) if on)
            print(f"{key.id}\t{key.name}\t{flags}".rstrip(), file=out)
        return 0
    if action == "revoke":
        if not name_or_id:
            print("kiln: keys revoke needs a key ID (see `kiln keys list`)", file=sys.stderr)
            return 2
        revoked = keys.revoke(name_or_id)
        print(f"revoked {name_or_id}" if revoked else f"no live key {name_or_id}", file=out)
        return 0 if revoked else 1
    print(f"kiln: unknown keys action {action!r}", file=sys.stderr)
    return 2
