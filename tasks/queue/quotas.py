"""Per-API-key caps on queued and running jobs (docs/operations.md §10).

A key's own cap (`kiln keys create --max-queued N --max-running N`) overrides the server's default
(`KILN_MAX_QUEUED_PER_KEY`, `KILN_MAX_RUNNING_PER_KEY`); None is no cap. The state machine counts
each owner's queued and running jobs; the queued cap is checked when a job is written (the API
answers 429; a batch's feeder feeds no more of the key's lines than it leaves room for), the
running cap when a node would start one (it re-publishes it for later).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kiln.storage.apikeys import ApiKey, ApiKeyStore

# how long a node trusts a key's caps before reading them again
CAPS_CACHE_S = 5.0


def effective_cap(own: int | None, default: int | None) -> int | None:
    """The key's own cap if it has one, else the server's default (None: no cap)."""
    return own if own is not None else default


class KeyCaps:
    """One of each owner's caps, as a node needs it at every start or feed (cached briefly)."""

    def __init__(
        self, keys: ApiKeyStore, default: int | None, own: Callable[[ApiKey], int | None]
    ) -> None:
        self.keys = keys
        self.default = default
        self.own = own  # the key's own cap, read from its record
        self._cached: dict[str, tuple[float, int | None]] = {}
        self._lock = threading.Lock()

    def cap(self, owner: str | None) -> int | None:
        """The cap of the key `owner` (None: no owner, or no cap)."""
        if owner is None:
            return None
        now = time.monotonic()
        with self._lock:
            hit = self._cached.get(owner)
        if hit is not None and now - hit[0] < CAPS_CACHE_S:
            return hit[1]
        key = self.keys.get(owner)
        cap = effective_cap(self.own(key) if key is not None else None, self.default)
        with self._lock:
            self._cached[owner] = (now, cap)
        return cap


class RunningCaps(KeyCaps):
    """Each owner's cap on running jobs (`--max-running`, `KILN_MAX_RUNNING_PER_KEY`)."""

    def __init__(self, keys: ApiKeyStore, default: int | None) -> None:
        super().__init__(keys, default, lambda key: key.max_running)


class QueuedCaps(KeyCaps):
    """Each owner's cap on queued jobs (`--max-queued`, `KILN_MAX_QUEUED_PER_KEY`)."""

    def __init__(self, keys: ApiKeyStore, default: int | None) -> None:
        super().__init__(keys, default, lambda key: key.max_queued)
