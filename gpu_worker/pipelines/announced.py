"""The input schema a node announces for a loaded pipeline: what it declares, marked.

The schema the pipeline declares (`input_schema()`; without one, no properties) with two marks
the API reads from the heartbeat: `x-kiln-fields`, the request fields it honours
(`supported_fields()`), which `GET /v1/pipelines/{name}` shows and the console turns into form
fields; `x-kiln-previews`, whether rank 0 can decode its previews (a decoder it names, or a VAE),
without which a request for previews is refused before it is queued; `x-kiln-checkpoints`,
whether its denoising loop takes step checkpoints and resumes from them (the node plans
checkpoints only for such a pipeline's jobs: tasks/node/checkpoints.py).
"""

from __future__ import annotations

from kiln.common.previews import PREVIEWS_KEY
from kiln.common.request import CHECKPOINTS_KEY, FIELDS_KEY, InputSchema
from kiln.gpu_worker.inputs import declared_input_schema
from kiln.gpu_worker.pipelines.base import Pipeline, StepStateHooks
from kiln.gpu_worker.pipelines.diffusers_resume import ResumedLoop
from kiln.gpu_worker.previews import can_preview


def announced_schema(pipeline: Pipeline) -> InputSchema:
    """`pipeline`'s declared input schema (or an empty one) with its fields and previews marked."""
    schema = declared_input_schema(pipeline) or {"type": "object", "properties": {}}
    schema[FIELDS_KEY] = sorted(pipeline.supported_fields())
    schema[PREVIEWS_KEY] = can_preview(pipeline)
    schema[CHECKPOINTS_KEY] = takes_checkpoints(pipeline)
    return schema


def takes_checkpoints(pipeline: Pipeline) -> bool:
    """Whether a run of one job on `pipeline` can take step checkpoints and resume from them.

    A diffusers pipeline whose loop Kiln resumes, or a pipeline with the save/restore hooks.
    """
    if isinstance(pipeline, ResumedLoop):
        return pipeline.takes_checkpoints()
    return isinstance(pipeline, StepStateHooks)
