"""Large previews and batch lines' outputs, end to end: a real node, real Redis, moto S3, the API.

The node decodes previews with a tiny autoencoder (`KILN_PREVIEW_VAE`, random weights): full-size
pixels, so a full-size PNG preview (`SIDE` pixels a side) is far over the inline limit and goes to
the object store.
Once the job has ended no preview object is left, and Redis kept its newest preview only. A batch
whose lines ask for several outputs gets each line's outputs announced on that line's job stream
as the line finishes: before the line's own end, before a later line's, before the batch's.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from kiln.common.previews import PREVIEW_INLINE_MAX
from kiln.storage.records import JobEvent
from kiln.tasks.api.app import create_app
from kiln.tasks.batches.intake import batch_job_id
from kiln.tasks.client.client import KilnClient
from kiln.tasks.contract.views import PreviewEvent
from tests.e2e.cluster import Cluster
from tests.tasks.helpers import ThreadServer, api_settings
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(600)

# The large previews' side: their PNGs are ~112 KiB, 1.7 times PREVIEW_INLINE_MAX (the test
# asserts each is over it). At 512 pixels the tiny UNet's self-attention over 64x64 latents took
# ~1 s a step on this CPU; at 320 (40x40 latents) ~0.1 s.
SIDE = 320

NODE_ENV = {
    "KILN_BATCH_FEED_INTERVAL_S": "0.1",
    "KILN_BATCH_RESULTS_FLUSH_S": "0.5",
    "KILN_BATCH_ITEM_RETENTION_S": "600",  # the lines' job events stay readable after the batch
}


def tiny_autoencoder(folder: Path) -> Path:
    """A random diffusers AutoencoderTiny for 4-channel latents (the tiny pipeline's), saved."""
    import torch
    from diffusers import AutoencoderTiny

    torch.manual_seed(0)
    vae = AutoencoderTiny(
        encoder_block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        num_encoder_blocks=(1, 1, 1, 1),
        num_decoder_blocks=(1, 1, 1, 1),
        latent_channels=4,
    )
    vae.save_pretrained(folder)  # type: ignore[attr-defined]
    return folder


@pytest.fixture(scope="module")
def cluster(
    module_cluster_factory: Callable[..., Cluster], tmp_path_factory: pytest.TempPathFactory
) -> Cluster:
    made = module_cluster_factory()
    taesd = tiny_autoencoder(tmp_path_factory.mktemp("taesd"))
    made.start_worker(
        "tiny", devices="cpu:1", extra_env={**NODE_ENV, "KILN_PREVIEW_VAE": str(taesd)}
    )
    return made


@pytest.fixture(scope="module")
def api_url(cluster: Cluster) -> Iterator[str]:
    """An in-process API (auth off) in front of the cluster."""
    app = create_app(api_settings(auth_enabled=False), cluster.storage_settings)
    with ThreadServer(app) as api:
        yield api.url


def job_keys(cluster: Cluster, job_id: str) -> list[str]:
    """Every object under the job's folder: its attempts' outputs and its preview."""
    prefix = cluster.objects.prefix
    return list(cluster.objects.list_keys(f"{prefix}/{job_id}" if prefix else job_id))


def test_large_previews_go_by_url_and_no_preview_object_outlives_the_job(
    cluster: Cluster, api_url: str
) -> None:
    with KilnClient(api_url) as client:
        view = client.submit(
            {
                "pipeline": "tiny",
                "prompt": "a kiln, full size",
                "width": SIDE,
                "height": SIDE,
                "steps": 12,
                "preview": {"every_steps": 1, "max_side": SIDE, "format": "png"},
            }
        )
        events = list(client.events(view.id))
        final = client.get(view.id)
    assert events[-1].type == "succeeded"
    previews = [e for e in events if isinstance(e, PreviewEvent)]
    assert previews, [e.type for e in events]  # fetched by URL while the job ran
    for preview in previews:
        assert preview.preview.url is not None
        assert preview.preview.image_b64 is None
        assert len(preview.image) > PREVIEW_INLINE_MAX
        with Image.open(io.BytesIO(preview.image)) as image:
            assert (image.format, image.size) == ("PNG", (SIDE, SIDE))
    # Redis kept the newest preview only, by URL
    kept = [e for e in cluster.store.events(view.id) if e.type == "preview"]
    assert len(kept) == 1
    assert kept[0].payload["url"] is not None
    assert kept[0].payload["step"] == 12
    # once the attempt is over its preview object goes; the outputs stay
    outputs = sorted(output.key for output in final.outputs)
    wait_until(
        lambda: job_keys(cluster, view.id),
        lambda keys: keys == outputs,
        what="only the job's outputs under its folder",
    )
    assert httpx.get(kept[0].payload["url"], timeout=10).status_code == 404


def line_events(cluster: Cluster, job_id: str) -> list[JobEvent]:
    return cluster.store.events(job_id, count=1000)


def test_each_batch_line_announces_its_outputs_as_it_finishes(
    cluster: Cluster, api_url: str
) -> None:
    # Different steps: the lines cannot share a forward, so one finishes before the other runs.
    lines = [
        {"custom_id": "quick", "prompt": "a", "width": 64, "height": 64, "steps": 2},
        {"custom_id": "slow", "prompt": "b", "width": 64, "height": 64, "steps": 30},
    ]
    body = b"".join(json.dumps({**line, "num_outputs": 2}).encode() + b"\n" for line in lines)
    submitted = httpx.post(
        f"{api_url}/v1/batches",
        content=body,
        params={"pipeline": "tiny"},
        headers={"Content-Type": "application/x-ndjson"},
        timeout=60,
    )
    assert submitted.status_code == 201, submitted.text
    batch_id = submitted.json()["id"]
    batch = wait_until(
        lambda: httpx.get(f"{api_url}/v1/batches/{batch_id}", timeout=10).json(),
        lambda view: view["status"] == "completed",
        what="the batch completed",
    )
    assert batch["outcome"] == "succeeded", batch
    results = httpx.get(f"{api_url}/v1/batches/{batch_id}/results", timeout=30).text
    by_line = {
        entry["custom_id"]: entry
        for entry in map(json.loads, results.splitlines())
        if entry["type"] == "result"
    }
    announced: dict[str, list[JobEvent]] = {}
    ended: dict[str, float] = {}
    for line in lines:
        custom_id = str(line["custom_id"])
        events = line_events(cluster, batch_job_id(batch_id, custom_id))
        types = [e.type for e in events]
        assert types[-1] == "succeeded", types
        outputs = [e for e in events if e.type == "output"]
        # each output of the line, in order, announced before the line's own end (the last)
        assert [e.payload["index"] for e in outputs] == [0, 1], types
        result_outputs = by_line[custom_id]["outputs"]
        assert [e.payload["sha256"] for e in outputs] == [o["sha256"] for o in result_outputs]
        for event in outputs:
            data = httpx.get(event.payload["url"], timeout=10).content
            assert hashlib.sha256(data).hexdigest() == event.payload["sha256"]
            assert len(data) == event.payload["bytes"]
        announced[custom_id], ended[custom_id] = outputs, events[-1].time
    # The line that finished first announced its outputs before the other line ended: each line
    # is announced as it finishes, not once the batch's last line has.
    first, second = sorted(ended, key=ended.__getitem__)
    assert max(e.time for e in announced[first]) < ended[second]
    # and every announcement precedes the batch's end
    finished_at = float(batch["finished_at"])
    assert all(e.time <= finished_at for outputs in announced.values() for e in outputs)
