"""A request's `inputs`: the pipeline's own arguments, checked against the schema it announces.

Each pipeline may declare an input schema on its ranks (`gpu_worker.inputs`): a JSON Schema
object whose properties are its inputs under its own names. Nodes announce the schemas in their
heartbeat under `inputs`, keyed by pipeline name. Torch-free and gpu_worker-free: the API process
imports this module, so the JSON keys are the contract.

Two kinds of names may appear in a request's `inputs`:

- request fields under a pipeline's name (`num_inference_steps` is `steps`;
  `kiln.common.request.REQUEST_FIELDS`):
  `JobRequest` lifts them into their top-level fields when it is built, and refuses one whose
  field is also given at the top level (`input_conflict`). Other request fields (`fps`,
  `priority`, ...) belong at the top level only (`request_field`).
- extra inputs (`scheduler`, `strength`, `eta`, ...): validated here against the schema a live
  node announces for the pipeline (`pipeline_input`, or `unknown_input` for a name it does not
  declare). A request is accepted when any live node's schema takes it. While no live node
  announces a schema for the pipeline, a request with extra inputs is refused: nothing is known
  that could check them.

The validator implements the subset of JSON Schema the pipelines use: on the object,
`properties`, `required` and `additionalProperties: false` (always applied) here, and each scalar
value's keywords in `contract.input_values`. Other keywords are annotations. `x-kiln-field` marks
a request field, `x-kiln-image` an image reference (`contract.image_refs`: `upload:<id>` or a
URL; only its form is checked here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

from kiln.common.request import FIELD_KEY, IMAGE_KEY, REQUEST_FIELDS, InputSchema
from kiln.tasks.contract.image_refs import parse_image_ref
from kiln.tasks.contract.input_values import value_violation

ERROR_TYPE = "pipeline_input"
UNKNOWN_TYPE = "unknown_input"
CONFLICT_TYPE = "input_conflict"
REQUEST_FIELD_TYPE = "request_field"
# The input of img2img, inpaint and video-to-video pipelines that says which share of `steps`
# denoises: diffusers runs int(steps * strength) of them, and none at all fails the forward.
STRENGTH_INPUT = "strength"


@dataclass(frozen=True)
class InputViolation:
    """Why a pipeline refuses a request's inputs: the input at fault, the rule, a message."""

    pipeline: str
    name: str | None  # None: the inputs as a whole (a required input is missing)
    rule: str  # the schema keyword broken (`maximum`, `enum`, ...), `unknown`, `image`, ...
    message: str
    value: Any
    known: tuple[str, ...] = ()  # for an unknown name: the inputs the pipeline takes
    fields: tuple[str, ...] = ()  # a rule over several fields: every one of them

    @property
    def kind(self) -> str:
        """The error type: `unknown_input` for a name not declared, else `pipeline_input`."""
        return UNKNOWN_TYPE if self.rule in ("unknown", "undeclared") else ERROR_TYPE

    def loc(self, prefix: tuple[str | int, ...] = ()) -> tuple[str | int, ...]:
        """Where the error points, after `prefix` (("body",) for the API)."""
        return (*prefix, "inputs", self.name) if self.name else (*prefix, "inputs")

    def describe(self) -> str:
        """One line for a job's error: the input, then the message."""
        return f"inputs.{self.name}: {self.message}" if self.name else f"inputs: {self.message}"

    def context(self) -> dict[str, Any]:
        """The error's `ctx`: which rule of which pipeline (and the known inputs, if unknown)."""
        ctx: dict[str, Any] = {"pipeline": self.pipeline, "rule": self.rule}
        if self.known or self.kind == UNKNOWN_TYPE:
            ctx["known"] = list(self.known)
        if self.fields:
            ctx["fields"] = list(self.fields)
        return ctx


def input_error(
    loc: tuple[str | int, ...], kind: str, message: str, value: Any, ctx: Mapping[str, Any]
) -> ValidationError:
    """A one-line pydantic ValidationError of a custom type, naming `loc`."""
    # The message goes in as context: a literal template would treat braces as placeholders.
    error = PydanticCustomError(kind, "{message}", {"message": message, **ctx})
    line = InitErrorDetails(type=error, loc=loc, input=value)
    return ValidationError.from_exception_data("JobRequest", [line])


def lift_request_fields(data: dict[str, Any], fields: frozenset[str]) -> dict[str, Any]:
    """Move request fields given in `inputs` to the top level (a new dict); raise if both.

    `fields` are the request model's field names; an input named like one that is not an alias
    (`fps`, `priority`) is refused: it is not a pipeline input.
    """
    inputs = data.get("inputs")
    if not isinstance(inputs, Mapping) or not any(
        name in REQUEST_FIELDS or name in fields for name in inputs
    ):
        return data
    lifted = dict(data)
    extra: dict[str, Any] = {}
    for name, value in inputs.items():
        target = REQUEST_FIELDS.get(name)
        if target is None and name in fields:
            message = f"{name!r} is a request field, not a pipeline input; give it at the top level"
            raise input_error(("inputs", name), REQUEST_FIELD_TYPE, message, value, {})
        if target is None:
            extra[name] = value
            continue
        if target in lifted:
            given = "the top-level field" if target in data else "another input"
            message = f"{name!r} is the request field {target!r}, also given as {given}"
            raise input_error(("inputs", name), CONFLICT_TYPE, message, value, {"field": target})
        lifted[target] = value
    lifted["inputs"] = extra
    return lifted


def image_input_names(schema: Mapping[str, Any]) -> frozenset[str]:
    """The properties of a pipeline's input schema that are image references (§2c)."""
    properties = schema.get("properties")
    if not isinstance(properties, Mapping):
        return frozenset()
    return frozenset(
        name
        for name, prop in properties.items()
        if isinstance(prop, Mapping) and prop.get(IMAGE_KEY) is True
    )


def announced_inputs(node: Mapping[str, Any]) -> dict[str, InputSchema]:
    """Per pipeline a node serves, the input schema its heartbeat announces (if any)."""
    announced = node.get("inputs")
    if not isinstance(announced, Mapping):
        return {}
    served = {str(name) for name in node.get("pipelines", [])}
    return {
        str(name): dict(schema)
        for name, schema in announced.items()
        if str(name) in served
        and isinstance(schema, Mapping)
        and isinstance(schema.get("properties"), Mapping)
    }


def first_input_violation(
    pipeline: str,
    schemas: list[InputSchema],
    inputs: Mapping[str, Any],
    steps: int | None = None,
) -> InputViolation | None:
    """None when some schema (one per live node) takes `inputs`, else the first refusal.

    `steps`, when given, is checked with the inputs it works with (`strength`).
    """
    if not inputs:
        return None
    if not schemas:
        name = next(iter(inputs))
        message = (
            f"no live node announces the inputs of {pipeline}; submit without `inputs`, or once "
            "a node serving it is up"
        )
        return InputViolation(pipeline, name, "undeclared", message, inputs[name])
    violations = [input_violation(pipeline, schema, inputs, steps) for schema in schemas]
    if any(v is None for v in violations):
        return None
    return violations[0]


def input_violation(
    pipeline: str, schema: Mapping[str, Any], inputs: Mapping[str, Any], steps: int | None = None
) -> InputViolation | None:
    """The first input `schema` refuses, or None when it takes them all (and `steps`)."""
    properties: Mapping[str, Any] = schema.get("properties") or {}
    extras = tuple(
        sorted(
            name
            for name, prop in properties.items()
            if isinstance(prop, Mapping) and FIELD_KEY not in prop
        )
    )
    for name, value in inputs.items():
        prop = properties.get(name)
        if not isinstance(prop, Mapping) or FIELD_KEY in prop:
            listed = f"its inputs: {', '.join(extras)}" if extras else "it takes no inputs"
            message = f"{pipeline} takes no input {name!r}; {listed}"
            return InputViolation(pipeline, name, "unknown", message, value, extras)
        if prop.get(IMAGE_KEY) is True:
            try:  # the form only; the upload's owner and the URL's host are checked later
                parse_image_ref(value)
            except ValueError as exc:
                return InputViolation(pipeline, name, "image", f"{pipeline}'s {name}: {exc}", value)
            continue
        broken = value_violation(value, prop)
        if broken is not None:
            rule, rule_text = broken
            message = f"{pipeline} takes {name} {rule_text}; got {value!r}"
            return InputViolation(pipeline, name, rule, message, value)
    for name in schema.get("required") or []:
        if name in extras and name not in inputs:
            message = f"{pipeline} needs the input {name!r}"
            return InputViolation(pipeline, None, "required", message, None)
    if steps is not None:
        return denoising_violation(pipeline, properties, inputs, steps)
    return None


def denoising_violation(
    pipeline: str, properties: Mapping[str, Any], inputs: Mapping[str, Any], steps: int
) -> InputViolation | None:
    """Why `steps` and `inputs.strength` (given, or the schema's default) leave no denoising step.

    The pipeline runs int(steps × strength) steps, as diffusers counts them; 0 fails the forward.
    """
    prop = properties.get(STRENGTH_INPUT)
    if not isinstance(prop, Mapping) or FIELD_KEY in prop:
        return None
    strength = inputs.get(STRENGTH_INPUT, prop.get("default"))
    if isinstance(strength, bool) or not isinstance(strength, (int, float)):
        return None
    if int(steps * strength) >= 1:
        return None
    given = "" if STRENGTH_INPUT in inputs else " (its default)"
    message = (
        f"{pipeline} denoises int(steps × inputs.strength) steps: steps {steps} × strength "
        f"{strength:g}{given} leaves none; {_denoising_fix(steps, float(strength))}"
    )
    return InputViolation(
        pipeline,
        STRENGTH_INPUT,
        "denoising_steps",
        message,
        strength,
        fields=("steps", f"inputs.{STRENGTH_INPUT}"),
    )


def _denoising_fix(steps: int, strength: float) -> str:
    if strength <= 0:
        return "give a strength above 0"
    fewest = math.ceil(1 / strength)
    while int(fewest * strength) < 1:  # 1/strength may round below the integer it is
        fewest += 1
    return f"give steps ≥ {fewest} or strength ≥ {1 / steps:g}"
