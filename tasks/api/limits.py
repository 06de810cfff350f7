"""The API's refusal of a request over its pipeline's limits or inputs: a 422 naming the field."""

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


def refuse_bad_inputs(submitter: Submitter, request: JobRequest) -> None:
    """Raise a 422 (loc body.inputs.<name>) when no live node's schema takes `request.inputs`."""
    violation = submitter.bad_inputs(request)
    if violation is not None:
        loc = tuple(str(part) for part in violation.loc(("body",)))
        raise field_error(
            loc, violation.message, violation.kind, violation.value, **violation.context()
        )
