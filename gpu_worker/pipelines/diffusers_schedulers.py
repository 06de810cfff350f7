"""The `scheduler` input: a diffusers pipeline's compatible schedulers, swapped in per batch.

The choices are the class names of the schedulers the pipeline's own scheduler lists as
compatible (`compatibles`) that can be built from its config here; each is built once, from the
default's config, and set on the pipeline only for the batch that asked for it.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

SCHEDULER_INPUT = "scheduler"


def compatible_schedulers(scheduler: Any) -> dict[str, Any]:
    """Class name → class of the schedulers `scheduler` is compatible with, its own first.

    Only those that can be built from its config and set their timesteps here: a compatible
    class whose optional dependency is missing (scipy, torchsde) is left out.
    """
    if scheduler is None:
        return {}
    found: dict[str, Any] = {type(scheduler).__name__: type(scheduler)}
    with quiet_diffusers():
        for cls in sorted(getattr(scheduler, "compatibles", []), key=lambda c: c.__name__):
            try:
                cls.from_config(scheduler.config).set_timesteps(4)
            except Exception:  # a scheduler that cannot be built here is not offered
                continue
            found.setdefault(cls.__name__, cls)
    return found


@contextlib.contextmanager
def quiet_diffusers() -> Iterator[None]:
    """Only errors from diffusers' loggers inside (building a scheduler warns about its keys)."""
    logger = logging.getLogger("diffusers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():  # numpy deprecations inside schedulers' own setup
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


class SchedulerChoice:
    """The schedulers one loaded pipeline offers, and the swap around a batch's call."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self._default: Any = getattr(pipe, "scheduler", None)
        self._classes: dict[str, Any] | None = None  # found on first use
        self._built: dict[str, Any] = {}  # built from the default's config, kept

    def names(self) -> list[str]:
        """The class names a request may give, the pipeline's own first."""
        return list(self._compatible())

    def refusal(self, extra_inputs: Mapping[str, Any]) -> str | None:
        """Why the request's `scheduler` cannot be used; None when it can (or names none)."""
        wanted = extra_inputs.get(SCHEDULER_INPUT)
        if wanted is None or wanted in self._compatible():
            return None
        return f"inputs.{SCHEDULER_INPUT}: {wanted!r} is not one of {sorted(self._compatible())}"

    @contextlib.contextmanager
    def applied(self, extra_inputs: Mapping[str, Any]) -> Iterator[None]:
        """Swap in the scheduler a batch asks for; the default is back afterwards."""
        wanted = extra_inputs.get(SCHEDULER_INPUT)
        if wanted is None or wanted == type(self._default).__name__:
            yield
            return
        scheduler = self._built.get(str(wanted))
        if scheduler is None:
            cls = self._compatible()[str(wanted)]
            with quiet_diffusers():
                scheduler = cls.from_config(self._default.config)
            self._built[str(wanted)] = scheduler
        self._pipe.scheduler = scheduler
        try:
            yield
        finally:
            self._pipe.scheduler = self._default

    def _compatible(self) -> dict[str, Any]:
        if self._classes is None:
            self._classes = compatible_schedulers(self._default)
        return self._classes
