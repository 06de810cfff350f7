"""Pipeline limits: what the intake and the node refuse before any rank runs a job.

Each pipeline declares its limits on its ranks (`kiln.common.limits.DeclaredLimits`); nodes
announce them in their heartbeat under `limits`, keyed by pipeline name. A pipeline that no live
node announces yet falls back to what the tiny pipelines declare (`TINY_LIMITS`) for the
built-in names, so what they would refuse on the node is refused at submit already. Torch-free
and gpu_worker-free: the API process imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Protocol

from kiln.common.limits import TINY_LIMITS
from kiln.common.previews import MAX_PREVIEW_SIDE
from kiln.common.request import MAX_FRAMES, MAX_SIDE, MAX_STEPS, SIZE_MULTIPLE

ERROR_TYPE = "pipeline_limit"


class PreviewShape(Protocol):
    """The preview fields limits look at (a `PreviewRequest` or a `PreviewSpec`)."""

    @property
    def every_steps(self) -> int:
        """A preview every this many steps."""
        ...

    @property
    def max_side(self) -> int:
        """A preview's longer side, at most."""
        ...


class RequestShape(Protocol):
    """The request fields limits look at (a `JobRequest` or a `GenerationRequest`)."""

    @property
    def width(self) -> int:
        """Output width in pixels."""
        ...

    @property
    def height(self) -> int:
        """Output height in pixels."""
        ...

    @property
    def steps(self) -> int:
        """Denoising steps."""
        ...

    @property
    def num_frames(self) -> int:
        """Frames per output (1 for an image)."""
        ...

    @property
    def num_outputs(self) -> int:
        """Outputs the request asks for."""
        ...

    @property
    def preview(self) -> PreviewShape | None:
        """The previews the request asks for; None for none."""
        ...


@dataclass(frozen=True)
class LimitViolation:
    """Why a pipeline refuses a request: the field at fault, the limit's name, a message."""

    kind: ClassVar[str] = ERROR_TYPE
    pipeline: str
    field: str | None  # None when several fields share the blame (the budget); dotted when nested
    limit: str  # the limit's key, e.g. "max_steps"
    message: str
    value: int

    def loc(self, prefix: tuple[str | int, ...] = ()) -> tuple[str | int, ...]:
        """Where the error points, after `prefix` (("body",) for the API)."""
        return (*prefix, *self.field.split(".")) if self.field else prefix

    def describe(self) -> str:
        """One line for a job's error: the field, then the message."""
        return f"{self.field}: {self.message}" if self.field else self.message

    def context(self) -> dict[str, str]:
        """The error's `ctx`: which limit of which pipeline."""
        return {"limit": self.limit, "pipeline": self.pipeline}


@dataclass(frozen=True)
class PipelineLimits:
    """One pipeline's limits; each default is the job schema's own range, so it adds nothing."""

    max_width: int = MAX_SIDE
    max_height: int = MAX_SIDE
    size_multiple: int = SIZE_MULTIPLE
    max_steps: int = MAX_STEPS
    min_frames: int = 1
    max_frames: int = MAX_FRAMES
    frame_step: int = 1  # num_frames must be frame_step * k + 1
    max_pixels_frames_outputs: int | None = None  # width × height × num_frames × num_outputs
    max_preview_side: int = MAX_PREVIEW_SIDE  # preview.max_side ≤ it
    min_preview_every_steps: int = 1  # preview.every_steps ≥ it

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineLimits:
        """Parse announced limits, skipping unknown keys and values that are not positive ints."""
        names = {f.name for f in fields(cls)}
        values = {
            key: value
            for key, value in data.items()
            if key in names and type(value) is int and value >= 1
        }
        return cls(**values)

    def to_dict(self) -> dict[str, int | None]:
        """The JSON form a heartbeat carries."""
        return asdict(self)

    def violation(self, pipeline: str, request: RequestShape) -> LimitViolation | None:
        """The first limit `request` breaks, or None when `pipeline` takes it."""
        return (
            self._side(pipeline, "width", request.width, self.max_width, "max_width")
            or self._side(pipeline, "height", request.height, self.max_height, "max_height")
            or self._steps(pipeline, request.steps)
            or self._frames(pipeline, request.num_frames)
            or self._budget(pipeline, request)
            or self._preview(pipeline, request.preview)
        )

    def frame_rule(self) -> str:
        """The allowed num_frames in words: `= 1`, `from 1 to 64`, `= 4k+1 (1, 5, 9, …, 81)`."""
        first = self.min_frames + (-(self.min_frames - 1)) % self.frame_step
        last = self.max_frames - (self.max_frames - 1) % self.frame_step
        if first >= last:
            suffix = " (an image pipeline)" if first == 1 else ""
            return f"num_frames = {first}{suffix}"
        if self.frame_step == 1:
            return f"num_frames from {first} to {last}"
        shown = list(range(first, last + 1, self.frame_step))
        head = shown if len(shown) <= 4 else shown[:3]
        listed = ", ".join(map(str, head)) + ("" if head is shown else f", …, {last}")
        return f"num_frames = {self.frame_step}k+1 ({listed})"

    def _side(
        self, pipeline: str, field: str, value: int, maximum: int, limit: str
    ) -> LimitViolation | None:
        if value > maximum:
            message = f"{pipeline} takes {field} ≤ {maximum}; got {value}"
            return LimitViolation(pipeline, field, limit, message, value)
        if value % self.size_multiple:
            message = f"{pipeline} takes {field} as a multiple of {self.size_multiple}; got {value}"
            return LimitViolation(pipeline, field, "size_multiple", message, value)
        return None

    def _steps(self, pipeline: str, steps: int) -> LimitViolation | None:
        if steps <= self.max_steps:
            return None
        message = f"{pipeline} takes steps ≤ {self.max_steps}; got {steps}"
        return LimitViolation(pipeline, "steps", "max_steps", message, steps)

    def _frames(self, pipeline: str, frames: int) -> LimitViolation | None:
        if frames < self.min_frames:
            limit = "min_frames"
        elif frames > self.max_frames:
            limit = "max_frames"
        elif (frames - 1) % self.frame_step:
            limit = "frame_step"
        else:
            return None
        message = f"{pipeline} takes {self.frame_rule()}; got {frames}"
        return LimitViolation(pipeline, "num_frames", limit, message, frames)

    def _budget(self, pipeline: str, request: RequestShape) -> LimitViolation | None:
        budget = self.max_pixels_frames_outputs
        factors = (request.width, request.height, request.num_frames, request.num_outputs)
        total = factors[0] * factors[1] * factors[2] * factors[3]
        if budget is None or total <= budget:
            return None
        message = (
            f"{pipeline} takes width × height × num_frames × num_outputs ≤ {budget:,}; got "
            f"{' × '.join(map(str, factors))} = {total:,}"
        )
        return LimitViolation(pipeline, None, "max_pixels_frames_outputs", message, total)

    def _preview(self, pipeline: str, preview: PreviewShape | None) -> LimitViolation | None:
        if preview is None:
            return None
        side, most = preview.max_side, self.max_preview_side
        if side > most:
            message = f"{pipeline} takes preview.max_side ≤ {most}; got {side}"
            return LimitViolation(pipeline, "preview.max_side", "max_preview_side", message, side)
        every, least = preview.every_steps, self.min_preview_every_steps
        if every < least:
            message = f"{pipeline} takes preview.every_steps ≥ {least}; got {every}"
            limit = "min_preview_every_steps"
            return LimitViolation(pipeline, "preview.every_steps", limit, message, every)
        return None


# Static limits of the built-in names, used until a node announces them: what the tiny pipelines
# declare. `default` is the tiny image pipeline unless a node announces otherwise.
BUILTIN_LIMITS: dict[str, PipelineLimits] = {
    name: PipelineLimits.from_dict(declared) for name, declared in TINY_LIMITS.items()
}
BUILTIN_LIMITS["default"] = BUILTIN_LIMITS["tiny"]


def announced_limits(node: Mapping[str, Any]) -> dict[str, PipelineLimits]:
    """Per pipeline a node serves, the limits its heartbeat announces (none: schema ranges only)."""
    announced = node.get("limits")
    per_pipeline = announced if isinstance(announced, Mapping) else {}
    limits = {}
    for name in node.get("pipelines", []):
        declared = per_pipeline.get(name)
        parsed = PipelineLimits.from_dict(declared if isinstance(declared, Mapping) else {})
        limits[str(name)] = parsed
    return limits


def declared_limits(pipeline: str, announced: list[PipelineLimits]) -> list[PipelineLimits]:
    """The limits a request for `pipeline` is held to: the live nodes', else a built-in's."""
    if announced:
        return announced
    builtin = BUILTIN_LIMITS.get(pipeline)
    return [builtin] if builtin is not None else []


# The schema's global bounds a pipeline may declare lower: the field, the limit that lowers it.
SCHEMA_BOUNDED_FIELDS = {
    "width": "max_width",
    "height": "max_height",
    "steps": "max_steps",
    "num_frames": "max_frames",
}
_LARGEST_QUOTED = 2**63  # a value past it is quoted by the schema's own message, not restated


def tighter_bound(
    pipeline: str, candidates: list[PipelineLimits], field: str, value: object
) -> LimitViolation | None:
    """The pipeline's refusal of `value`, past the schema's bound on `field`, when it declares less.

    The schema refuses `--width 100000` with its global bound (4096) before any pipeline check
    runs; a pipeline whose nodes all declare a lower one (1024) is the limit the caller must
    meet, so that is the one named. None when no candidate declares one below the schema's.
    """
    limit = SCHEMA_BOUNDED_FIELDS.get(field)
    if limit is None or not candidates or type(value) is not int or value >= _LARGEST_QUOTED:
        return None
    widest = max(candidates, key=lambda limits: getattr(limits, limit))
    most = getattr(widest, limit)
    if value <= most or most >= getattr(PipelineLimits(), limit):
        return None
    rule = widest.frame_rule() if field == "num_frames" else f"{field} ≤ {most}"
    return LimitViolation(pipeline, field, limit, f"{pipeline} takes {rule}; got {value}", value)


def first_violation(
    pipeline: str, candidates: list[PipelineLimits], request: RequestShape
) -> LimitViolation | None:
    """None when some candidate (one per live node) takes the request, else the first refusal."""
    # No candidates: nothing is known about the pipeline, the schema's ranges are all there is.
    violations = [limits.violation(pipeline, request) for limits in candidates]
    if not violations or any(v is None for v in violations):
        return None
    return violations[0]
