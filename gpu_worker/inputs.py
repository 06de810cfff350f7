"""What a pipeline declares it takes: an input schema (JSON Schema), beside its limits.

Plain, torch-free data. A pipeline may define `input_schema() -> InputSchema` (optional in the
`Pipeline` protocol, like `limits()`): a JSON Schema object whose properties are the pipeline's
inputs under its own names. A property with `x-kiln-field` is one of Kiln's request fields under
the pipeline's name (`num_inference_steps` is the request's `steps`); every other property is an
extra input, which a request carries in `inputs` and the node passes to the pipeline
(`GenerationRequest.extra_inputs`). `x-kiln-image: true` marks an image reference (a URL or an
uploaded object); the node fetches it and hands the ranks its bytes (`gpu_worker.images`).

Rank 0 reports each pipeline's schema to the group's owner together with its limits, the node
announces it in its heartbeat under `inputs`, and the API validates a request's `inputs` against
it (`tasks.contract.inputs`). The schema's marks and the request fields are
`kiln.common.request`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kiln.common.request import FIELD_KEY, IMAGE_KEY, InputSchema, InputValue


def declared_input_schema(pipeline: object) -> InputSchema | None:
    """What `pipeline.input_schema()` declares (a JSON-safe copy); None without `input_schema`."""
    declare = getattr(pipeline, "input_schema", None)
    if declare is None:
        return None
    schema = declare()
    if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
        raise ValueError("input_schema() must return a JSON Schema object with `properties`")
    copied: InputSchema = json.loads(json.dumps(schema))  # raises for what JSON cannot carry
    return copied


def extra_input_names(schema: Mapping[str, Any]) -> frozenset[str]:
    """The extra inputs of a schema: its properties that are not Kiln request fields."""
    properties = schema.get("properties", {})
    return frozenset(
        name
        for name, prop in properties.items()
        if not (isinstance(prop, Mapping) and FIELD_KEY in prop)
    )


def image_input_names(schema: Mapping[str, Any]) -> frozenset[str]:
    """The properties of a schema that are image references."""
    properties = schema.get("properties", {})
    return frozenset(
        name
        for name, prop in properties.items()
        if isinstance(prop, Mapping) and prop.get(IMAGE_KEY) is True
    )


def inputs_key(extra_inputs: Mapping[str, InputValue]) -> str:
    """A canonical text of extra inputs: equal inputs, equal text (part of a batch key)."""
    if not extra_inputs:
        return ""
    return json.dumps(dict(extra_inputs), sort_keys=True, separators=(",", ":"))


def extra_inputs_refusal(
    pipeline: str, schema: Mapping[str, Any] | None, extra_inputs: Mapping[str, InputValue]
) -> str | None:
    """Why a pipeline with this schema cannot take these extra inputs (names only); else None.

    Values are validated against the schema before a request reaches a rank (the API, the
    Submitter and the node all run `tasks.contract.inputs`); ranks check only that every name is
    an extra input the pipeline declares, so nothing undeclared is ever passed to a pipeline.
    """
    if not extra_inputs:
        return None
    if schema is None:
        name = next(iter(extra_inputs))
        return f"inputs.{name}: {pipeline} declares no inputs besides the request fields"
    allowed = extra_input_names(schema)
    for name in extra_inputs:
        if name not in allowed:
            return f"inputs.{name}: {pipeline} takes no such input; it takes {sorted(allowed)}"
    return None
