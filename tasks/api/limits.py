"""The API's refusal of a request over its pipeline's limits: a 422 naming the limit."""

from __future__ import annotations

from kiln.tasks.api.deps import field_error
from kiln.tasks.contract.limits import ERROR_TYPE
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.queue.submit import Submitter


def refuse_over_limits(submitter: Submitter, request: JobRequest) -> None:
    """Raise a 422 (loc body.<field>, ctx.limit) when no live node would take `request`."""
    violation = submitter.over_limits(request)
    if violation is not None:
        # The budget blames no single field: the error then points at the whole body.
        loc = ("body", violation.field) if violation.field else ("body",)
        raise field_error(
            loc, violation.message, ERROR_TYPE, violation.value, **violation.context()
        )
