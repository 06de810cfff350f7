"""The preemption-notice watcher: a spot/preemptible machine's notice starts the node's drain.

Off unless `KILN_PREEMPTION_NOTICE_URL` is set. A thread polls the URL every
`KILN_PREEMPTION_POLL_S` and reads it as `KILN_PREEMPTION_NOTICE_KIND` says:

- `aws`: EC2's spot `instance-action` (http://169.254.169.254/latest/meta-data/spot/instance-action):
  404 while there is none; once the machine is to be reclaimed, 200 with a JSON document such as
  `{"action": "terminate", "time": "2026-12-06T22:10:00Z"}` (about 2 minutes ahead). An IMDSv2
  session token is asked for first (`PUT /latest/api/token`) and sent when the endpoint gives one.
- `gce`: Compute Engine's `preempted` flag
  (http://metadata.google.internal/computeMetadata/v1/instance/preempted), asked with
  `Metadata-Flavor: Google`: `FALSE`, then `TRUE` once the VM is preempted (about 30 s ahead).

On a notice the watcher sends the node's own process SIGTERM: the same drain as a Kubernetes
scale-down (docs/operations.md §4): jobs that take step checkpoints checkpoint their next step and
go back to the queue at once, and the node exits. A poll that fails (the endpoint unreachable, an
answer it cannot read) is logged at debug and counts as no notice: a watcher never stops a node
on a guess.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

NoticeKind = Literal["aws", "gce"]
_TIMEOUT_S = 2.0  # a metadata endpoint answers in milliseconds; a hung one must not hold a poll
_AWS_TOKEN_PATH = "/latest/api/token"
_AWS_TOKEN_TTL_S = "21600"


@dataclass(frozen=True)
class PreemptionNotice:
    """What the endpoint announced: the action (AWS's `action`, `preempted` on GCE) and when."""

    action: str
    at: str | None = None


def read_notice(url: str, kind: NoticeKind) -> PreemptionNotice | None:
    """One poll: the notice the endpoint gives now, or None (none, or no readable answer)."""
    try:
        if kind == "gce":
            return _read_gce(url)
        return _read_aws(url)
    except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
        log.debug("preemption notice %s: no answer read: %s", url, exc)
        return None


def _read_gce(url: str) -> PreemptionNotice | None:
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
        text = response.read().decode().strip()
    return PreemptionNotice("preempted") if text.upper() == "TRUE" else None


def _read_aws(url: str) -> PreemptionNotice | None:
    headers = {}
    token = _aws_token(url)
    if token is not None:
        headers["X-aws-ec2-metadata-token"] = token
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=_TIMEOUT_S
        ) as response:
            document = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None  # no instance action scheduled
        raise
    if not isinstance(document, dict) or not isinstance(document.get("action"), str):
        raise ValueError(f"not an instance-action document: {document!r:.200}")
    at = document.get("time")
    return PreemptionNotice(document["action"], at if isinstance(at, str) else None)


def _aws_token(url: str) -> str | None:
    """An IMDSv2 session token from the notice URL's host; None where it gives none (IMDSv1)."""
    parts = urllib.parse.urlsplit(url)
    token_url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, _AWS_TOKEN_PATH, "", ""))
    request = urllib.request.Request(
        token_url,
        method="PUT",
        headers={"X-aws-ec2-metadata-token-ttl-seconds": _AWS_TOKEN_TTL_S},
    )
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
            return response.read().decode().strip() or None
    except (OSError, ValueError):
        return None


def terminate_this_process() -> None:
    """SIGTERM to this process: Celery's warm shutdown and the node's drain, as a scale-down."""
    os.kill(os.getpid(), signal.SIGTERM)


class PreemptionWatcher:
    """Polls the notice URL on a thread of its own until a notice comes (then drains) or stop()."""

    def __init__(
        self,
        url: str,
        kind: NoticeKind,
        interval_s: float,
        on_notice: Callable[[PreemptionNotice], None],
    ) -> None:
        self.url = url
        self.kind = kind
        self.interval_s = interval_s
        self._on_notice = on_notice
        self._stop = threading.Event()
        self.notice: PreemptionNotice | None = None
        self._thread = threading.Thread(target=self._run, name="preemption-notice", daemon=True)

    def start(self) -> None:
        """Start polling (the first poll at once)."""
        log.info("watching %s for a preemption notice (%s)", self.url, self.kind)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling (idempotent); a poll under way ends within its timeout."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            notice = read_notice(self.url, self.kind)
            if notice is not None:
                self.notice = notice
                log.warning(
                    "preemption notice (%s at %s): draining this node",
                    notice.action,
                    notice.at or "now",
                )
                self._on_notice(notice)
                return  # one drain: the node is going
            self._stop.wait(self.interval_s)
