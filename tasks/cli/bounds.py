"""`kiln submit`'s refusal of a value past a schema bound names the pipeline's lower limit.

The schema refuses `--width 100000` against its global bound (4096) before the request reaches
a backend; the pipeline named may take far less (1024), and that is what the user must meet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kiln.tasks.cli.backends import DirectBackend, HttpBackend, JobsBackend
from kiln.tasks.contract.limits import PipelineLimits
from kiln.tasks.contract.request_check import PipelineDecl, requested_pipeline, restated_error


def with_pipeline_bounds(
    error: ValidationError, fields: Mapping[str, Any], backend: JobsBackend
) -> ValidationError:
    """`error` with each value past a bound the pipeline declares lower named as its refusal."""
    if not any(item["type"] == "less_than_equal" for item in error.errors()):
        return error
    pipeline = requested_pipeline(fields)
    declared = _declared(backend, pipeline)
    return error if declared is None else restated_error(error, pipeline, declared)


def _declared(backend: JobsBackend, pipeline: str) -> PipelineDecl | None:
    if isinstance(backend, DirectBackend):
        from kiln.storage.errors import StorageError

        try:
            return backend.submitter.declared(pipeline)
        except StorageError:  # no Redis: the request is refused all the same, in the schema's words
            return None
    if isinstance(backend, HttpBackend):
        from kiln.tasks.client.client import KilnError

        try:
            info = backend.client.pipeline(pipeline)
        except KilnError:  # an unknown pipeline or an older API: the schema's words stand
            return None
        return PipelineDecl(known=(pipeline,), limits=(PipelineLimits.from_dict(info.limits),))
    return None
