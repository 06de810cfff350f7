"""The CPU cost of one job's spans in one process, tracing off and on (a script).

    .venv/bin/python tests/benchmarks/bench_tracing.py [--jobs 2000]

Makes, per job, what a node and its rank 0 make for a one-output job (kiln/common/tracing.py):
the attempt span, the recorded queue wait, an encode and an upload span, and rank 0's denoise
span with its 4 step events, text encoding and decode; first with tracing off, then on, exporting
over OTLP/HTTP (the SDK's batch processor) to a collector in this process
(tests/span_collector.py). Prints microseconds per job, p50 over rounds of 100 jobs.
bench_node.py --tracing measures the same on a running node, end to end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kiln.common import tracing
from tests.span_collector import span_collector

STEPS = 4
ROUND = 100


def one_job(parent: dict[str, str]) -> None:
    """The spans of one job, as the node and rank 0 make them."""
    now = time.time()
    with tracing.span(tracing.ATTEMPT_SPAN, parent, attributes={"kiln.job_id": "j"}):
        tracing.record_span(tracing.QUEUE_WAIT_SPAN, parent, now - 0.01, now)
        request_trace = tracing.current_carrier() or parent
        events = [(tracing.STEP_EVENT, now, {"step": s, "total": STEPS}) for s in range(STEPS)]
        denoise = tracing.record_span(
            tracing.DENOISE_SPAN, request_trace, now, now, {"kiln.job_id": "j"}, events
        )
        tracing.record_span(tracing.TEXT_ENCODING_SPAN, denoise, now, now)
        tracing.record_span(tracing.DECODE_SPAN, denoise, now, now)
        with tracing.span(tracing.ENCODE_SPAN, attributes={"kiln.output": 0}):
            pass
        with tracing.span(tracing.UPLOAD_SPAN, attributes={"kiln.output": 0}):
            pass


def per_job_us(jobs: int, parent: dict[str, str]) -> float:
    """p50 over rounds of ROUND jobs of the microseconds one job's spans take."""
    rounds = []
    for _ in range(max(1, jobs // ROUND)):
        started = time.perf_counter()
        for _ in range(ROUND):
            one_job(parent)
        rounds.append((time.perf_counter() - started) / ROUND * 1e6)
    return statistics.median(rounds)


def main() -> None:
    """Off, then on; print both."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    args = parser.parse_args()
    parent = {tracing.TRACEPARENT: f"00-{'a' * 32}-{'b' * 16}-01"}
    off = per_job_us(args.jobs, parent)
    with span_collector() as collector:
        os.environ.update(collector.env())
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "5000"  # the SDK's default schedule
        assert tracing.start_tracing("kiln-bench")
        on = per_job_us(args.jobs, parent)
        tracing.stop_tracing()  # exports what is left
        spans = len(collector.spans())
    print(f"tracing off: {off:8.1f} us of span work per job")
    print(
        f"tracing on:  {on:8.1f} us per job ({spans} spans exported, {spans / args.jobs:.1f} a job)"
    )


if __name__ == "__main__":
    main()
