"""Third-party noise a node would print at every start, none of which a user can act on.

Warnings (`quiet_known_warnings`) and diffusers' and transformers' save and load progress bars
(`quiet_progress_bars`: workers and ranks log to files, where bars are only noise).

Each is filtered by name where it arises (the library's logger or module, its category, the
start of its text), never by a blanket ignore: any other warning of the same libraries still
shows. `quiet_known_warnings` is called by the group's owner before it prepares the pipelines
and by each rank before it loads them (gpu_worker/group_spawn.py, gpu_worker/ranks/process.py).
"""

from __future__ import annotations

import logging
import warnings

# transformers, when diffusers' pipeline modules first name an image processor (CLIP's, SigLIP's)
# without torchvision installed: it falls back to the PIL processor, the class that name meant
# before transformers 5 ("for backward compatibility", in its words). Nothing is missing, and
# installing torchvision only to hide the line is no advice to give.
TORCHVISION_FALLBACK = (
    "transformers.utils.import_utils",
    "`",
    "requires torchvision (not installed)",
)
# diffusers' context-parallel hooks, once per input of the model's plan whose shape is not the one
# the plan expects (a 1-D tensor where it splits 2-D ones): that input is left whole, the result
# is the same, and nothing about it is the user's to change.
UNSPLIT_INPUT = ("diffusers.hooks.context_parallel", "Expected input tensor to have ", "")
# diffusers' context-parallel gather still calls torch's deprecated `all_gather_tensor`: the call
# is diffusers', and works; the day torch removes it, diffusers changes its call.
DEPRECATED_GATHER = (
    r"`torch\.distributed\._functional_collectives\.all_gather_tensor` is deprecated"
)
DEPRECATED_GATHER_MODULE = r"diffusers\.hooks\.context_parallel"


class DropMessage(logging.Filter):
    """Drops the records of one logger whose message starts with `prefix` and holds `part`."""

    def __init__(self, prefix: str, part: str) -> None:
        super().__init__()
        self.prefix, self.part = prefix, part

    def filter(self, record: logging.LogRecord) -> bool:
        """False (dropped) for the one message this filter names."""
        message = record.getMessage()
        return not (message.startswith(self.prefix) and self.part in message)


def quiet_known_warnings() -> None:
    """Install the filters above in this process (idempotent)."""
    for logger_name, prefix, part in (TORCHVISION_FALLBACK, UNSPLIT_INPUT):
        logger = logging.getLogger(logger_name)
        if not any(isinstance(f, DropMessage) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(DropMessage(prefix, part))
    warnings.filterwarnings(
        "ignore", message=DEPRECATED_GATHER, category=FutureWarning, module=DEPRECATED_GATHER_MODULE
    )


def quiet_progress_bars() -> None:
    """Turn diffusers' and transformers' progress bars off in this process (imports both)."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
