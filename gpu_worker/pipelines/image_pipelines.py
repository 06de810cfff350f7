"""Image inputs of a diffusers pipeline: which it requires, and as call arguments.

The tiny image-conditioned variants (`tiny-img2img`, `tiny-inpaint`, `tiny-i2v`) are built by
`DiffusersPipeline.as_variant` from `pipeline_specs.TINY_VARIANTS`.

Every image input is resized to the request's width × height before the call, so the output
has the size the request asked for also where the pipeline itself takes no size (img2img).

A pipeline that starts from the image's noised latents (img2img, inpaint: those that take
`strength`) gets its `image` and `mask_image` once per output of the batch. Such a pipeline
encodes image `i` and samples its latents with generator `i`; given one image and a generator
per output, it samples with the first generator only, which then draws its noise after that
sample while the other outputs' generators draw theirs before, so an output's pixels would
depend on its place in the batch. One copy per output keeps every draw on the output's own
generator, in the order of a run alone. Other image inputs (a control image, an image-to-video
pipeline's first frame, sampled without randomness) are passed once: several images there may
mean one per component, and Wan's image-to-video takes only one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.inputs import image_input_names

if TYPE_CHECKING:
    from kiln.gpu_worker.protocol import GenerationRequest

# Image parameters a pipeline cannot run without (diffusers' img2img, inpaint and
# image-to-video pipelines fail without them): required in the derived input schema.
REQUIRED_IMAGES = ("image", "mask_image")
# The parameter of the pipelines that start from the image's noised latents, sampled per output.
NOISED_IMAGE_PARAMETER = "strength"


def missing_image(
    pipeline: str, schema: Mapping[str, Any], request: GenerationRequest
) -> str | None:
    """Why `request` cannot run: a required image it lacks (a warm-up has none); else None."""
    for name in schema.get("required") or ():
        if name in image_input_names(schema) and name not in request.images:
            return f"inputs.{name}: {pipeline} needs this image input"
    return None


def image_call_kwargs(
    kwargs: dict[str, Any],
    request: GenerationRequest,
    schema: Mapping[str, Any],
    call_params: frozenset[str],
    *,
    outputs: int,
) -> dict[str, Any]:
    """`kwargs` with the request's images as PIL images of its size, for a batch of `outputs`.

    `image` and `mask_image` are lists of one copy per output where the pipeline samples their
    latents per output (see the module docstring); the size is dropped where the call takes
    none; UnsupportedRequest for an image input that the node never fetched.
    """
    names = image_input_names(schema) & request.extra_inputs.keys()
    if not names:
        return kwargs
    size = (request.width, request.height)
    per_output = NOISED_IMAGE_PARAMETER in call_params
    updated = dict(kwargs)
    for name in names:
        image = request.images.get(name)
        if image is None:
            raise UnsupportedRequest(f"inputs.{name}: the image was not fetched by the node")
        pixels = image.to_pil(size)
        updated[name] = [pixels] * outputs if per_output and name in REQUIRED_IMAGES else pixels
    for field_name in ("width", "height"):
        if field_name not in call_params:
            updated.pop(field_name, None)
    return updated
