"""A batch run while its nodes are killed one after another: steps computed ÷ steps needed.

Run: `.venv/bin/python tests/benchmarks/bench_kill_batch.py [--lines 2000] [--steps 40]
[--step-s 0.25] [--kill-every 30] [--nodes 2] [--every-steps 4] [--modes before,after]`.

`--nodes` real `kiln worker` processes serve the `drifting` fixture pipeline
(tests/e2e/resumable_pipeline.py: a `python:` pipeline with the save/restore hooks, each step
sleeping `--step-s` so a job stands in for a long one without loading the CPU). A batch of
`--lines` jobs of `--steps` steps is submitted (`kiln batch submit`) and, until it ends, every
`--kill-every` seconds the oldest node is SIGKILLed (its ranks die with it) and a fresh one is
started in its place (the next interval counts from when it serves): a spot fleet losing a
machine every `--kill-every` seconds of service. Its running
jobs wait out their lease (3 s here) and are taken by the others.

Modes, each on its own fresh Redis and nodes:
- before: the lines ask for no step checkpoints (an image's default: none), so a job whose node
  is killed starts again from step 0, as every job did before step checkpoints;
- after: each line asks for a checkpoint every `--every-steps` steps (`checkpoint`), so it
  resumes from its last one.

Per mode: steps computed (summed over every job's attempts from the batch's result lines, the
jobs' own step accounting: docs/contract.md §5b) ÷ steps needed (lines × steps), steps restored
and recomputed, kills, wall time, lines not succeeded. Attempts are not what is measured, so
`KILN_MAX_ATTEMPTS` is raised to 100 for both modes (a job of the before mode may be killed
several times). Needs `redis-server` on PATH; everything runs in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.benchmarks.bench_batches import base_env, start_redis  # noqa: E402
from tests.e2e.cluster import Cluster, WorkerProcess  # noqa: E402
from tests.e2e.conftest import FAST_RECOVERY_ENV  # noqa: E402
from tests.e2e.pipelines import STEP_SECONDS_ENV  # noqa: E402

PIPELINE = "drifting=python:tests.e2e.resumable_pipeline:make"
MODES = ("before", "after")


@dataclass(frozen=True)
class Outcome:
    """One mode's figures."""

    mode: str
    lines: int
    needed: int
    computed: int
    restored: int
    recomputed: int
    kills: int
    wall_s: float
    unsucceeded: int

    def line(self) -> str:
        return (
            f"{self.mode:<6}: {self.lines} lines, steps computed {self.computed} / needed "
            f"{self.needed} = {self.computed / self.needed:.3f}; restored {self.restored}, "
            f"recomputed {self.recomputed}; {self.kills} kills; wall {self.wall_s:.0f} s; "
            f"not succeeded {self.unsucceeded}"
        )


def run_mode(mode: str, args: argparse.Namespace, folder: Path) -> Outcome:
    server, redis_url = start_redis(folder)
    env = {
        **base_env(redis_url, folder),
        **FAST_RECOVERY_ENV,
        "KILN_PIPELINES": '["drifting"]',
        "KILN_MAX_ATTEMPTS": "100",
        "KILN_TEST_COMPLETIONS": str(folder / "completions.log"),
        STEP_SECONDS_ENV: str(args.step_s),
    }
    cluster = Cluster(env, folder)
    try:
        nodes = [cluster.start_worker(PIPELINE, wait=False) for _ in range(args.nodes)]
        for node in nodes:
            node.wait_ready()
        line: dict[str, object] = {"prompt": "a kiln", "width": 64, "height": 64}
        line["steps"] = args.steps
        if mode == "after":
            line["checkpoint"] = {"every_steps": args.every_steps}
        path = folder / "batch.jsonl"
        with path.open("w") as out:
            for n in range(args.lines):
                out.write(json.dumps({**line, "seed": n, "custom_id": f"l{n:05d}"}) + "\n")
        started = time.monotonic()
        submitted = cluster.run_cli(
            "batch", "submit", str(path), "--pipeline", "drifting", "--json", timeout_s=600
        )
        assert submitted.returncode == 0, submitted.stderr
        batch_id = json.loads(submitted.stdout)["id"]
        kills = kill_until_done(cluster, nodes, batch_id, args.kill_every)
        wall_s = time.monotonic() - started
        results = cluster.run_cli("batch", "results", batch_id, timeout_s=600)
        assert results.returncode == 0, results.stderr
        rows = [json.loads(text) for text in results.stdout.splitlines() if text.strip()]
        lines = [row for row in rows if row.get("type") == "result"]
        assert len(lines) == args.lines, f"{len(lines)} result lines for {args.lines}"
        return Outcome(
            mode,
            args.lines,
            args.lines * args.steps,
            sum(row["accounting"]["steps_computed"] for row in lines),
            sum(row["accounting"]["steps_restored"] for row in lines),
            sum(row["accounting"]["steps_recomputed"] for row in lines),
            kills,
            wall_s,
            sum(row["status"] != "succeeded" for row in lines),
        )
    finally:
        cluster.stop_all()
        server.terminate()
        server.wait(10)


def kill_until_done(
    cluster: Cluster, nodes: list[WorkerProcess], batch_id: str, every_s: float
) -> int:
    """SIGKILL the oldest node every `every_s` seconds (a fresh one replaces it) until the end.

    The interval counts from when the replacement is ready, so a kill never hits a node that
    is still starting.
    """
    done = threading.Event()

    def wait() -> None:
        answer = cluster.run_cli("batch", "wait", batch_id, "--json", timeout_s=86400)
        assert answer.returncode in (0, 1), answer.stderr  # 1: some line did not succeed
        done.set()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    kills = 0
    while not done.wait(every_s):
        victim = nodes.pop(0)
        victim.kill9()
        kills += 1
        # the next kill counts from when the replacement serves (its start takes seconds here)
        nodes.append(cluster.start_worker(PIPELINE))
    waiter.join()
    return kills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-s", type=float, default=0.25)
    parser.add_argument("--kill-every", type=float, default=30.0)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--every-steps", type=int, default=4)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    print(
        f"{args.lines} lines x {args.steps} steps of {args.step_s} s, {args.nodes} nodes, "
        f"one killed every {args.kill_every} s; after: a checkpoint every {args.every_steps} steps"
    )
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix="kiln-kill-batch-") as tmp:
            print(run_mode(mode, args, Path(tmp)).line(), flush=True)


if __name__ == "__main__":
    main()
