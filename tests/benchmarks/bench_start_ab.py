"""A node's cold start in two Kiln trees side by side: a base and a candidate (a script).

    git archive HEAD | tar -x -C /tmp/kiln-base
    .venv/bin/python tests/benchmarks/bench_start_ab.py /tmp/kiln-base [--repeats 3]
        [--pipeline sleepy=python:tests.e2e.pipelines:sleepy]

Per sample, one tree's `kiln worker` (1 CPU rank, the pipeline given, its own namespace and bucket
on the same Redis and moto S3) is started cold, and a job submitted at once: the seconds from the
worker's start to its first heartbeat listing the pipeline ready (`ready_s`), from the submit to
the job's first denoising step (`first_step_s`, Redis TIME), and the CPU seconds the node's own
process had used by then (`node_cpu_s`: not its rank server's, not its ranks'). The trees
alternate which goes first, so a shared, noisy machine slows both alike. Prints each sample, then
the medians.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from moto.server import ThreadedMotoServer  # noqa: E402

from tests.benchmarks.bench_overhead_ab import start_side  # noqa: E402
from tests.benchmarks.bench_process_start import GENEROUS_S, seconds_to_first_step  # noqa: E402
from tests.conftest import TEST_REDIS_URL, delete_namespace  # noqa: E402
from tests.e2e.cluster import process_cpu_s  # noqa: E402


def cold_start(
    label: str, tree: Path, endpoint: str, tmp: Path, name: str, spec: str
) -> dict[str, float]:
    """One cold `kiln worker` from `tree`, a job submitted at once; its two figures (s)."""
    started = time.monotonic()
    side = start_side(label, tree, endpoint, tmp, name=name, spec=spec)
    try:
        first_step = seconds_to_first_step(side.cluster, name)
        side.worker.wait_ready(timeout_s=GENEROUS_S)  # ready before its first step: at once
        ready_s = time.monotonic() - started
        node_cpu_s = process_cpu_s(side.worker.process.pid)
        return {"first_step_s": first_step, "ready_s": ready_s, "node_cpu_s": node_cpu_s}
    finally:
        side.worker.stop()
        delete_namespace(TEST_REDIS_URL, side.cluster.storage_settings.redis_namespace)


def main() -> None:
    """Interleaved cold starts of both trees; the samples and the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", type=Path, help="the base tree (e.g. `git archive HEAD`)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pipeline", default="sleepy=python:tests.e2e.pipelines:sleepy")
    args = parser.parse_args()
    name, _, spec = args.pipeline.partition("=")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    trees = [("base", args.base.resolve()), ("candidate", ROOT)]
    samples: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-start-ab-") as folder:
            for repeat in range(args.repeats):
                for label, tree in trees if repeat % 2 == 0 else trees[::-1]:
                    tmp = Path(folder) / f"{label}-{repeat}"
                    tmp.mkdir()
                    figures = cold_start(label, tree, f"http://{host}:{port}", tmp, name, spec)
                    samples[label].append(figures)
                    print(f"# {repeat + 1}/{args.repeats} {label}: {figures}", flush=True)
    finally:
        moto.stop()
    print(f"{args.pipeline}: medians over {args.repeats} cold starts (s)")
    for label, found in samples.items():
        cells = [f"{key} {statistics.median(s[key] for s in found):6.2f}" for key in found[0]]
        print(f"{label:<10} " + "   ".join(cells))


if __name__ == "__main__":
    main()
