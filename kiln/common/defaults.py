"""Defaults several parts of Kiln start from: each stated once, the CLI and the options take it.

- `MAX_BATCH`: most requests one forward runs together (`kiln worker --max-batch`,
  `WorkerOptions`, `GroupConfig`).
- `BATCH_WINDOW_S`: how long a group waits for more requests after the first of a forward
  arrives. 0: an idle group starts at once, and a busy one still batches, since what queued up
  while it ran goes together; a wait would only add latency to every lone request.
- `BATCH_LANE`: the lane of a batch's lines that name none.
- `DEADLINE_GRACE_S`: after a run's `max_run_seconds`, the time for a cooperative stop before
  the kill.
"""

from __future__ import annotations

from kiln.common.request import Lane

MAX_BATCH = 4
BATCH_WINDOW_S = 0.0
BATCH_LANE = Lane.bulk
DEADLINE_GRACE_S = 10.0
