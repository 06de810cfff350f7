"""Job states as the contract shows them: the state machine's own enum, re-exported.

`storage/states.py` is the one definition (its table is what the Lua scripts apply); the job view,
the API, the client and the CLI take states from here. It needs only the standard library, and so
does `storage/__init__.py`: importing this module loads no Redis client (the client relies on it;
tests/tasks/test_one_definition.py checks).
"""

from __future__ import annotations

from kiln.storage.states import TERMINAL_STATES, JobState

__all__ = ["TERMINAL_STATES", "JobState", "is_terminal"]


def is_terminal(status: str) -> bool:
    """Whether a job status, or a job event's type, is final: nothing follows it.

    Takes plain strings too (a JSON body, an event type): a `JobState` hashes as its value.
    """
    return status in TERMINAL_STATES
