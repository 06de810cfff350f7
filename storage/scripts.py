"""The Lua scripts in storage/lua/: read, assembled with their prelude, registered per client.

Each `<name>.lua` is one script; files whose name starts with `_` are libraries. A script's source
as Redis sees it is the state names (`state_names`: tables made from kiln/common/states.py, so no
script spells a state itself), `_prelude.lua`, then the libraries its header includes, then the
script run as a function under pcall, whose errors leave as error replies (see `source`).

A script starts with a header of `--` lines: what it does and returns, `-- include: _lib` lines,
one `-- KEYS[i] = what` line per key it touches and one `-- ARGV[i] = what` line per argument
(`KEYS[i..]` / `ARGV[i..]`: a list of any length from there on). Right after the header a block of
`local` lines names them (`local job_id = ARGV[1]`); KEYS and ARGV are read nowhere else. Every key
name comes from storage/keys.py. Where a script cannot be handed a key (the id comes from Redis,
or from a list the script decodes), it gets the key's prefix from keys.py in ARGV, and its header
says why. Calls are checked against the header: a call with another number of keys or arguments
is a bug and raises ValueError before reaching Redis.

Scripts run through redis-py's `Script`: by sha, loaded on NOSCRIPT, and loaded before a
pipeline that queues them executes. Where that check (a SCRIPT EXISTS round trip per pipeline)
costs too much, `queue_by_sha` and `first_lost_script` run a pipeline of scripts by sha alone,
loading them only once Redis answers NOSCRIPT.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from typing import TYPE_CHECKING, Any, Literal, get_args

from redis.exceptions import NoScriptError

from kiln.common.states import TERMINAL_STATES, BatchStatus, JobState

if TYPE_CHECKING:
    import redis
    import redis.asyncio.client
    from redis.client import Pipeline

ScriptName = Literal[
    "transition",
    "cancel",
    "pause",
    "resume",
    "paused_past",
    "reap",
    "progress",
    "live_event",
    "create",
    "create_many",
    "acquire",
    "hold",
    "renew",
    "release",
    "mark_published",
    "webhook_attempt",
    "reap_lapsed",
    "unpublished",
    "publish_node",
    "live_nodes",
    "prune_indexes",
    "apikey_create",
    "apikey_revoke",
    "queue_snapshot",
    "batch_submit",
    "batch_lease",
    "batch_fed",
    "batch_reported",
    "batch_stop",
    "batch_finish",
    "batch_pause",
    "held_record",
    "held_claim",
    "held_jobs",
    "audit_claim",
    "backlog",
    "surplus_claim",
    "dead_letter_claim",
    "checkpoint",
    "preempt_request",
    "preempted",
]
SCRIPT_NAMES: tuple[ScriptName, ...] = get_args(ScriptName)
PRELUDE = "_prelude"

_DECLARATION = re.compile(r"-- (KEYS|ARGV)\[(\d+)(\.\.)?\] = \S")
_INCLUDE = re.compile(r"-- include: (_\w+)$")


@dataclass(frozen=True)
class Arity:
    """How many KEYS or ARGV entries a script declares: `fixed`, then a list if `more`."""

    fixed: int
    more: bool

    def accepts(self, count: int) -> bool:
        """True if a call may pass `count` entries."""
        return count >= self.fixed if self.more else count == self.fixed

    def __str__(self) -> str:
        return f"at least {self.fixed}" if self.more else str(self.fixed)


@dataclass(frozen=True)
class Header:
    """What a script's header declares."""

    keys: Arity
    args: Arity
    includes: tuple[str, ...]


def lua_dir() -> Traversable:
    """The folder of the .lua files (package data of kiln.storage)."""
    return resources.files("kiln.storage") / "lua"


@functools.cache
def read(name: str) -> str:
    """The text of `<name>.lua` as stored."""
    return (lua_dir() / f"{name}.lua").read_text(encoding="utf-8")


def header_lines(text: str) -> list[str]:
    """The leading `--` lines of a script."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        lines.append(line)
    return lines


def _arity(name: str, what: str, numbers: list[tuple[int, bool]]) -> Arity:
    if [n for n, _ in numbers] != list(range(1, len(numbers) + 1)):
        raise ValueError(f"{name}.lua: {what} must be declared as {what}[1], {what}[2], ...")
    if any(more for _, more in numbers[:-1]):
        raise ValueError(f"{name}.lua: only the last {what} entry may be a list ({what}[i..])")
    if numbers and numbers[-1][1]:
        return Arity(len(numbers) - 1, True)
    return Arity(len(numbers), False)


@functools.cache
def header(name: str) -> Header:
    """Parse the header of `<name>.lua`; ValueError if it is malformed."""
    declared: dict[str, list[tuple[int, bool]]] = {"KEYS": [], "ARGV": []}
    includes = []
    for line in header_lines(read(name)):
        if match := _DECLARATION.match(line):
            declared[match[1]].append((int(match[2]), bool(match[3])))
        elif match := _INCLUDE.match(line):
            includes.append(match[1])
    return Header(
        keys=_arity(name, "KEYS", declared["KEYS"]),
        args=_arity(name, "ARGV", declared["ARGV"]),
        includes=tuple(includes),
    )


# A script's own text runs as a function under pcall, and `reply_of` (_prelude.lua) returns what
# it raised as `redis.error_reply`: the only error every supported Redis (6.2 on) passes on as
# the script said it, so `KILN_<CODE>` reaches storage/boundary.py whichever version runs it.
_BODY_OPEN = "local function script_body()"
_BODY_CLOSE = "end\nreturn reply_of(pcall(script_body))"


def _lua_names(table: str, names: Sequence[str], what: str) -> str:
    # a name that is none (a typo) raises instead of reading as nil, which would compare unequal
    members = ", ".join(f"{name} = '{name}'" for name in names)
    strict = f"function(_, name) error('no {what} ' .. tostring(name)) end"
    return f"local {table} = setmetatable({{{members}}}, {{__index = {strict}}})"


@functools.cache
def state_names() -> str:
    """The Lua lines that name the states, from kiln.common.states: `S`, `B` and `TERMINAL`."""
    terminal = ", ".join(f"{state} = true" for state in JobState if state in TERMINAL_STATES)
    return "\n".join(
        [
            "-- state names, from kiln/common/states.py (storage/scripts.py writes these lines)",
            _lua_names("S", list(JobState), "job state"),
            _lua_names("B", list(BatchStatus), "batch status"),
            f"local TERMINAL = {{{terminal}}}",
        ]
    )


@functools.cache
def source(name: ScriptName) -> str:
    """The script as Redis runs it: state names, prelude, included libraries, then the script."""
    libraries = [read(part) for part in (PRELUDE, *header(name).includes)]
    return "\n".join([state_names(), *libraries, _BODY_OPEN, read(name), _BODY_CLOSE])


@functools.cache
def sha(name: ScriptName) -> str:
    """The sha1 Redis names the script by."""
    return hashlib.sha1(source(name).encode()).hexdigest()


def check_call(name: ScriptName, keys: Sequence[str], args: Sequence[Any]) -> None:
    """ValueError unless the call passes as many KEYS and ARGV as the script's header declares."""
    declared = header(name)
    for what, arity, given in (("KEYS", declared.keys, keys), ("ARGV", declared.args, args)):
        if not arity.accepts(len(given)):
            raise ValueError(f"{name}.lua takes {arity} {what}, not {len(given)}")


# (script, KEYS, ARGV): one script run of a pipeline
ScriptCall = tuple[ScriptName, list[str], list[Any]]


def queue_by_sha(
    pipe: Pipeline[str] | redis.asyncio.client.Pipeline[str], calls: Sequence[ScriptCall]
) -> None:
    """Queue each call on `pipe` as EVALSHA, checked against its header, without SCRIPT EXISTS."""
    for name, keys, args in calls:
        check_call(name, keys, args)
        pipe.evalsha(sha(name), len(keys), *keys, *args)


def first_lost_script(replies: Sequence[Any]) -> int | None:
    """Where a by-sha pipeline's replies first say NOSCRIPT (load, rerun from there); None: all ran.

    A failure before that is raised: the scripts up to it ran, so it is the caller's to see.
    """
    for index, reply in enumerate(replies):
        if isinstance(reply, NoScriptError):
            return index
        if isinstance(reply, Exception):
            raise reply
    return None


class Script:
    """One script registered with a client; calls are checked against the script's header."""

    def __init__(self, client: redis.Redis[str], name: ScriptName) -> None:
        self.name = name
        self.header = header(name)
        self._script = client.register_script(source(name))

    def __call__(
        self, keys: Sequence[str], args: Sequence[Any], client: Pipeline[str] | None = None
    ) -> Any:
        """Run the script (or queue it on the pipeline `client`) and return its reply."""
        check_call(self.name, keys, args)
        return self._script(keys=keys, args=args, client=client)


class Scripts:
    """The scripts of one client, each registered when first asked for."""

    def __init__(self, client: redis.Redis[str]) -> None:
        self._client = client
        self._registered: dict[ScriptName, Script] = {}

    def __getitem__(self, name: ScriptName) -> Script:
        script = self._registered.get(name)
        if script is None:
            script = self._registered[name] = Script(self._client, name)
        return script
