"""Previews and outputs as they happen, end to end: a real node, real Redis, moto S3, the API."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from kiln.tasks.api.app import create_app
from kiln.tasks.client.client import KilnClient
from kiln.tasks.contract.views import EventView, PreviewEvent
from tests.e2e.cluster import Cluster
from tests.tasks.helpers import ThreadServer, api_settings

pytestmark = pytest.mark.timeout(600)

PAINTED = "python:tests.e2e.painted_pipelines:painted"
STEP_S = 0.1  # the painted pipeline's sleep per step
PAINTED_STEPS = 50  # its most: 5 s of run


@pytest.fixture(scope="module")
def cluster(module_cluster_factory: Callable[..., Cluster]) -> Cluster:
    made = module_cluster_factory()
    # `painted` sleeps STEP_S a step: the disconnect test's job runs for as long as it says on
    # any machine, so its client's first read finds it running (Redis keeps only the newest
    # preview of a job that ended), however loaded the machine is. Tiny runs at its own pace.
    made.start_worker(
        "tiny",
        f"painted={PAINTED}",
        devices="cpu:1",
        extra_env={"KILN_TEST_STEP_SECONDS": str(STEP_S)},
    )
    return made


@pytest.fixture(scope="module")
def api_url(cluster: Cluster) -> Iterator[str]:
    """An in-process API (auth off) in front of the cluster."""
    app = create_app(api_settings(auth_enabled=False), cluster.storage_settings)
    with ThreadServer(app) as api:
        yield api.url


def sse_events(
    url: str, job_id: str, last_event_id: int, stop_at_preview: bool = False
) -> list[dict[str, Any]]:
    """Raw SSE: events after `last_event_id`, until the terminal one (or the first preview)."""
    events: list[dict[str, Any]] = []
    headers = {"Last-Event-ID": str(last_event_id), "Accept": "text/event-stream"}
    timeout = httpx.Timeout(10.0, read=60.0)
    with httpx.stream(
        "GET", f"{url}/v1/jobs/{job_id}/events", headers=headers, timeout=timeout
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:") :])
            events.append(event)
            if event["type"] in {"succeeded", "failed", "canceled", "expired"}:
                break
            if stop_at_preview and event["type"] == "preview":
                break  # the client goes away mid-job
    return events


def test_previews_arrive_in_order_and_resume_after_a_disconnect(
    cluster: Cluster, api_url: str
) -> None:
    job_id = cluster.submit(
        pipeline="painted",
        prompt="a kiln",
        width=64,
        height=64,
        steps=PAINTED_STEPS,  # PAINTED_STEPS * STEP_S of run: the first read finds it running
        preview={"every_steps": 2, "max_side": 64},
    )
    # read up to the first preview on one connection (a connection per event fell behind the
    # job's events on a loaded machine and met its first preview at its last step), then drop it
    first = sse_events(api_url, job_id, 0, stop_at_preview=True)
    assert first[-1]["type"] == "preview", [e["type"] for e in first]
    cut = first[-1]["seq"]
    rest = sse_events(api_url, job_id, cut)
    seqs = [e["seq"] for e in first + rest]
    assert seqs == sorted(seqs)
    assert len(set(seqs)) == len(seqs)
    assert all(e["seq"] > cut for e in rest)
    assert rest[-1]["type"] == "succeeded"
    steps = [e["payload"]["step"] for e in first + rest if e["type"] == "preview"]
    assert len(steps) >= 2
    assert steps == sorted(steps)
    assert len(set(steps)) == len(steps)
    assert all(step % 2 == 0 for step in steps)
    for event in first + rest:
        if event["type"] == "preview":
            payload = event["payload"]
            assert (payload["format"], payload["content_type"]) == ("webp", "image/webp")
            assert payload["url"] is None
            assert payload["total"] == PAINTED_STEPS
            image = Image.open(io.BytesIO(base64.b64decode(payload["image_b64"])))
            assert image.size == (payload["width"], payload["height"]) == (64, 64)
    # Redis holds one preview of the job, the newest
    raw = cluster.store.redis.xrange(cluster.store.keys.events(job_id))
    kept = [fields for _, fields in raw if fields["type"] == "preview"]
    assert len(kept) == 1
    assert json.loads(kept[0]["payload"])["step"] == max(steps)


def test_outputs_are_announced_before_the_end_and_the_client_gets_preview_bytes(
    api_url: str,
) -> None:
    with KilnClient(api_url) as client:
        view = client.submit(
            {
                "pipeline": "tiny",
                "prompt": "three kilns",
                "width": 64,
                "height": 64,
                "steps": 4,
                "num_outputs": 3,
                "preview": {"every_steps": 1, "format": "png"},
            }
        )
        events: list[EventView] = list(client.events(view.id))
        final = client.get(view.id)
    types = [e.type for e in events]
    assert types[-1] == "succeeded"
    outputs = [e for e in events if e.type == "output"]
    assert [e.payload["index"] for e in outputs] == [0, 1, 2]
    assert types.index("output") < types.index("succeeded")
    # the last output's event comes before the terminal one, and it is what the view names
    assert [o.payload["sha256"] for o in outputs] == [o.sha256 for o in final.outputs]
    assert [o.payload["key"] for o in outputs] == [o.key for o in final.outputs]
    for event in outputs:
        data = httpx.get(event.payload["url"], timeout=10).content
        assert hashlib.sha256(data).hexdigest() == event.payload["sha256"]
        assert len(data) == event.payload["bytes"]
    previews = [e for e in events if isinstance(e, PreviewEvent)]
    assert previews, types
    for preview in previews:
        assert Image.open(io.BytesIO(preview.image)).format == "PNG"
        assert preview.preview.step <= preview.preview.total == 4


def test_kiln_submit_keeps_the_newest_preview_file(cluster: Cluster, tmp_path: Path) -> None:
    folder = tmp_path / "previews"
    result = cluster.run_cli(
        "submit",
        "a kiln at dusk",
        "--pipeline",
        "tiny",
        "--width",
        "64",
        "--height",
        "64",
        "--steps",
        "6",
        "--preview",
        str(folder),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    files = list(folder.iterdir())
    assert [file.suffix for file in files] == [".webp"]
    with Image.open(files[0]) as image:
        assert image.size == (8, 8)
