"""A job's denoising state at a step boundary, as bytes a later attempt can resume from.

`DenoiseState` is what a run holds between two steps: the latents, the scheduler's whole mutable
state (step index, sigmas/timesteps, a multistep solver's history such as DPM-Solver's
`model_outputs`/`lower_order_nums`), the state of every random generator the loop draws from
(or, for a `python:` pipeline, whatever its `save_state` hook returns, as `loop`), and the steps
done, tagged with the `identity` of the run that made it (weights, LoRA set, speed
mode, dtype, scheduler, and the request's own fields). `encode` turns it into one object:

    b"KILNCKPT" | header length (4 bytes, big-endian) | header (JSON) | payload (torch.save)

The header says the format version, the identity, the steps done and the payload's size and
sha256; the payload is a `torch.save` of plain tensors, lists, dicts and numbers, read back with
`weights_only=True` (no pickled code runs). `decode` refuses, with `CheckpointRefused` and a
reason, anything that is not exactly that: another magic, a truncated or altered payload, an
unknown version, a payload that does not load safely or lacks a part.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

MAGIC = b"KILNCKPT"
FORMAT_VERSION = 1
_LENGTH_BYTES = 4
_MAX_HEADER = 64 * 1024  # a header is a few hundred bytes; more is not ours


class CheckpointRefused(ValueError):
    """A checkpoint that cannot be resumed from; the message says why."""


class NotCheckpointable(Exception):
    """A run whose state cannot be captured (a value of a kind a checkpoint cannot hold)."""


def cpu_state(value: Any, where: str) -> Any:
    """`value` as torch.save's safe loader reads it back: tensors on the CPU, lists, numbers.

    Dicts keep their string keys; tuples become lists. Anything else is NotCheckpointable,
    named by `where`.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (list, tuple)):
        return [cpu_state(item, f"{where}[]") for item in value]
    if isinstance(value, Mapping):
        if not all(isinstance(key, str) for key in value):
            raise NotCheckpointable(f"{where} has a key that is not a string")
        return {key: cpu_state(item, f"{where}.{key}") for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise NotCheckpointable(f"{where} is a {type(value).__name__}")


def identity_digest(identity: Mapping[str, str]) -> str:
    """sha256 of an identity's canonical JSON: equal digests, equal identities."""
    canonical = json.dumps(dict(identity), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass
class DenoiseState:
    """Everything a denoising loop carries from one step to the next, on the CPU.

    `scheduler` maps the scheduler's attribute names to their values (tensors, lists of tensors,
    numbers, None); `generators` holds each generator's `get_state()`, in the order the call
    was given them.
    """

    identity: dict[str, str]
    steps_done: int
    total_steps: int
    latents: torch.Tensor
    scheduler: dict[str, Any] = field(default_factory=dict)
    generators: list[torch.Tensor] = field(default_factory=list)
    loop: dict[str, Any] = field(default_factory=dict)  # a `python:` pipeline's own state

    def header(self, payload: bytes) -> dict[str, Any]:
        """The JSON header written before `payload`."""
        return {
            "format": FORMAT_VERSION,
            "identity": self.identity,
            "identity_sha256": identity_digest(self.identity),
            "steps_done": self.steps_done,
            "total_steps": self.total_steps,
            "payload_bytes": len(payload),
            "payload_sha256": hashlib.sha256(payload).hexdigest(),
        }


def encode(state: DenoiseState) -> bytes:
    """The checkpoint object's bytes (see the module's docstring for the layout)."""
    buffer = io.BytesIO()
    torch.save(
        {
            "latents": state.latents,
            "scheduler": state.scheduler,
            "generators": state.generators,
            "loop": state.loop,
        },
        buffer,
    )
    payload = buffer.getvalue()
    header = json.dumps(state.header(payload), sort_keys=True).encode()
    return MAGIC + len(header).to_bytes(_LENGTH_BYTES, "big") + header + payload


def read_header(data: bytes) -> tuple[dict[str, Any], bytes]:
    """The header and payload of a checkpoint object, both checked; else CheckpointRefused."""
    start = len(MAGIC) + _LENGTH_BYTES
    if len(data) < start or not data.startswith(MAGIC):
        raise CheckpointRefused("not a Kiln checkpoint (no KILNCKPT magic)")
    size = int.from_bytes(data[len(MAGIC) : start], "big")
    if size > _MAX_HEADER or len(data) < start + size:
        raise CheckpointRefused(f"truncated: header of {size} bytes, object of {len(data)}")
    try:
        header = json.loads(data[start : start + size])
    except ValueError as exc:
        raise CheckpointRefused(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
        found = header.get("format") if isinstance(header, dict) else None
        raise CheckpointRefused(f"format {found!r}, this node reads {FORMAT_VERSION}")
    payload = data[start + size :]
    if len(payload) != header.get("payload_bytes"):
        raise CheckpointRefused(
            f"truncated: payload of {len(payload)} bytes, header says {header.get('payload_bytes')}"
        )
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise CheckpointRefused("payload sha256 differs from the header's: altered or corrupt")
    return header, payload


def decode(data: bytes, identity: Mapping[str, str]) -> DenoiseState:
    """The state in `data`, made by a run of `identity`; CheckpointRefused otherwise."""
    header, payload = read_header(data)
    if header.get("identity_sha256") != identity_digest(identity):
        theirs = header.get("identity")
        differing = sorted(
            name
            for name in set(identity) | set(theirs if isinstance(theirs, dict) else {})
            if not isinstance(theirs, dict) or theirs.get(name) != identity.get(name)
        )
        raise CheckpointRefused(f"another pipeline identity (differs in: {', '.join(differing)})")
    try:
        loaded = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # whatever unpickling refuses is a refusal, not a crash
        raise CheckpointRefused(f"payload does not load safely: {type(exc).__name__}") from None
    if not isinstance(loaded, dict) or not isinstance(loaded.get("latents"), torch.Tensor):
        raise CheckpointRefused("payload lacks the latents")
    scheduler, generators = loaded.get("scheduler"), loaded.get("generators")
    if not isinstance(scheduler, dict) or not isinstance(generators, list):
        raise CheckpointRefused("payload lacks the scheduler or generator state")
    loop = loaded.get("loop", {})  # absent in checkpoints written before python: hooks
    if not isinstance(loop, dict):
        raise CheckpointRefused("payload's loop state is not a mapping")
    steps_done, total = header.get("steps_done"), header.get("total_steps")
    if not isinstance(steps_done, int) or not isinstance(total, int) or not 0 < steps_done < total:
        raise CheckpointRefused(f"steps done {steps_done!r} of {total!r} is no resumable point")
    return DenoiseState(
        identity=dict(identity),
        steps_done=steps_done,
        total_steps=total,
        latents=loaded["latents"],
        scheduler=scheduler,
        generators=generators,
        loop=loop,
    )
