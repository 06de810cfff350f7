"""A rank's log lines: the node's format, with the node id, the rank and the forward's jobs."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import logging
from kiln.gpu_worker.logs import configure_rank_logging, forward_fields
configure_rank_logging({fmt!r}, "INFO", node_id="n1", rank=1)
log = logging.getLogger("kiln.rank")
log.info("before")
with forward_fields(7, ["j1"]):
    log.info("one job")
with forward_fields(8, ["j1", "j2"]):
    log.info("two jobs")
log.info("after")
"""


def rank_output(fmt: str) -> list[str]:
    """The stderr lines of a process that logs as a rank in format `fmt`."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(fmt=fmt)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stderr.splitlines()


def test_json_lines_carry_the_rank_and_each_forwards_jobs() -> None:
    lines = [json.loads(line) for line in rank_output("json")]
    assert [line["message"] for line in lines] == ["before", "one job", "two jobs", "after"]
    assert {(line["node_id"], line["rank"], line["level"]) for line in lines} == {("n1", 1, "INFO")}
    assert all(line["time"].endswith("+00:00") for line in lines)
    before, one, two, after = lines
    assert [key for key in ("forward", "job_id") if key in before or key in after] == []
    assert (one["forward"], one["job_id"]) == (7, "j1")
    assert (two["forward"], two["job_ids"]) == (8, ["j1", "j2"])


def test_text_lines_name_the_rank() -> None:
    lines = rank_output("text")
    assert len(lines) == 4
    assert all("INFO/rank1] kiln.rank: " in line for line in lines)
