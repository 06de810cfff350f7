"""Image-conditioned pipelines: the tiny variants, and image inputs as call arguments.

`tiny-img2img` and `tiny-inpaint` are the `tiny` pipeline's own components (the same folder in
the model cache, no other weights) behind diffusers' `StableDiffusionImg2ImgPipeline` and
`StableDiffusionInpaintPipeline`; `tiny-i2v` is `tiny-video`'s components behind
`WanImageToVideoPipeline` in its Wan 2.2 form (`expand_timesteps`: the image's latents become
the first latent frame, so no image encoder and no wider transformer are needed).

Every image input is resized to the request's width × height before the call, so the output
has the size the request asked for also where the pipeline itself takes no size (img2img).
Light to import: diffusers is imported only when a variant is built.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.inputs import image_input_names
from kiln.gpu_worker.pipeline_specs import TINY_VARIANTS, tiny_base

__all__ = ["TINY_VARIANTS", "as_variant", "image_call_kwargs", "missing_image", "tiny_base"]

if TYPE_CHECKING:
    from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
    from kiln.gpu_worker.protocol import GenerationRequest

# Image parameters a pipeline cannot run without (diffusers' img2img, inpaint and
# image-to-video pipelines fail without them): required in the derived input schema.
REQUIRED_IMAGES = ("image", "mask_image")


def as_variant(pipeline: DiffusersPipeline, spec: str) -> DiffusersPipeline:
    """`pipeline`'s components behind the class `spec` names; `pipeline` itself otherwise."""
    if spec not in TINY_VARIANTS:
        return pipeline
    import diffusers

    from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline

    _, class_name, options = TINY_VARIANTS[spec]
    cls = getattr(diffusers, class_name)
    takes = inspect.signature(cls.__init__).parameters
    components = {k: v for k, v in pipeline.pipe.components.items() if k in takes}
    pipe = cls(**components, **options)
    pipe.set_progress_bar_config(disable=True)
    return DiffusersPipeline(pipe, pipeline.device, spec, pipeline.limits())


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
) -> dict[str, Any]:
    """`kwargs` with the request's images as PIL images of its size.

    The size is dropped where the call takes none; UnsupportedRequest for an image input that
    the node never fetched.
    """
    names = image_input_names(schema) & request.extra_inputs.keys()
    if not names:
        return kwargs
    size = (request.width, request.height)
    updated = dict(kwargs)
    for name in names:
        image = request.images.get(name)
        if image is None:
            raise UnsupportedRequest(f"inputs.{name}: the image was not fetched by the node")
        updated[name] = image.to_pil(size)
    for field_name in ("width", "height"):
        if field_name not in call_params:
            updated.pop(field_name, None)
    return updated
