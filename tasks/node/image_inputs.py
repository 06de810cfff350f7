"""A job's image inputs, fetched on the node before compute (docs/contract.md §2c).

Each image input names an upload (read from the object store under the job owner's own folder,
checked by HEAD first) or a URL (fetched through the webhooks' SSRF guard with the input
allow-list: resolved once, every address checked, the connection pinned, no redirects, one
deadline for the whole fetch). Either way the bytes must be a PNG, JPEG or WebP within
`KILN_UPLOAD_MAX_BYTES` and `KILN_INPUT_MAX_PIXELS`, decoded once here to be sure. The ranks get
the bytes (`gpu_worker.images.InputImage`); the job's metrics record each input's sha256, size
and source, so a run can be reproduced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import re
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from PIL import Image, UnidentifiedImageError

from kiln.common.media import IMAGE_CONTENT_TYPES
from kiln.gpu_worker.images import InputImage
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.storage.errors import ObjectStoreError
from kiln.storage.object_base import ObjectStore
from kiln.storage.uploaded_inputs import UploadRefused, checked_upload, resolve_upload
from kiln.tasks.contract.image_refs import ImageRef, parse_image_ref
from kiln.tasks.contract.inputs import image_input_names
from kiln.tasks.contract.job_spec import JobSpec
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.webhooks.ssrf import (
    Resolver,
    UnsafeUrl,
    check_url,
    pinned_client,
    policy_from,
    system_resolver,
)

if TYPE_CHECKING:  # the node imports the group; this module is used without one too
    from kiln.tasks.node.node import Node

# What PIL calls the formats an input may have, by content type.
PIL_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


# what a refusal shows of bytes that are no image: enough to tell HTML or JSON from a picture
_SHOWN_BYTES = 16
# a Python object's repr with its address (`<_io.BytesIO object at 0x7f…>`): nothing for a user
_OBJECT_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")


class ImageInputRejected(Exception):
    """An image input the node cannot use: refused URL, failed fetch, wrong type, too large."""

    retryable = False


@dataclass(frozen=True)
class FetchedImage:
    """One image input as fetched: the bytes for the ranks, and where they came from."""

    image: InputImage
    content_type: str
    source: str  # `upload:<id>` or the URL

    def facts(self) -> dict[str, Any]:
        """What the job's record keeps about it (metrics.inputs.<name>)."""
        return {
            "sha256": self.image.sha256,
            "width": self.image.width,
            "height": self.image.height,
            "bytes": len(self.image.data),
            "content_type": self.content_type,
            "source": self.source,
        }


@dataclass(frozen=True)
class ImageFetcher:
    """Fetches and checks the image inputs of jobs for one node."""

    objects: ObjectStore
    settings: KilnSettings
    resolve: Resolver = system_resolver

    def fetch_all(
        self, inputs: Mapping[str, Any], schema: Mapping[str, Any] | None, owner: str | None
    ) -> dict[str, FetchedImage]:
        """Every image input of a job (by the pipeline's `schema`), fetched and checked."""
        names = image_input_names(schema) if schema else frozenset()
        fetched: dict[str, FetchedImage] = {}
        for name in sorted(names & inputs.keys()):
            try:
                fetched[name] = self.fetch(parse_image_ref(inputs[name]), owner)
            except (ValueError, UnsafeUrl, UploadRefused) as exc:
                raise ImageInputRejected(f"inputs.{name}: {exc}") from exc
            except ImageInputRejected as exc:
                raise ImageInputRejected(f"inputs.{name}: {exc}") from exc
        return fetched

    def fetch(self, ref: ImageRef, owner: str | None) -> FetchedImage:
        """One image: read from the owner's uploads, or fetched from its URL."""
        if ref.kind == "upload":
            key = resolve_upload(self.objects, owner, ref.target)
            checked_upload(self.objects, key, self.settings.upload_max_bytes, IMAGE_CONTENT_TYPES)
            try:
                data = self.objects.get(key)
            except ObjectStoreError as exc:
                raise ImageInputRejected(f"the upload could not be read: {exc}") from exc
            return self._decoded(data, f"upload:{ref.target}")
        return self._decoded(self._download(ref.target), ref.target)

    def _download(self, url: str) -> bytes:
        policy = policy_from(self.settings.input_allow_http, self.settings.input_allow_hosts)
        target = check_url(url, policy, self.resolve)
        timeout_s = self.settings.input_fetch_timeout_s
        deadline = time.monotonic() + timeout_s
        limit = self.settings.upload_max_bytes
        try:
            with (
                pinned_client(target, timeout_s) as client,
                client.stream("GET", url, headers={"accept": ", ".join(PIL_FORMATS.values())}) as r,
            ):
                if r.status_code != 200:
                    raise ImageInputRejected(f"{url} answered HTTP {r.status_code}")
                content_type = r.headers.get("content-type", "").split(";")[0].strip().lower()
                if content_type not in IMAGE_CONTENT_TYPES:
                    allowed = ", ".join(sorted(IMAGE_CONTENT_TYPES))
                    raise ImageInputRejected(f"{url} is {content_type!r}; allowed: {allowed}")
                body = bytearray()
                for chunk in r.iter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise ImageInputRejected(f"{url} is over the limit of {limit} bytes")
                    if time.monotonic() > deadline:
                        raise ImageInputRejected(f"{url} took over {timeout_s:g} s")
        except httpx.HTTPError as exc:
            raise ImageInputRejected(f"fetching {url} failed: {type(exc).__name__}: {exc}") from exc
        return bytes(body)

    def _decoded(self, data: bytes, source: str) -> FetchedImage:
        if len(data) > self.settings.upload_max_bytes:
            limit = self.settings.upload_max_bytes
            raise ImageInputRejected(f"the image is {len(data)} bytes, over the limit of {limit}")
        try:
            with warnings.catch_warnings():
                # the pixel limit below is Kiln's own; PIL's bomb warning would only repeat it
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(data)) as image:
                    width, height = image.size
                    kind = PIL_FORMATS.get(image.format or "")
                    if kind is None:
                        raise ImageInputRejected(f"the image is {image.format}, not PNG/JPEG/WebP")
                    if width * height > self.settings.input_max_pixels:
                        raise ImageInputRejected(
                            f"the image is {width}x{height} pixels, over the limit of "
                            f"{self.settings.input_max_pixels}"
                        )
                    image.load()  # a truncated or corrupt file fails here, not on a rank
        except UnidentifiedImageError:  # PIL's message names its buffer object by address
            raise ImageInputRejected(
                f"not a decodable image (PNG, JPEG or WebP): its {len(data):,} bytes start "
                f"{data[:_SHOWN_BYTES]!r}"
            ) from None
        except (OSError, Image.DecompressionBombError, ValueError) as exc:
            reason = _OBJECT_REPR.sub("the data", str(exc))
            raise ImageInputRejected(f"the image cannot be decoded: {reason}") from exc
        digest = hashlib.sha256(data).hexdigest()
        return FetchedImage(InputImage(digest, data, width, height), kind, source)


def fetch_job_images(node: Node, spec: JobSpec, owner: str | None) -> dict[str, FetchedImage]:
    """The image inputs of a job about to run on `node` (its `owner`'s uploads, or URLs)."""
    schema = node.pipeline_inputs().get(spec.pipeline)
    fetcher = ImageFetcher(node.objects, node.settings)
    return fetcher.fetch_all(spec.inputs, schema, owner)


def with_images(
    request: GenerationRequest, fetched: Mapping[str, FetchedImage]
) -> GenerationRequest:
    """`request` carrying the fetched images, their references replaced by `sha256:<hex>`."""
    if not fetched:
        return request
    images = {name: item.image for name, item in fetched.items()}
    extra = {**request.extra_inputs, **{name: image.ref for name, image in images.items()}}
    return dataclasses.replace(request, extra_inputs=extra, images=images)


def input_facts(fetched: Mapping[str, FetchedImage]) -> dict[str, Any]:
    """The job's `metrics` entry for its image inputs (none: an empty dict, nothing added)."""
    if not fetched:
        return {}
    return {"inputs": {name: item.facts() for name, item in sorted(fetched.items())}}
