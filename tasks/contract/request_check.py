"""A request's static checks in one pass, given what the served pipelines declare (§2, §2a, §2c).

`check_request` is the one place a job request is checked beyond its own schema: the pipeline is
one a request may name, its limits take the request, its declared inputs take `inputs` (each
value, image references' form, steps × strength), and some live node offers each LoRA adapter.
What the pipelines declare comes in as data (`PipelineDecl`), so this module reads nothing: the
intake (`tasks.intake`) builds the declaration from the nodes' heartbeats and calls it at every
door, and makes the violation its typed refusal. What needs I/O (an upload's owner, an image
URL's or a webhook's host) is checked after it, by the intake.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from kiln.common.previews import PREVIEWS_KEY
from kiln.common.request import (
    CHECKPOINTS_KEY,
    DEFAULT_SPEED,
    FIELDS_KEY,
    SPEED_MODES,
    InputSchema,
    declared_speed_modes,
)
from kiln.tasks.contract.image_refs import ImageRef, parse_image_ref
from kiln.tasks.contract.inputs import (
    InputViolation,
    first_input_violation,
    image_input_names,
)
from kiln.tasks.contract.limits import (
    LimitViolation,
    PipelineLimits,
    first_violation,
    tighter_bound,
)
from kiln.tasks.contract.loras import AdapterViolation, NodeAdapters, first_adapter_violation
from kiln.tasks.contract.schemas import JobRequest


@dataclass(frozen=True)
class PipelineDecl:
    """What the served pipelines declare about the one a request names: all a check reads."""

    known: tuple[str, ...]  # every pipeline a request may name (configured or served now)
    limits: tuple[PipelineLimits, ...] = ()  # per live node announcing it, else a built-in's
    inputs: tuple[InputSchema, ...] = ()  # per live node announcing an input schema for it
    adapters: tuple[NodeAdapters, ...] = ()  # per live node announcing adapters for it


@dataclass(frozen=True)
class PipelineUnknown:
    """The request names a pipeline that is neither configured nor served by a live node."""

    kind: ClassVar[str] = "unknown_pipeline"
    pipeline: str
    known: tuple[str, ...]

    @property
    def message(self) -> str:
        """What the caller reads: the name, and the names it may use."""
        return f"unknown pipeline {self.pipeline!r}; served: {', '.join(self.known) or 'none'}"

    @property
    def value(self) -> str:
        """The offending input: the name."""
        return self.pipeline

    def loc(self, prefix: tuple[str | int, ...] = ()) -> tuple[str | int, ...]:
        """Where the error points: `pipeline`, after `prefix`."""
        return (*prefix, "pipeline")

    def context(self) -> dict[str, Any]:
        """The error's `ctx`: the pipelines a request may name."""
        return {"known": list(self.known)}


@dataclass(frozen=True)
class SpeedUnsupported:
    """The request asks for a speed mode no live node's pipeline announces."""

    kind: ClassVar[str] = "speed_mode"
    pipeline: str
    speed: str
    modes: tuple[str, ...]  # the modes some live node serves (`exact` at least)

    @property
    def message(self) -> str:
        """What the caller reads: the mode, and the modes the pipeline serves."""
        return (
            f"{self.pipeline} does not serve speed {self.speed!r}; it serves "
            f"{', '.join(self.modes)} (GET /v1/pipelines/{self.pipeline})"
        )

    @property
    def value(self) -> str:
        """The offending input: the mode."""
        return self.speed

    def loc(self, prefix: tuple[str | int, ...] = ()) -> tuple[str | int, ...]:
        """Where the error points: `speed`, after `prefix`."""
        return (*prefix, "speed")

    def context(self) -> dict[str, Any]:
        """The error's `ctx`: the pipeline and the modes it serves."""
        return {"pipeline": self.pipeline, "supported": list(self.modes)}


@dataclass(frozen=True)
class FeatureUnsupported:
    """The request asks for a feature (previews, step checkpoints) no live node's pipeline has."""

    kind: str  # previews_unsupported or checkpoints_unsupported
    pipeline: str
    field: str  # the request's field that asks for it: `preview` or `checkpoint`
    asked: dict[str, Any]  # what the request asked for
    why: str  # what the caller reads after the pipeline's name

    @property
    def message(self) -> str:
        """What the caller reads: why the feature is missing, and what to do."""
        return f"{self.pipeline} {self.why}; submit without `{self.field}`"

    @property
    def value(self) -> dict[str, Any]:
        """The offending input: the request's field."""
        return self.asked

    def loc(self, prefix: tuple[str | int, ...] = ()) -> tuple[str | int, ...]:
        """Where the error points: the field, after `prefix`."""
        return (*prefix, self.field)

    def context(self) -> dict[str, Any]:
        """The error's `ctx`: the pipeline."""
        return {"pipeline": self.pipeline}


# Each has `kind`, `message`, `value`, `loc(prefix)`, `context()`: the intake makes it a Refusal.
Violation = (
    PipelineUnknown
    | FeatureUnsupported
    | LimitViolation
    | InputViolation
    | AdapterViolation
    | SpeedUnsupported
)


def check_request(request: JobRequest, declared: PipelineDecl) -> Violation | None:
    """The first reason the served pipelines refuse `request`; None when one would run it.

    In order: the pipeline's name, its previews, its limits, its inputs (values, image
    references' form, steps × strength), its adapters, its speed mode. Each passes when any live
    node's declaration takes it.
    """
    pipeline = request.pipeline
    if pipeline not in declared.known:
        return PipelineUnknown(pipeline, declared.known)
    return (
        preview_violation(pipeline, declared.inputs, request)
        or checkpoint_violation(pipeline, declared.inputs, request)
        or first_violation(pipeline, list(declared.limits), request)
        or first_input_violation(pipeline, list(declared.inputs), request.inputs, request.steps)
        or first_adapter_violation(pipeline, declared.adapters, request.loras)
        or speed_violation(pipeline, declared.inputs, request.speed)
    )


def restated_bounds(
    errors: Sequence[Mapping[str, Any]],
    pipeline: str,
    declared: PipelineDecl,
    prefix: tuple[str | int, ...] = (),
) -> list[dict[str, Any]]:
    """`errors` (pydantic's, of a JobRequest for `pipeline`) with the pipeline's own limits named.

    A value past a schema bound that the pipeline declares lower (`width` 100000: the schema
    says 4096, the pipeline takes 1024) is restated as the pipeline's refusal, with its type and
    context; every other error is kept as it is. `prefix` is where the request sits in `loc`.
    """
    candidates = list(declared.limits) if pipeline in declared.known else []
    restated: list[dict[str, Any]] = []
    for error in errors:
        loc = tuple(error.get("loc", ()))
        field = loc[len(prefix)] if len(loc) == len(prefix) + 1 else None
        violation = None
        if error.get("type") == "less_than_equal" and isinstance(field, str):
            violation = tighter_bound(pipeline, candidates, field, error.get("input"))
        if violation is None:
            restated.append(dict(error))
            continue
        restated.append(
            {
                "type": violation.kind,
                "loc": violation.loc(prefix),
                "msg": violation.message,
                "input": violation.value,
                "ctx": violation.context(),
            }
        )
    return restated


def restated_error(
    error: ValidationError, pipeline: str, declared: PipelineDecl
) -> ValidationError:
    """`error` (a JobRequest's) as `restated_bounds` words it, for callers that raise it on."""
    errors = error.errors()
    restated = restated_bounds(errors, pipeline, declared)
    if restated == errors:
        return error
    # Each message goes in as context: a literal template would treat braces as placeholders.
    lines = [
        {
            "type": PydanticCustomError(item["type"], "{message}", {"message": item["msg"]}),
            "loc": item["loc"],
            "input": item.get("input"),
        }
        for item in restated
    ]
    return ValidationError.from_exception_data(error.title, lines)  # type: ignore[arg-type]


def requested_pipeline(fields: object) -> str:
    """The pipeline a raw request names (JobRequest's default when it names none or no string)."""
    named = fields.get("pipeline") if isinstance(fields, Mapping) else None
    return named if isinstance(named, str) else str(JobRequest.model_fields["pipeline"].default)


def speed_violation(
    pipeline: str, schemas: Sequence[InputSchema], speed: str
) -> SpeedUnsupported | None:
    """None when `speed` is `exact` or some live node's schema announces it (SPEED_KEY).

    A pipeline no live node announces a schema for serves `exact` only, as far as is known.
    """
    if speed == DEFAULT_SPEED:
        return None
    served: set[str] = set()
    for schema in schemas:
        served.update(declared_speed_modes(schema))
    if speed in served:
        return None
    modes = tuple(mode for mode in SPEED_MODES if mode in served) or (DEFAULT_SPEED,)
    return SpeedUnsupported(pipeline, speed, modes)


def announces_previews(schemas: Sequence[InputSchema]) -> bool:
    """Whether a request may ask for previews: some live node's schema says it can decode them.

    True while no node announces a schema (nothing is known yet, as for limits), and for a
    schema without the mark (a node from before it).
    """
    return not schemas or any(schema.get(PREVIEWS_KEY, True) is not False for schema in schemas)


def announced_fields(schemas: Sequence[InputSchema]) -> list[str] | None:
    """The request fields the live nodes' schemas say the pipeline honours; None while none says."""
    marked = [schema[FIELDS_KEY] for schema in schemas if isinstance(schema.get(FIELDS_KEY), list)]
    if not marked:
        return None
    return sorted({str(name) for names in marked for name in names})


def preview_violation(
    pipeline: str, schemas: Sequence[InputSchema], request: JobRequest
) -> FeatureUnsupported | None:
    """A request for previews of a pipeline whose live nodes cannot decode any; else None."""
    if request.preview is None or announces_previews(schemas):
        return None
    why = (
        "emits no previews: its pipeline names no preview decoder and has no VAE "
        "(docs/pipelines.md, Previews)"
    )
    return FeatureUnsupported(
        "previews_unsupported", pipeline, "preview", request.preview.model_dump(mode="json"), why
    )


def checkpoint_violation(
    pipeline: str, schemas: Sequence[InputSchema], request: JobRequest
) -> FeatureUnsupported | None:
    """A request for step checkpoints of a pipeline whose live nodes cannot take any; else None.

    Passes while no live node announces a schema (nothing is known yet, as for limits).
    """
    if request.checkpoint is None or not schemas:
        return None
    if any(schema.get(CHECKPOINTS_KEY) is True for schema in schemas):
        return None
    why = (
        "takes no step checkpoints: its denoising loop cannot resume "
        "(docs/pipelines.md, Step checkpoints and resume)"
    )
    asked = request.checkpoint.model_dump(mode="json", exclude_none=True)
    return FeatureUnsupported("checkpoints_unsupported", pipeline, "checkpoint", asked, why)


def image_refs(request: JobRequest, declared: PipelineDecl) -> dict[str, ImageRef]:
    """The image references among `request.inputs` by input name (sorted), as schemas mark them.

    For the checks that need I/O once `check_request` has passed: a value some schema takes as
    a plain input and that is no reference is left out (that node would not read it as an image).
    """
    names = sorted(_image_input_names(declared.inputs) & request.inputs.keys())
    refs: dict[str, ImageRef] = {}
    for name in names:
        try:
            refs[name] = parse_image_ref(request.inputs[name])
        except ValueError:
            continue
    return refs


def _image_input_names(schemas: Sequence[InputSchema]) -> frozenset[str]:
    return frozenset(name for schema in schemas for name in image_input_names(schema))
