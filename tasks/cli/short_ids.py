"""Short ids on the command line: any unique prefix of a job or batch id, as docker takes them.

An id that exists is used as given. Otherwise one of `MIN_ID_PREFIX` or more characters is looked
up (`GET /v1/jobs?id_prefix=`, or the id indexes in Redis): one match is the id, several are a
usage error that lists them, none leaves the id as given for the command to report as unknown.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kiln.storage.keys import MIN_ID_PREFIX
from kiln.tasks.cli.exits import UsageError

CANDIDATES_SHOWN = 10
JOB_ID_HELP = f"a job id, or any unique prefix of it ({MIN_ID_PREFIX}+ characters)"
BATCH_ID_HELP = f"a batch id, or any unique prefix of it ({MIN_ID_PREFIX}+ characters)"


class AmbiguousId(UsageError):
    """A prefix that starts more than one id; the message lists them."""


def resolve_id(
    kind: str,
    given: str,
    exists: Callable[[str], bool],
    starting_with: Callable[[str, int], Sequence[str]],
) -> str:
    """The full id `given` stands for (see the module docstring).

    `exists(id)`: whether that very id exists; `starting_with(prefix, limit)`: up to `limit` ids
    that start with `prefix`, newest first.
    """
    if exists(given):
        return given
    if len(given) < MIN_ID_PREFIX:
        raise UsageError(
            f"no such {kind}: {given} (a short id needs at least {MIN_ID_PREFIX} characters)"
        )
    # only true matches count, whatever a server answers
    found = [i for i in starting_with(given, CANDIDATES_SHOWN + 1) if i.startswith(given)]
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        shown = found[:CANDIDATES_SHOWN]
        more = ", ..." if len(found) > CANDIDATES_SHOWN else ""
        raise AmbiguousId(
            f"{kind} id prefix {given!r} is ambiguous; it starts: {', '.join(shown)}{more}"
        )
    return given
