"""What `kiln worker` is asked to run: its options, parsed and checked before anything starts.

Refusals are ValueErrors naming the flag (the CLI prints them as one line), raised while the
options are built: before Celery or any rank starts. In order: the pipelines (`check_pipelines`:
each spec's form, the worker extra installed, each `python:` spec's module imported and its
factory looked at), the sleep and warm-up flags, then the devices (which loads torch). A
webhooks-only worker checks none of it and never loads torch.

This module loads nothing heavy itself (no torch, Celery, Redis or settings classes): `kiln
worker` runs `check_pipelines` right after parsing its arguments, so that a pipeline it cannot
serve is refused before the rest of the worker is even imported.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kiln.common.defaults import BATCH_WINDOW_S, MAX_BATCH
from kiln.common.distribution import WORKER_EXTRA
from kiln.common.request import Lane

# The lanes in priority order, as `tasks.queue.lanes.LANES` has them (that module loads the
# settings classes, so it is imported only where queues are named).
_LANES: tuple[str, ...] = tuple(Lane)


@dataclass(frozen=True)
class WorkerOptions:
    """What `kiln worker` was asked to run."""

    pipelines: dict[str, str] = field(default_factory=dict)
    devices: str = "cpu:1"
    lanes: tuple[str, ...] = _LANES
    max_batch: int = MAX_BATCH
    batch_window_ms: float = BATCH_WINDOW_S * 1000
    parallel: str = "auto"
    concurrency: int | None = None
    webhooks: bool = False
    node_id: str | None = None
    loglevel: str = "INFO"
    group_size: int | None = None  # ranks per replica group; None: one group over every device
    # Over the KILN_ settings of the same names when given (gpu_worker/settings.py).
    idle_sleep_s: float | None = None
    sleep_mode: str | None = None
    compile: bool | None = None
    warmup: tuple[str, ...] = ()
    lora_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.pipelines:  # a webhooks-only worker has no group, and must not import torch
            check_pipelines(self.pipelines)
            check_sleep_and_warmup(self.idle_sleep_s, self.warmup)
            check_group_options(self.devices, self.parallel, self.group_size)


# What a node imports that the base install lacks: all of them come with WORKER_EXTRA.
WORKER_MODULES = ("torch", "numpy", "PIL", "imageio", "diffusers", "transformers")


def check_pipelines(pipelines: Mapping[str, str]) -> None:
    """Refuse, naming the flag, a pipeline the node could not serve; loads no torch of its own.

    Each spec's form (and a diffusers folder), the model libraries installed, then each
    `python:` module imported and its factory looked at. Only what a user's module imports
    itself is loaded (a checked module stays imported: the ranks import it again, each).
    """
    check_pipeline_forms(pipelines)
    require_worker_extra()
    check_pipeline_imports(pipelines)


def require_worker_extra() -> None:
    """Refuse, naming the extra to install, a node on an install without the model libraries."""
    missing = [name for name in WORKER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f"--pipeline: serving a pipeline needs {', '.join(missing)}, which this install "
            f"lacks; pip install '{WORKER_EXTRA}'"
        )


def check_pipeline_forms(pipelines: Mapping[str, str]) -> None:
    """Refuse, naming the flag, a spec of no known form or a diffusers folder that is not one."""
    from kiln.gpu_worker.pipeline_specs import check_spec_form  # plain parsing, no torch

    for name, spec in pipelines.items():
        try:
            check_spec_form(spec)
        except ValueError as exc:
            raise ValueError(f"--pipeline {name}: {exc}") from exc


def check_pipeline_imports(pipelines: Mapping[str, str]) -> None:
    """Refuse, naming the flag, a `python:` spec whose module or factory cannot serve.

    The module is imported here, in the worker's own process and working directory (ranks then
    import it alike); the factory is looked at, not called: that would load the model.
    """
    from kiln.gpu_worker.pipeline_specs import check_python_spec, parse_spec  # no torch

    for name, spec in pipelines.items():
        parsed = parse_spec(spec)
        if parsed.kind != "python":
            continue
        try:
            check_python_spec(parsed)
        except ValueError as exc:
            raise ValueError(f"--pipeline {name}: {exc}") from exc


def check_sleep_and_warmup(idle_sleep_s: float | None, warmup: Sequence[str]) -> None:
    """Refuse, naming the flag, a non-positive idle time and a malformed warm-up shape."""
    from kiln.gpu_worker.warmup import parse_warmup_shape  # plain parsing, no torch

    if idle_sleep_s is not None and not idle_sleep_s > 0:
        raise ValueError(f"--idle-sleep-s {idle_sleep_s}: must be a positive number of seconds")
    for text in warmup:
        try:
            parse_warmup_shape(text)
        except ValueError as exc:
            raise ValueError(f"--warmup {text}: {exc}") from exc


def check_group_options(devices: str, parallel: str, group_size: int | None = None) -> None:
    """Refuse, naming the flag, devices this machine lacks and a parallel mode that wastes them.

    Raised while the options are built, before Celery or any rank starts (ValueError: the CLI
    prints it as one line).
    """
    from kiln.gpu_worker.config import check_devices, check_parallel
    from kiln.gpu_worker.parallel import ParallelSpec

    try:
        world = check_devices(split_devices(devices))
    except ValueError as exc:
        raise ValueError(f"--devices {devices}: {exc}") from exc
    if group_size is not None and (group_size < 1 or len(world) % group_size):
        raise ValueError(
            f"--group-size {group_size}: {len(world)} device(s) do not split into groups of that "
            "many ranks"
        )
    try:  # the ranks of one group share its jobs
        check_parallel(ParallelSpec(mode=parallel), group_size or len(world))  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"--parallel {parallel}: {exc}") from exc


def split_devices(devices: str) -> list[str]:
    """`cuda:0, cuda:1` → ['cuda:0', 'cuda:1']."""
    return [device.strip() for device in devices.split(",")]


def parse_pipelines(values: Sequence[str]) -> dict[str, str]:
    """`tiny` → {tiny: tiny}; `default=tiny` → {default: tiny}; `x=diffusers:/m` likewise."""
    pipelines: dict[str, str] = {}
    for value in values:
        name, sep, spec = value.partition("=")
        if not sep:
            spec = name
            name = name.split(":", 1)[0] if name.startswith(("diffusers:", "python:")) else name
        if not name or not spec:
            raise ValueError(f"--pipeline {value!r}: expected NAME or NAME=SPEC")
        pipelines[name] = spec
    return pipelines


def parse_lanes(value: str) -> tuple[str, ...]:
    """`interactive,bulk` → lanes, refusing unknown names."""
    lanes = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = [lane for lane in lanes if lane not in _LANES]
    if unknown or not lanes:
        raise ValueError(f"--queues: unknown lane(s) {unknown}; use {', '.join(_LANES)}")
    return lanes


def worker_queues(options: WorkerOptions) -> list[str]:
    """The queues this worker consumes, in priority order."""
    from kiln.tasks.queue.lanes import WEBHOOKS_QUEUE, node_queues

    queues = node_queues(options.lanes, list(options.pipelines))
    if options.webhooks or not options.pipelines:
        queues.append(WEBHOOKS_QUEUE)
    return queues
