"""Log lines of a rank process, in the format its node uses (`GroupConfig.log_format`).

A rank writes to its inherited stderr, which is the node's: with `json`, one JSON object per line
(time, level, logger, message, `node_id`, `rank`, and during a forward the `job_id` of each
request in it and the coordinator's `forward` number); with `text`, one readable line. The
formats are every Kiln process's (`kiln.common.logs`); gpu_worker never reads the tasks package's
settings: the node passes the format down in the group's config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from kiln.common.logs import configure_logging, log_context

TEXT_FORMAT = "[%(asctime)s: %(levelname)s/rank%(rank)s] %(name)s: %(message)s"


def configure_rank_logging(log_format: str, level: str, *, node_id: str, rank: int) -> None:
    """Make this rank's root logger write `log_format` lines to stderr."""
    configure_logging(
        log_format, level, static={"node_id": node_id, "rank": rank}, text_format=TEXT_FORMAT
    )


@contextlib.contextmanager
def forward_fields(forward: int, job_ids: Sequence[str]) -> Iterator[None]:
    """Records logged inside carry the forward's number and its jobs (`job_id` when one)."""
    if len(job_ids) == 1:
        with log_context(forward=forward, job_id=job_ids[0]):
            yield
    else:
        with log_context(forward=forward, job_ids=list(job_ids)):
            yield
