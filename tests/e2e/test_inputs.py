"""Pipeline inputs end to end: a real node announces the schema, the API validates against it.

A job's scheduler input changes what the ranks compute, as that scheduler would. Image inputs:
img2img and inpainting with an uploaded image (a presigned PUT to moto) and with a URL served on
127.0.0.1 (allow-listed for the API and the node).

Real worker subprocess (tiny, one CPU rank), real Redis, moto S3, a real uvicorn API.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.tasks.api.app import create_app
from kiln.tasks.api.context import build_context
from kiln.tasks.client.client import KilnClient, ValidationFailed
from kiln.tasks.contract.schemas import InputScalar, JobRequest
from kiln.tasks.contract.views import JobView
from tests.e2e.cluster import Cluster
from tests.e2e.image_server import CAT, image_server
from tests.e2e.tiny_jobs import PIXEL_TOLERANCE, TINY_JOB, computed_here, stored_pixels
from tests.tasks.helpers import Api, ThreadServer, api_settings

pytestmark = pytest.mark.timeout(600)

JOB: dict[str, Any] = {**TINY_JOB, "steps": 4}
IMAGE_PIPELINES = ["tiny-img2img", "tiny-inpaint"]
ALLOW = {"KILN_INPUT_ALLOW_HTTP": "true", "KILN_INPUT_ALLOW_HOSTS": "127.0.0.1"}
IMAGE_JOB: dict[str, Any] = {
    **{name: value for name, value in JOB.items() if name != "pipeline"},
    "prompt": "a kiln at dawn",
    "seed": 7,
}


@pytest.fixture(scope="module")
def cluster(module_cluster_factory: Callable[..., Cluster]) -> Cluster:
    made = module_cluster_factory()
    # One worker for the scheduler and the image-input tests: the image pipelines share its start.
    made.start_worker("tiny", *IMAGE_PIPELINES, devices="cpu:1", extra_env=ALLOW)
    return made


def reference(scheduler: str) -> np.ndarray:
    """The job computed here, in this process, by a tiny pipeline whose scheduler is `scheduler`."""

    def use_scheduler(pipeline: DiffusersPipeline) -> None:
        classes = {c.__name__: c for c in pipeline.pipe.scheduler.compatibles}
        pipeline.pipe.scheduler = classes[scheduler].from_config(pipeline.pipe.scheduler.config)

    return computed_here(GenerationRequest(request_id="ref", **JOB), prepare=use_scheduler)


def test_the_node_announces_the_schema_and_the_api_serves_it(
    cluster: Cluster, client: KilnClient
) -> None:
    (node,) = cluster.store.live_nodes()
    announced = node["inputs"]["tiny"]
    assert "DDIMScheduler" in announced["properties"]["scheduler"]["enum"]
    info = client.pipeline("tiny")
    assert info.inputs == announced
    assert (info.live_nodes, info.adapters) == (1, [])
    assert info.limits["max_width"] == announced["properties"]["width"]["maximum"] == 1024
    with pytest.raises(ValidationFailed) as refused:
        client.submit(JobRequest(**JOB, inputs={"scheduler": "NoSuchScheduler"}))
    assert list(refused.value.fields) == ["body.inputs.scheduler"]
    with pytest.raises(ValidationFailed) as unknown:
        client.submit(JobRequest(**JOB, inputs={"strength": 0.6}))
    assert list(unknown.value.fields) == ["body.inputs.strength"]


def test_a_scheduler_input_runs_end_to_end_as_that_scheduler(
    cluster: Cluster, client: KilnClient
) -> None:
    default = client.submit(JobRequest(**JOB))
    ddim = client.submit(JobRequest(**JOB, inputs={"scheduler": "DDIMScheduler"}))
    assert ddim.parameters.inputs == {"scheduler": "DDIMScheduler"}
    default_pixels, ddim_pixels = (stored_pixels(cluster, job.id) for job in (default, ddim))
    assert np.abs(default_pixels - ddim_pixels).max() > 10 * PIXEL_TOLERANCE  # another picture
    assert np.abs(reference("DDIMScheduler") - ddim_pixels).max() <= PIXEL_TOLERANCE


# --- image inputs (docs/contract.md §2b) -------------------------------------------------------


@pytest.fixture(scope="module")
def images() -> Iterator[str]:
    with image_server() as url:
        yield url


@pytest.fixture(scope="module")
def api(cluster: Cluster) -> Iterator[Api]:
    settings = api_settings(
        pipelines=["tiny", *IMAGE_PIPELINES],
        input_allow_http=True,
        input_allow_hosts=["127.0.0.1"],
    )
    ctx = build_context(settings, cluster.storage_settings)
    with ThreadServer(create_app(settings, cluster.storage_settings, context=ctx)) as server:
        made = Api(server.url, ctx, settings, cluster.storage_settings)
        made.add_key("alice")
        made.add_key("bob")
        yield made
        ctx.store.redis.close()


@pytest.fixture(scope="module")
def alice(api: Api) -> Iterator[KilnClient]:
    with KilnClient(api.url, api.keys["alice"]) as client:
        yield client


def finished(client: KilnClient, job: JobView) -> JobView:
    return client.wait(job.id, timeout=180, poll_s=0.2)


def output_bytes(cluster: Cluster, view: JobView) -> bytes:
    assert view.status == "succeeded", view.error
    (output,) = view.outputs
    return cluster.objects.get(output.key)


def test_the_pipelines_and_openapi_document_image_inputs(api: Api, alice: KilnClient) -> None:
    for name, images in (("tiny-img2img", ["image"]), ("tiny-inpaint", ["image", "mask_image"])):
        schema = alice.pipeline(name).inputs
        assert schema is not None
        assert schema["required"] == images
        for image in images:
            assert schema["properties"][image]["x-kiln-image"] is True
        assert schema["properties"]["strength"] == {
            "type": "number", "minimum": 0.0, "maximum": 1.0, "default": 0.8 if images == ["image"]
            else 1.0,
        }  # fmt: skip
    paths = httpx.get(f"{api.url}/openapi.json").json()["paths"]
    assert set(paths["/v1/uploads"]) == {"post"}
    assert set(paths["/v1/uploads/local"]) == {"put"}
    with pytest.raises(ValidationFailed) as missing:  # the schema's `required`
        alice.submit(JobRequest(**IMAGE_JOB, pipeline="tiny-img2img", inputs={"strength": 0.5}))
    assert list(missing.value.fields) == ["body.inputs"]


def test_img2img_from_an_upload_and_from_a_url_is_the_same_picture(
    cluster: Cluster, alice: KilnClient, images: str
) -> None:
    upload = alice.upload(CAT)
    assert upload.ref.startswith("upload:")

    def img2img(image: str) -> JobView:
        inputs: dict[str, InputScalar] = {"image": image, "strength": 0.6}
        return alice.submit(JobRequest(**IMAGE_JOB, pipeline="tiny-img2img", inputs=inputs))

    # Submitted together: the upload and the URL carry the same bytes, so they may share a forward.
    jobs = [img2img(upload.ref), img2img(f"{images}/cat.png"), img2img(f"{images}/dog.png")]
    from_upload, from_url, other = (finished(alice, job) for job in jobs)
    outputs = [output_bytes(cluster, view) for view in (from_upload, from_url, other)]
    for data in outputs:
        assert Image.open(io.BytesIO(data)).size == (64, 64)  # the request's, not the input's
    assert outputs[0] == outputs[1]  # same seed, same image bytes: the same output bytes
    assert outputs[2] != outputs[0]  # another image: another output
    recorded = from_url.metrics.model_extra or {}
    assert recorded["inputs"]["image"] == {
        "sha256": hashlib.sha256(CAT).hexdigest(), "width": 80, "height": 48, "bytes": len(CAT),
        "content_type": "image/png", "source": f"{images}/cat.png",
    }  # fmt: skip
    assert (from_upload.metrics.model_extra or {})["inputs"]["image"]["source"] == upload.ref


def test_inpainting_with_an_uploaded_image_and_a_mask_url(
    cluster: Cluster, alice: KilnClient, images: str
) -> None:
    inputs = {"image": alice.upload(CAT).ref, "mask_image": f"{images}/mask.png"}
    fields = {**IMAGE_JOB, "height": 96, "pipeline": "tiny-inpaint", "inputs": inputs}
    # Submitted together, so they may share a forward: an output's bytes depend on its request only.
    jobs = [alice.submit(JobRequest(**fields)) for _ in range(2)]
    first, second = (finished(alice, job) for job in jobs)
    data = output_bytes(cluster, first)
    assert Image.open(io.BytesIO(data)).size == (64, 96)
    assert output_bytes(cluster, second) == data
    masked = (first.metrics.model_extra or {})["inputs"]["mask_image"]
    assert (masked["width"], masked["height"]) == (64, 96)


def test_refused_image_inputs(api: Api, alice: KilnClient, images: str) -> None:
    def submit(image: str, client: KilnClient = alice) -> JobView:
        inputs: dict[str, InputScalar] = {"image": image}
        return client.submit(JobRequest(**IMAGE_JOB, pipeline="tiny-img2img", inputs=inputs))

    with KilnClient(api.url, api.keys["bob"]) as bob:
        with pytest.raises(ValidationFailed) as foreign:  # alice's upload, named by bob
            submit(alice.upload(CAT).ref, bob)
        assert "no such upload for this API key" in foreign.value.fields["body.inputs.image"]
    with pytest.raises(ValidationFailed) as private:  # not allow-listed: refused up front
        submit("http://10.1.2.3/cat.png")
    assert "private" in private.value.fields["body.inputs.image"]
    wrong_type = finished(alice, submit(f"{images}/cat.txt"))  # only the node can see the type
    assert wrong_type.status == "failed"
    assert wrong_type.error is not None
    assert wrong_type.error.type == "ImageInputRejected"
    assert "is 'text/plain'; allowed: image/jpeg, image/png, image/webp" in wrong_type.error.message
    assert not wrong_type.error.retryable
