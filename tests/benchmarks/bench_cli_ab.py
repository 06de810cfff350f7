"""What `kiln` commands cost in two Kiln trees side by side: a base and a candidate (a script).

    git archive HEAD | tar -x -C /tmp/kiln-base
    .venv/bin/python -m compileall -q /tmp/kiln-base   # as `make bytecode` does for this tree
    .venv/bin/python tests/benchmarks/bench_cli_ab.py /tmp/kiln-base [--rounds 5]

Each command runs as a user runs it (`python -m kiln.tasks.cli`, a fresh interpreter, this venv)
from each tree in turn, on its own Redis namespace and a local store, straight to Redis, plus one
sent to an API that is not there. What is measured is the CPU seconds (user + system) of the
command's process: on a shared machine, less noisy than its wall time. The trees alternate which
goes first; prints the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.conftest import TEST_REDIS_URL, delete_namespace  # noqa: E402

UNREACHABLE_API = {"KILN_API_URL": "http://127.0.0.1:9", "KILN_API_KEY": "kiln_bench_key"}


def command_cpu_s(tree: Path, args: list[str], env: dict[str, str]) -> tuple[float, str]:
    """One `kiln ARGS` from `tree`: its CPU seconds and its stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, "-m", "kiln.tasks.cli", *args],
        cwd=tree,  # `-m` puts the tree first on sys.path: its `kiln` package is the one run
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    spent = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return spent, done.stdout


def main() -> None:
    """Each command from both trees, interleaved; the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", type=Path, help="the base tree (e.g. `git archive HEAD`)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    trees = [("base", args.base.resolve()), ("candidate", ROOT)]
    namespace = f"kiln-bench-cli-{secrets.token_hex(4)}"
    keep = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    with tempfile.TemporaryDirectory(prefix="kiln-cli-ab-") as folder:
        env = {
            **keep,
            "KILN_TEST_REDIS_URL": TEST_REDIS_URL,
            "KILN_REDIS_NAMESPACE": namespace,
            "KILN_STORAGE_URL": f"file://{folder}",
            "KILN_PIPELINES": "tiny",
            "COLUMNS": "80",
        }
        try:
            _, out = command_cpu_s(ROOT, ["submit", "a kiln", "--pipeline", "tiny", "--json"], env)
            job = json.loads(out)["id"]
            commands: dict[str, tuple[list[str], dict[str, str]]] = {
                "submit": (["submit", "a kiln at dusk", "--pipeline", "tiny", "--json"], env),
                "status": (["status", job], env),
                "status --json": (["status", job, "--json"], env),
                "jobs --json": (["jobs", "--json"], env),
                "status, no such job": (["status", "zzzzzzzz"], env),
                "status, API unreachable": (["status", job], {**env, **UNREACHABLE_API}),
                "--version": (["--version"], env),
            }
            spent: dict[tuple[str, str], list[float]] = {}
            for round_ in range(args.rounds):
                for name, (argv, command_env) in commands.items():
                    for label, tree in trees if round_ % 2 == 0 else trees[::-1]:
                        cpu_s, _ = command_cpu_s(tree, argv, command_env)
                        spent.setdefault((label, name), []).append(cpu_s)
        finally:
            delete_namespace(TEST_REDIS_URL, namespace)
    print(f"{'command':<26} {'base':>6} {'candidate':>9}   median CPU s of {args.rounds}")
    for name in commands:
        base, candidate = (statistics.median(spent[(label, name)]) for label, _ in trees)
        print(f"{name:<26} {base:6.2f} {candidate:9.2f}")


if __name__ == "__main__":
    main()
