"""What one Redis carries (docs/scaling.md): its cost per job, per batch line and per idle node.

Real processes on this machine, on a private redis-server (no persistence, Debian's or the one on
PATH) read through its own counters (`INFO stats cpu commandstats`, no MONITOR): a `kiln api`
and `kiln worker` nodes serving the sleepy test pipeline (each job sleeps `--step-s` per step,
two steps), every interval at its default, the outputs on local disk.

1. Idle: the API alone, then 1, 2, 4, ... nodes (`--idle-nodes`), each count measured for
   `--idle-s` seconds: commands, round trips (Redis read events), bytes and Redis main-thread
   CPU per second, per node (what the nodes add over the API alone, divided by their count),
   and the least-squares cost of one more node over all counts (the "fit" row).
   Per-node figures that grow with the count would be a loop costing more than linearly: the
   "n² check" fits each total (less the API alone) to a + b·n + c·n² over three counts or
   more, and such a loop shows as c > 0.
   Then the same count again with one batch active but paused (`HELD_LINES` lines, a window
   fed and run first, the rest held): what each node's batch feeder costs while any batch is
   active (`--no-batch-idle` skips it).
2. Jobs: `--jobs` jobs submitted through the API (`--clients` threads) while their queues are
   paused (the creation's cost), then run by all the nodes (the run's cost, and jobs/s), each
   less the idle background of the same processes for the same time.
3. Batch: `--lines` lines through `kiln batch submit`, fed and run by the nodes, per line.

First, this machine's Redis is calibrated (`--calibrate` PINGs one by one, then as many GETs in
pipelines of 100): its CPU per bare round trip and per pipelined command, so the figures can be
carried to a faster or slower server.

The bench waits on the pipeline's completions file, then reads Redis a few times (5 Hz) until
the jobs or the batch show as done: its own reads are a handful per phase, not per job.

    .venv/bin/python -m tests.benchmarks.bench_capacity --idle-nodes 1,2,4 --jobs 400

The cost per job and the Redis CPU it takes give the jobs/s at which one Redis core binds:
printed with the arithmetic (docs/scaling.md repeats it).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy
import redis

from kiln.common.states import JobState
from kiln.storage.batch_store import BatchStore
from kiln.storage.counters import finished_counts
from kiln.tasks.queue.backlog import pipeline_queues
from tests.e2e.cluster import SLEEPY, Cluster
from tests.e2e.sentinel_rig import RedisNode, redis_binary
from tests.e2e.test_observability import ApiProcess, start_api
from tests.waiting import wait_until

PIPELINE = "sleepy"
NAMESPACE = "kiln-capacity"
SETTLE_S = 8.0  # after nodes start: their first audits and claims are not the steady state
CALIBRATION_PIPELINE = 100  # GETs per round trip in the calibration's second half
HELD_LINES = 300  # lines of the batch held paused (over the window cap, 256 by default)


@dataclass(frozen=True)
class Counters:
    """One reading of the server's counters."""

    at: float  # monotonic
    commands: dict[str, int]  # per command name: calls (those run inside scripts included)
    usec: dict[str, int]  # per command name: microseconds spent
    reads: int  # read events on client sockets: round trips
    bytes_in: int
    bytes_out: int
    cpu_s: float  # the main thread's user + system CPU
    own_reply_bytes: int  # this reading's own reply, counted in the next one


@dataclass(frozen=True)
class Usage:
    """What the server did between two readings (the bench's own INFO taken out)."""

    seconds: float
    commands: dict[str, float]
    usec: dict[str, float]
    reads: float
    bytes_in: float
    bytes_out: float
    cpu_s: float

    @property
    def total_commands(self) -> float:
        """Every command run, script calls and the commands inside them included."""
        return sum(self.commands.values())

    @property
    def script_calls(self) -> float:
        """EVALSHA and EVAL calls: each one round trip's worth of Lua."""
        return self.commands.get("evalsha", 0) + self.commands.get("eval", 0)

    def minus(self, rate: Usage, seconds: float) -> Usage:
        """This usage less `rate` (a usage per second) over `seconds`: the background out."""
        names = set(self.commands) | set(rate.commands)
        return Usage(
            seconds=self.seconds,
            commands={
                n: self.commands.get(n, 0) - rate.commands.get(n, 0) * seconds for n in names
            },
            usec={n: self.usec.get(n, 0) - rate.usec.get(n, 0) * seconds for n in names},
            reads=round(self.reads - rate.reads * seconds),
            bytes_in=round(self.bytes_in - rate.bytes_in * seconds),
            bytes_out=round(self.bytes_out - rate.bytes_out * seconds),
            cpu_s=self.cpu_s - rate.cpu_s * seconds,
        )

    def scaled(self, factor: float) -> Usage:
        """Every count times `factor` (per job: 1 / jobs; per second: 1 / seconds)."""
        return Usage(
            seconds=self.seconds * factor,
            commands={n: c * factor for n, c in self.commands.items()},
            usec={n: u * factor for n, u in self.usec.items()},
            reads=self.reads * factor,
            bytes_in=self.bytes_in * factor,
            bytes_out=self.bytes_out * factor,
            cpu_s=self.cpu_s * factor,
        )

    def per_second(self) -> Usage:
        """The usage as a rate."""
        return self.scaled(1.0 / self.seconds)

    def top(self, count: int = 8) -> str:
        """The commands run most, `name count` (Lua's inner calls included)."""
        ranked = sorted(self.commands.items(), key=lambda item: -item[1])[:count]
        return ", ".join(f"{name} {calls:.2f}" for name, calls in ranked if calls >= 0.005)

    def summary(self) -> dict[str, float]:
        """The headline figures (rounded), for the report and --json."""
        return {
            "round_trips": round(self.reads, 2),
            "commands": round(self.total_commands, 2),
            "script_calls": round(self.script_calls, 2),
            "bytes_in": round(self.bytes_in),
            "bytes_out": round(self.bytes_out),
            "redis_cpu_us": round(self.cpu_s * 1e6, 1),
        }


class RedisCounters:
    """Reads a server's counters on one connection of its own."""

    def __init__(self, port: int) -> None:
        self.connection = redis.Connection(host="127.0.0.1", port=port)

    def read(self) -> Counters:
        """One `INFO stats cpu commandstats`, parsed."""
        self.connection.send_command("INFO", "stats", "cpu", "commandstats")
        raw: bytes = self.connection.read_response(disable_decoding=True)
        fields: dict[str, str] = {}
        commands: dict[str, int] = {}
        usec: dict[str, int] = {}
        for line in raw.decode().splitlines():
            key, _, value = line.partition(":")
            if key.startswith("cmdstat_"):
                parts = dict(part.split("=", 1) for part in value.split(","))
                name = key.removeprefix("cmdstat_")
                commands[name], usec[name] = int(parts["calls"]), int(parts["usec"])
            elif value:
                fields[key] = value
        user = fields.get("used_cpu_user_main_thread", fields["used_cpu_user"])
        system = fields.get("used_cpu_sys_main_thread", fields["used_cpu_sys"])
        return Counters(
            at=time.monotonic(),
            commands=commands,
            usec=usec,
            reads=int(fields["total_reads_processed"]),
            bytes_in=int(fields["total_net_input_bytes"]),
            bytes_out=int(fields["total_net_output_bytes"]),
            cpu_s=float(user) + float(system),
            own_reply_bytes=len(raw) + len(f"${len(raw)}\r\n\r\n"),
        )

    def between(self, first: Counters, last: Counters) -> Usage:
        """What the server did from `first` to `last`, less the reading's own INFO."""
        names = set(last.commands)
        commands = {n: last.commands[n] - first.commands.get(n, 0) for n in names}
        commands["info"] = commands.get("info", 0) - 1
        request = len(self.connection.pack_command("INFO", "stats", "cpu", "commandstats")[0])
        return Usage(
            seconds=last.at - first.at,
            commands={n: c for n, c in commands.items() if c},
            usec={n: last.usec[n] - first.usec.get(n, 0) for n in names},
            reads=last.reads - first.reads - 1,
            bytes_in=last.bytes_in - first.bytes_in - request,
            bytes_out=last.bytes_out - first.bytes_out - first.own_reply_bytes,
            cpu_s=last.cpu_s - first.cpu_s,
        )

    def measure(self, action: Callable[[], object]) -> Usage:
        """The server's usage while `action` runs."""
        first = self.read()
        action()
        return self.between(first, self.read())


@dataclass
class Rig:
    """The private Redis, the API and the nodes of one bench run."""

    folder: Path
    step_s: float
    redis_node: RedisNode = field(init=False)
    cluster: Cluster = field(init=False)
    counters: RedisCounters = field(init=False)
    api: ApiProcess | None = None

    def __post_init__(self) -> None:
        binary = redis_binary()
        if binary is None:
            raise SystemExit("no redis-server installed")
        self.redis_node = RedisNode(binary, self.folder / "redis")
        env = {
            **os.environ,
            "KILN_REDIS_URL": f"redis://127.0.0.1:{self.redis_node.port}/0",
            "KILN_REDIS_NAMESPACE": NAMESPACE,
            "KILN_STORAGE_URL": f"file://{self.folder / 'outputs'}",
            "KILN_PIPELINES": json.dumps([PIPELINE]),
            "KILN_TEST_STEP_SECONDS": str(self.step_s),
            "KILN_TEST_COMPLETIONS": str(self.folder / "completions.log"),
            "KILN_METRICS_PORT": "0",
            # autoscaling on, never acted on: its per-node loop runs as deployed
            "KILN_SURPLUS_EXIT": "true",
            "KILN_SURPLUS_GRACE_S": "86400",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        self.cluster = Cluster(env=env, tmp=self.folder)
        self.counters = RedisCounters(self.redis_node.port)

    def start_api(self) -> None:
        """`kiln api` on a free port."""
        self.api = start_api(self.cluster)

    def grow_to(self, nodes: int) -> None:
        """Start nodes until `nodes` run; block until each has sent its heartbeat."""
        started = []
        while len(self.cluster.workers) < nodes:
            started.append(
                self.cluster.start_worker(
                    f"{PIPELINE}={SLEEPY}", extra_args=["--loglevel", "WARNING"], wait=False
                )
            )
        for worker in started:
            worker.wait_ready(timeout_s=600)

    def stop(self) -> None:
        """Stop every process."""
        if self.api is not None:
            self.api.stop()
        self.cluster.stop_all()
        self.redis_node.stop()


@dataclass(frozen=True)
class Calibration:
    """This machine's Redis: main-thread CPU per bare round trip and per pipelined command."""

    round_trip_us: float  # one PING, one reply
    command_us: float  # one GET of a missing key, in pipelines of `CALIBRATION_PIPELINE`


def calibrate(rig: Rig, count: int) -> Calibration:
    """`count` PINGs one by one, then `count` GETs in pipelines; each less the idle background."""
    client = redis.Redis(port=rig.redis_node.port)
    background = rig.counters.measure(lambda: time.sleep(2.0)).per_second()

    def pings() -> None:
        for _ in range(count):
            client.ping()

    def gets() -> None:
        for _ in range(count // CALIBRATION_PIPELINE):
            with client.pipeline(transaction=False) as pipe:
                for _ in range(CALIBRATION_PIPELINE):
                    pipe.get("kiln-capacity-calibration")
                pipe.execute()

    ping = rig.counters.measure(pings)
    ping_us = ping.minus(background, ping.seconds).cpu_s * 1e6 / count
    got = rig.counters.measure(gets)
    rounds = count // CALIBRATION_PIPELINE
    got_us = got.minus(background, got.seconds).cpu_s * 1e6
    command_us = (got_us - rounds * ping_us) / (rounds * CALIBRATION_PIPELINE)
    client.close()
    print(
        f"# calibration: {ping_us:.1f} µs per round trip, {command_us:.2f} µs per pipelined GET",
        flush=True,
    )
    return Calibration(ping_us, command_us)


def write_lines(path: Path, lines: int) -> Path:
    """A batch input of `lines` small lines of the sleepy pipeline."""
    line = {"prompt": "capacity", "width": 64, "height": 64, "steps": 2}
    path.write_text(
        "".join(json.dumps({**line, "custom_id": f"c{n}"}) + "\n" for n in range(lines))
    )
    return path


def submit_batch(rig: Rig, path: Path) -> str:
    """`kiln batch submit` of the file at `path`; the batch id."""
    answer = rig.cluster.run_cli("batch", "submit", str(path), "--pipeline", PIPELINE)
    assert answer.returncode == 0, answer.stderr
    return answer.stdout.strip()


def idle_with_batch(rig: Rig, idle_s: float) -> Usage:
    """The usage per second while one batch is active but paused: every feeder's tick runs.

    Submitted while its queues are paused, so a feeder feeds one window at most (under
    `HELD_LINES`) before the batch is paused too; those jobs run out before the measure, and the
    batch is canceled after it.
    """
    store = rig.cluster.store
    batches = BatchStore(store.redis, store.settings)
    queues = pipeline_queues(PIPELINE)
    for queue in queues:
        store.pause_queue(queue, by="bench_capacity")
    batch_id = submit_batch(rig, write_lines(rig.folder / "held.jsonl", HELD_LINES))
    batches.pause(batch_id)
    for queue in queues:
        store.resume_queue(queue)
    wait_until(
        lambda: batches.get_fed(batch_id).counts,
        lambda counts: counts[JobState.QUEUED] + counts[JobState.RUNNING] == 0,
        timeout_s=600,
        poll_s=0.5,
        what=f"batch {batch_id}: its fed jobs done",
    )
    time.sleep(SETTLE_S)
    rate = rig.counters.measure(lambda: time.sleep(idle_s)).per_second()
    batches.stop_batch(batch_id, "canceled")
    wait_until(
        lambda: batches.get_fed(batch_id),
        lambda batch: batch.final,
        timeout_s=600,
        poll_s=0.5,
        what=f"batch {batch_id} final",
    )
    return rate


def idle_rates(
    rig: Rig, counts: list[int], idle_s: float, with_batch: bool
) -> tuple[dict[int, Usage], dict[int, Usage]]:
    """Usage per second with the API alone (0) and with each count of nodes.

    With no batch, and (`with_batch`) with one paused batch active.
    """
    rates: dict[int, Usage] = {}
    batch_rates: dict[int, Usage] = {}
    for nodes in [0, *counts]:
        rig.grow_to(nodes)
        time.sleep(SETTLE_S)
        rates[nodes] = rig.counters.measure(lambda: time.sleep(idle_s)).per_second()
        print(f"# idle with {nodes} node(s): {rates[nodes].summary()}", flush=True)
        if with_batch and nodes:
            batch_rates[nodes] = idle_with_batch(rig, idle_s)
            print(f"#   a paused batch active: {batch_rates[nodes].summary()}", flush=True)
    if batch_rates:  # no node feeds: the API alone is the same either way
        batch_rates = {0: rates[0], **batch_rates}
    return rates, batch_rates


def submit_jobs(api_url: str, jobs: int, clients: int) -> list[str]:
    """POST `jobs` jobs on `clients` threads; their ids."""
    ids: list[str] = []
    lock = threading.Lock()
    per_client = [jobs // clients + (1 if n < jobs % clients else 0) for n in range(clients)]

    def client(count: int) -> None:
        with httpx.Client(base_url=api_url, timeout=60) as http:
            for _ in range(count):
                body = {"pipeline": PIPELINE, "prompt": "capacity", "width": 64, "height": 64}
                answer = http.post(
                    "/v1/jobs",
                    json={**body, "steps": 2},
                    headers={"Idempotency-Key": uuid.uuid4().hex},
                )
                answer.raise_for_status()
                with lock:
                    ids.append(answer.json()["id"])

    threads = [threading.Thread(target=client, args=(n,)) for n in per_client]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return ids


def completions(rig: Rig) -> int:
    """Jobs the sleepy pipeline finished, from its completions file (no Redis read)."""
    path = rig.cluster.completions
    return len(path.read_text().split()) if path.exists() else 0


def succeeded_total(rig: Rig) -> int:
    """Jobs of the pipeline that reached `succeeded`, from the finished counters (one HGETALL)."""
    counts = finished_counts(rig.cluster.store)
    return sum(
        n
        for (queue, state), n in counts.jobs.items()
        if state == JobState.SUCCEEDED and queue.endswith(f".{PIPELINE}")
    )


@dataclass(frozen=True)
class JobsRun:
    """The jobs phase: per-job usage of the creation and of the run, and the run's pace."""

    create: Usage
    run: Usage
    jobs_per_s: float
    busy: float  # the share of the run's wall time the Redis main thread was on a CPU


def run_jobs(rig: Rig, jobs: int, clients: int, background: Usage) -> JobsRun:
    """Create `jobs` on paused queues, then run them: per-job usage of each, jobs/s."""
    api = rig.api
    assert api is not None
    store = rig.cluster.store
    queues = pipeline_queues(PIPELINE)
    for queue in queues:
        store.pause_queue(queue, by="bench_capacity")
    time.sleep(3.0)  # every node's control poll has stopped consuming them
    done_before, computed_before = succeeded_total(rig), completions(rig)
    created = rig.counters.measure(lambda: submit_jobs(api.url, jobs, clients))
    first = rig.counters.read()
    for queue in queues:
        store.resume_queue(queue)
    # the file first (no Redis read), then the counters: the bench's own reads stay a handful
    wait_until(
        lambda: completions(rig) - computed_before,
        lambda n: n >= jobs,
        timeout_s=1800,
        poll_s=0.2,
        what=f"{jobs} jobs computed",
    )
    wait_until(
        lambda: succeeded_total(rig) - done_before,
        lambda n: n >= jobs,
        timeout_s=120,
        poll_s=0.2,
        what=f"{jobs} jobs succeeded",
    )
    ran = rig.counters.between(first, rig.counters.read())
    jobs_per_s = jobs / ran.seconds
    per_job_create = created.minus(background, created.seconds).scaled(1.0 / jobs)
    per_job_run = ran.minus(background, ran.seconds).scaled(1.0 / jobs)
    print(f"# created {jobs} in {created.seconds:.1f} s, ran them in {ran.seconds:.1f} s")
    busy = ran.cpu_s / ran.seconds
    print(f"# Redis main thread busy {busy:.1%} of the run", flush=True)
    return JobsRun(per_job_create, per_job_run, jobs_per_s, busy)


def run_batch(rig: Rig, lines: int, background: Usage) -> tuple[Usage, float]:
    """Submit a batch of `lines` with the CLI and run it: (per-line usage, lines/s)."""
    path = write_lines(rig.folder / "capacity.jsonl", lines)
    batches = BatchStore(rig.cluster.store.redis, rig.cluster.store.settings)
    batch_id = ""
    computed_before = completions(rig)

    def submit_and_finish() -> None:
        nonlocal batch_id
        batch_id = submit_batch(rig, path)
        wait_until(
            lambda: completions(rig) - computed_before,
            lambda n: n >= lines,
            timeout_s=1800,
            poll_s=0.2,
            what=f"{lines} batch lines computed",
        )
        wait_until(
            lambda: batches.get_fed(batch_id),
            lambda batch: batch.final,
            timeout_s=120,
            poll_s=0.2,
            what=f"batch {batch_id}",
        )

    used = rig.counters.measure(submit_and_finish)
    batch = batches.get_fed(batch_id)
    assert batch.counts[JobState.SUCCEEDED] == lines, batch.counts
    print(f"# batch of {lines} lines done in {used.seconds:.1f} s", flush=True)
    return used.minus(background, used.seconds).scaled(1.0 / lines), lines / used.seconds


def per_node(rates: dict[int, Usage]) -> dict[int, Usage]:
    """What each node adds at idle: (rate with n nodes - rate with the API alone) / n."""
    api = rates[0]
    return {n: rate.minus(api, 1.0).scaled(1.0 / n) for n, rate in rates.items() if n > 0}


def command_calls(usage: Usage, name: str) -> float:
    """Calls of the command `name` in `usage`."""
    return usage.commands.get(name, 0)


def command_usec(usage: Usage, name: str) -> float:
    """Microseconds the command `name` took in `usage`."""
    return usage.usec.get(name, 0)


def slope(rates: dict[int, Usage]) -> Usage:
    """The least-squares cost of one more node over every count measured (0 included)."""
    counts = sorted(rates)
    mean_n = sum(counts) / len(counts)
    spread = sum((n - mean_n) ** 2 for n in counts)
    weights = {n: (n - mean_n) / spread for n in counts}
    names = {name for rate in rates.values() for name in rate.commands}

    def fit(value: Callable[[Usage], float]) -> float:
        return sum(w * value(rates[n]) for n, w in weights.items())

    return Usage(
        seconds=1.0,
        commands={name: fit(functools.partial(command_calls, name=name)) for name in names},
        usec={name: fit(functools.partial(command_usec, name=name)) for name in names},
        reads=fit(lambda u: u.reads),
        bytes_in=fit(lambda u: u.bytes_in),
        bytes_out=fit(lambda u: u.bytes_out),
        cpu_s=fit(lambda u: u.cpu_s),
    )


def print_idle(title: str, rates: dict[int, Usage]) -> tuple[dict[int, Usage], Usage]:
    """Print one idle table; returns the per-node usage by node count, and the fitted slope."""
    nodes = per_node(rates)
    fitted = slope(rates)
    print(f"\n## Idle, per second: {title}")
    print(
        "| nodes | round trips/s | commands/s | bytes in+out/s | Redis CPU µs/s | per node: "
        "round trips/s, commands/s, bytes in+out/s, CPU µs/s |"
    )
    print("|---|---|---|---|---|---|")

    def per(each: dict[str, float]) -> str:
        return (
            f"{each['round_trips']}, {each['commands']}, "
            f"{each['bytes_in'] + each['bytes_out']}, {each['redis_cpu_us']}"
        )

    for n, rate in rates.items():
        whole = rate.summary()
        print(
            f"| {n} | {whole['round_trips']} | {whole['commands']} | "
            f"{whole['bytes_in'] + whole['bytes_out']} | {whole['redis_cpu_us']} "
            f"| {per(nodes[n].summary()) if n else '(the API alone)'} |"
        )
    print(f"| fit | | | | | {per(fitted.summary())} |")
    for n, usage in nodes.items():
        print(f"per node at {n} nodes, by command: {usage.top(16)}")
    print(f"per node (fit), by command: {fitted.top(16)}")
    print_growth(rates)
    return nodes, fitted


def quadratic(rates: dict[int, Usage], value: Callable[[Usage], float]) -> tuple[float, ...]:
    """(a, b, c) of `value` less the API alone = a + b·n + c·n², over the counts n ≥ 1."""
    counts = sorted(n for n in rates if n > 0)
    base = value(rates[0])
    terms = numpy.array([[1.0, n, n * n] for n in counts])
    values = numpy.array([value(rates[n]) - base for n in counts])
    solution = numpy.linalg.lstsq(terms, values, rcond=None)[0]
    return tuple(float(x) for x in solution)


def print_growth(rates: dict[int, Usage]) -> None:
    """The check for loops costing more than linearly: the n² term of each figure.

    A per-node loop that reads something per node (every heartbeat, every held list) costs the
    cluster n × n: its total has an n² term that a fixed per-node cost (b) or a cost shared by
    the cluster (a) has not.
    """
    if len([n for n in rates if n > 0]) < 3:
        print("n² check: needs three node counts or more")
        return
    figures: dict[str, Callable[[Usage], float]] = {
        "round trips/s": lambda u: u.reads,
        "commands/s": lambda u: u.total_commands,
        "bytes out/s": lambda u: u.bytes_out,
        "bytes in/s": lambda u: u.bytes_in,
    }
    names = sorted({name for rate in rates.values() for name in rate.commands})
    for name in names:
        figures[name] = functools.partial(command_calls, name=name)
    fits = {label: quadratic(rates, value) for label, value in figures.items()}
    print("n² check (total less the API alone = a + b·n + c·n², n = node count):")
    for label, (a, b, c) in fits.items():
        if label in names and abs(c) < 0.05:
            continue  # a command whose calls do not grow with n²
        print(f"  {label}: a = {a:.2f}, b = {b:.2f}, c = {c:.3f}")


def report(
    options: argparse.Namespace,
    calibration: Calibration,
    rates: dict[int, Usage],
    batch_rates: dict[int, Usage],
    jobs: JobsRun,
    line: Usage,
    lines_per_s: float,
) -> dict[str, object]:
    """Print the figures and the arithmetic; returns them for --json."""
    nodes, fitted = print_idle("no batch", rates)
    if batch_rates:
        batch_nodes, batch_fitted = print_idle("one paused batch active", batch_rates)
    largest = max(nodes)
    create, run = jobs.create, jobs.run
    figures = {
        "job: creation (API)": create.summary(),
        "job: run (node)": run.summary(),
        "batch line (submit, feed, run, results)": line.summary(),
    }
    print("\n## Per job and per batch line (idle background taken out)")
    print(
        "| | round trips | commands (Lua's included) | script calls | bytes in | bytes out "
        "| Redis CPU µs |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, each in figures.items():
        print(
            f"| {name} | {each['round_trips']} | {each['commands']} | "
            f"{each['script_calls']} | {each['bytes_in']} | {each['bytes_out']} | "
            f"{each['redis_cpu_us']} |"
        )
    print(f"\ncreation by command: {create.top(16)}")
    print(f"run by command: {run.top(16)}")
    print(f"batch line by command: {line.top(16)}")
    job_cpu_s = create.cpu_s + run.cpu_s
    node_cpu_s = fitted.cpu_s
    bind = 1.0 / job_cpu_s
    print("\n## Where one Redis binds")
    print(
        f"this machine's Redis: {calibration.round_trip_us:.1f} µs of main-thread CPU per bare "
        f"round trip (PING), {calibration.command_us:.2f} µs per GET in pipelines of "
        f"{CALIBRATION_PIPELINE}"
    )
    print(
        f"measured: {jobs.jobs_per_s:.1f} jobs/s with {largest} nodes (their own CPU binds on "
        f"this machine), {lines_per_s:.1f} batch lines/s"
    )
    print(
        f"Redis main thread busy {jobs.busy:.1%} during the run: "
        f"{jobs.jobs_per_s:.1f} / {jobs.busy:.3f} = {jobs.jobs_per_s / jobs.busy:.0f} jobs/s "
        "at 100% (the run alone, creation elsewhere)"
    )
    print(
        f"one job = {create.cpu_s * 1e6:.0f} + {run.cpu_s * 1e6:.0f} = {job_cpu_s * 1e6:.0f} µs "
        f"of Redis main-thread CPU; one core: 1 s / {job_cpu_s * 1e6:.0f} µs = {bind:.0f} jobs/s"
    )
    names = set(create.commands) | set(run.commands)
    job = Usage(
        seconds=1.0,
        commands={n: create.commands.get(n, 0) + run.commands.get(n, 0) for n in names},
        usec={},
        reads=create.reads + run.reads,
        bytes_in=create.bytes_in + run.bytes_in,
        bytes_out=create.bytes_out + run.bytes_out,
        cpu_s=create.cpu_s + run.cpu_s,
    )
    for name, usage in (("one job", job), ("one idle node, per s", fitted)):
        modelled = (
            usage.reads * calibration.round_trip_us
            + (usage.total_commands - usage.reads) * calibration.command_us
        )
        print(
            f"by the calibration, {name}: {usage.reads:.2f} round trips × "
            f"{calibration.round_trip_us:.1f} µs + {usage.total_commands - usage.reads:.1f} more "
            f"commands × {calibration.command_us:.2f} µs = {modelled:.0f} µs "
            f"(measured {usage.cpu_s * 1e6:.0f} µs)"
        )
    line_us = line.cpu_s * 1e6
    print(
        f"one batch line = {line_us:.0f} µs; one core: "
        f"1 s / {line_us:.0f} µs = {1e6 / line_us:.0f} lines/s"
    )
    for fleet in (10, 100, 1000):
        used = fleet * node_cpu_s
        left = max(1.0 - used, 0.0)
        print(
            f"{fleet} idle nodes: {fleet} × {node_cpu_s * 1e6:.0f} µs/s = {used:.1%} of the core; "
            f"left: (1 - {used:.3f}) / {job_cpu_s * 1e6:.0f} µs = {left / job_cpu_s:.0f} jobs/s; "
            f"{fleet * fitted.reads:.0f} round trips/s, "
            f"{fleet * (fitted.bytes_in + fitted.bytes_out) / 1e6:.2f} MB/s"
        )
    if batch_rates:
        extra = batch_fitted.minus(fitted, 1.0)
        print(
            f"an active batch adds per node: {extra.reads:.2f} round trips/s, "
            f"{extra.total_commands:.2f} commands/s, "
            f"{extra.bytes_in + extra.bytes_out:.0f} bytes/s, {extra.cpu_s * 1e6:.0f} µs/s"
        )
    if len(batch_rates) >= 4:  # the API alone and three node counts
        gets = quadratic(batch_rates, functools.partial(command_calls, name="get"))[2]
        out = quadratic(batch_rates, lambda u: u.bytes_out)[2]
        for fleet in (10, 100, 1000):
            print(
                f"{fleet} nodes, a batch active, the n² part alone: GET {gets:.2f} × {fleet}² = "
                f"{gets * fleet**2:.0f}/s, bytes out {out:.0f} × {fleet}² = "
                f"{out * fleet**2 / 1e6:.2f} MB/s"
            )
    return {
        "command": vars(options),
        "calibration": {
            "round_trip_us": round(calibration.round_trip_us, 2),
            "pipelined_command_us": round(calibration.command_us, 3),
        },
        "idle": {str(n): rate.summary() for n, rate in rates.items()},
        "idle_per_node": {str(n): u.summary() for n, u in nodes.items()},
        "idle_per_node_fit": fitted.summary(),
        "idle_per_node_commands": {str(n): u.commands for n, u in nodes.items()},
        "batch_idle": {str(n): rate.summary() for n, rate in batch_rates.items()},
        "batch_idle_per_node": (
            {str(n): u.summary() for n, u in batch_nodes.items()} if batch_rates else {}
        ),
        "batch_idle_per_node_commands": (
            {str(n): u.commands for n, u in batch_nodes.items()} if batch_rates else {}
        ),
        "per_job_and_line": figures,
        "jobs_per_s_measured": round(jobs.jobs_per_s, 2),
        "redis_busy_during_run": round(jobs.busy, 4),
        "lines_per_s_measured": round(lines_per_s, 2),
        "jobs_per_s_one_core": round(bind),
    }


def main() -> None:
    """Run the phases on one rig; print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-nodes", default="1,2,4", help="node counts measured at idle")
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--lines", type=int, default=400)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--step-s", type=float, default=0.05, help="the pipeline's sleep per step")
    parser.add_argument("--calibrate", type=int, default=20000, help="PINGs (and GETs) timed")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--idle-only", action="store_true", help="the idle phase alone")
    parser.add_argument(
        "--no-batch-idle", action="store_true", help="skip the idle phase with a paused batch"
    )
    options = parser.parse_args()
    counts = sorted({int(n) for n in options.idle_nodes.split(",")})
    with tempfile.TemporaryDirectory(prefix="kiln-capacity-") as folder:
        rig = Rig(Path(folder), options.step_s)
        try:
            rig.start_api()
            calibration = calibrate(rig, options.calibrate)
            rates, batch_rates = idle_rates(rig, counts, options.idle_s, not options.no_batch_idle)
            if options.idle_only:
                print_idle("no batch", rates)
                if batch_rates:
                    print_idle("one paused batch active", batch_rates)
                return
            background = rates[max(counts)]
            jobs = run_jobs(rig, options.jobs, options.clients, background)
            line, lines_per_s = run_batch(rig, options.lines, background)
        finally:
            rig.stop()
    figures = report(options, calibration, rates, batch_rates, jobs, line, lines_per_s)
    if options.json:
        options.json.write_text(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()
