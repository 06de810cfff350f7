"""`kiln demo`: the whole path on the embedded default, on this machine, in about a minute.

An embedded Redis (unless KILN_REDIS_URL is set), outputs in the absolute KILN_STORAGE_URL (by
default `<data home>/outputs`, the same folder from wherever it runs), a node worker with the
tiny pipelines on two CPU ranks, the HTTP API with auth switched off, a handful of image and video
jobs submitted through the Python client with progress bars, then a table of where everything is.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from kiln.common.request import VideoFormat
from kiln.common.states import JobState
from kiln.storage.base import require_supported_redis
from kiln.storage.settings import StorageSettings
from kiln.tasks.cli.backends import HttpBackend
from kiln.tasks.cli.embedded import (
    ChildWatch,
    DemoFailed,
    child_env,
    child_process,
    embedded_redis,
    free_port,
    kiln_command,
)
from kiln.tasks.cli.previews import follow_previews
from kiln.tasks.cli.progress import wait_for_jobs
from kiln.tasks.cli.tables import fitting_table
from kiln.tasks.contract.schemas import JobRequest, PreviewRequest
from kiln.tasks.contract.views import JobView

PROMPTS = [
    "a lighthouse at dusk, oil painting",
    "a bowl of ramen, studio photo",
    "a red fox in fresh snow",
    "isometric city block, pastel colours",
    "a sailing ship in a storm",
    "a cat astronaut, watercolour",
]
VIDEO_JOBS: tuple[tuple[str, VideoFormat], ...] = (
    ("waves rolling onto a beach", "mp4"),
    ("a spinning top", "gif"),
)
NODE_START_TIMEOUT_S = 180.0


def demo_requests(image_jobs: int) -> list[JobRequest]:
    """A few images on the default (tiny) pipeline and two short videos."""
    images = [
        JobRequest(
            pipeline="default",
            prompt=PROMPTS[i % len(PROMPTS)],
            width=128,
            height=128,
            steps=8,
            seed=1000 + i,
            num_outputs=1 + i % 2,
            output_format="png",
            preview=PreviewRequest(every_steps=2),  # kept in .kiln/previews/ as they come
        )
        for i in range(image_jobs)
    ]
    videos = [
        JobRequest(
            pipeline="tiny-video",
            prompt=prompt,
            width=64,
            height=64,
            num_frames=9,
            fps=8,
            steps=4,
            seed=7,
            output_format=fmt,
        )
        for prompt, fmt in VIDEO_JOBS
    ]
    return images + videos


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    """KILN_REDIS_URL if the user set one, else an embedded Redis for the demo's lifetime."""
    if os.environ.get("KILN_REDIS_URL"):
        yield os.environ["KILN_REDIS_URL"]
        return
    with embedded_redis() as url:
        yield url


def run_demo(image_jobs: int = 4) -> int:
    """Run the demo; returns 0 when every job succeeded."""
    # A pipe or CI log has no width; rich would squeeze the table to 80 columns.
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 100)
    # one absolute location, resolved here and handed to both children (a relative one is refused)
    storage_url = StorageSettings().storage_url
    console.print(
        "[bold yellow]kiln demo: API auth is OFF (KILN_AUTH_ENABLED=false) — local use only[/]"
    )
    with redis_url() as url:
        namespace = os.environ.get("KILN_REDIS_NAMESPACE", "kiln-demo")
        env = child_env(
            KILN_REDIS_URL=url,
            KILN_STORAGE_URL=storage_url,
            KILN_AUTH_ENABLED="false",
            KILN_REDIS_NAMESPACE=namespace,
        )
        logs = Path(".kiln")
        logs.mkdir(exist_ok=True)
        used = StorageSettings(redis_url=url, redis_namespace=namespace, storage_url=storage_url)
        require_supported_redis(used)  # (KILN_REDIS_URL may name any Redis)
        console.print(f"kiln demo: {used.describe()}   logs: {logs.resolve()}", highlight=False)
        finals, elapsed = _run_jobs(env, logs, console, image_jobs)
    console.print(results_table(finals))
    for line in output_lines(finals):
        console.print(line, soft_wrap=True, highlight=False)
    ok = sum(v.status == JobState.SUCCEEDED for v in finals)
    console.print(
        f"{ok}/{len(finals)} jobs succeeded in {elapsed:.1f}s; outputs under {storage_url}"
    )
    return 0 if ok == len(finals) else 1


def _run_jobs(
    env: dict[str, str], logs: Path, console: Console, image_jobs: int
) -> tuple[list[JobView], float]:
    """Start a node worker and the API, submit the demo's jobs, wait; the views and the time."""
    port = free_port()
    worker_args = kiln_command(
        "worker",
        "--pipeline",
        "default=tiny",
        "--pipeline",
        "tiny-video",
        "--devices",
        "cpu:2",
        "--loglevel",
        "WARNING",
    )
    api_url = f"http://127.0.0.1:{port}"
    with (
        child_process(worker_args, env=env, log_path=logs / "worker.log") as worker,
        child_process(
            kiln_command("api", "--port", str(port)), env=env, log_path=logs / "api.log"
        ) as api,
        contextlib.closing(HttpBackend(api_url, None)) as backend,
    ):
        children = ChildWatch(
            {"worker": (worker, logs / "worker.log"), "api": (api, logs / "api.log")}
        )
        _wait_for_node(api_url, console, children)
        started = time.monotonic()
        views = [backend.submit(request) for request in demo_requests(image_jobs)]
        console.print(f"submitted {len(views)} jobs through the API")
        previews: list[Path] = []
        with_previews = [v.id for v in views if v.parameters.preview is not None]
        followers = follow_previews(
            backend, with_previews, logs / "previews", lambda _j, path, _s: previews.append(path)
        )
        finals = wait_for_jobs(
            backend, [v.id for v in views], timeout_s=300, console=console, check=children.check
        )
        for follower in followers:
            follower.join(timeout=5)  # its job ended: its stream ends at the terminal event
        console.print(
            f"{len(previews)} previews written while denoising; the newest of each job in "
            f"{(logs / 'previews').resolve()}",
            highlight=False,
        )
        return finals, time.monotonic() - started


def _wait_for_node(api_url: str, console: Console, children: ChildWatch) -> None:
    console.print("starting the node (spawning 2 CPU ranks, building the tiny pipelines once)…")
    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        children.check()  # a dead worker or API ends the wait at once, with its last lines
        # /readyz: Redis reachable and a live node serving pipelines (from its heartbeat).
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if httpx.get(f"{api_url}/readyz", timeout=5).json().get("ready"):
                return
        time.sleep(0.25)
    raise DemoFailed(
        f"the demo worker did not come up within {NODE_START_TIMEOUT_S:.0f} s; see .kiln/worker.log"
    )


def results_table(views: list[JobView]) -> Table:
    """The demo's final table: one row per job, its timings and output count."""
    # a unique prefix of each id (any command takes it) and whole states; timings wrap if need be
    columns = ("job", "pipeline", "status", "queue s", "run s", "encode s", "upload s", "outs")
    table = fitting_table(*columns, whole=("job", "status"))
    table.title = "kiln demo — jobs"
    for view in views:
        m = view.metrics
        timings = (m.queue_s, m.run_s, m.encode_s, m.upload_s)
        table.add_row(
            view.id[:12],
            view.parameters.pipeline,
            view.status,
            *(f"{v:.3f}" if v is not None else "-" for v in timings),
            str(len(view.outputs)),
        )
    return table


def output_lines(views: list[JobView]) -> list[str]:
    """Where each output is (or why a job has none), one line each, paths relative when local."""
    lines = []
    for view in views:
        for output in view.outputs:
            location = output.url.removeprefix("file://")
            with contextlib.suppress(ValueError):
                location = str(Path(location).relative_to(Path.cwd()))
            lines.append(f"{view.id[:12]}  {output.content_type:<10}  {location}")
        if view.error is not None:
            lines.append(f"{view.id[:12]}  {view.status}: {view.error.message}")
    return lines
