"""The rules of storage/lua/: headers declare KEYS and ARGV, every file is used, keys come in.

State names come from kiln/common/states.py too: no script spells one, it reads `S`, `B` and
`TERMINAL`, which storage/scripts.py writes from the enums.

Key names are built in storage/keys.py only; a Lua file that spelled one (`':job:'`) would hide a
writer from anyone grepping keys.py. Every key name has a `:` after the namespace, so no string
literal in a script may contain one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import redis

from kiln.common.states import TERMINAL_STATES, BatchStatus, JobState
from kiln.storage import scripts
from kiln.storage.scripts import PRELUDE, SCRIPT_NAMES, Script, header, header_lines, read
from kiln.storage.settings import StorageSettings

STORAGE = Path(scripts.__file__).parent
LUA_FILES = sorted(path.stem for path in (STORAGE / "lua").glob("*.lua"))
LIBRARIES = [name for name in LUA_FILES if name.startswith("_")]
USE = re.compile(r"\b(KEYS|ARGV)\[(\d+)\]")
STRING_LITERAL = re.compile(r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*\"""")


def naming_block(name: str) -> tuple[list[str], list[str]]:
    """(the lines right after the header up to the first blank line, the lines after those)."""
    lines = read(name).splitlines()[len(header_lines(read(name))) :]
    end = lines.index("") if "" in lines else len(lines)
    return lines[:end], lines[end:]


def code_of(name: str) -> str:
    """The file without its `--` comments (no script has `--` inside a string)."""
    return "\n".join(line.split("--", 1)[0] for line in read(name).splitlines())


def test_every_script_file_is_a_script_name_and_back() -> None:
    assert sorted(SCRIPT_NAMES) == [name for name in LUA_FILES if not name.startswith("_")]
    assert PRELUDE in LIBRARIES


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_header_declares_keys_and_names_arguments(name: str) -> None:
    declared = header(name)  # raises on gaps, or on a list entry that is not the last
    assert declared.keys.fixed >= 1, f"{name}.lua declares no KEYS"
    block, rest = naming_block(name)
    missing = f"{name}.lua: the header must be followed by `local` lines naming KEYS and ARGV"
    assert block, missing
    assert all(line.startswith(("local ", "  ")) for line in block), missing
    rest_code = "\n".join(line.split("--", 1)[0] for line in rest)
    assert not re.search(r"\b(KEYS|ARGV)\b", rest_code), (
        f"{name}.lua reads KEYS or ARGV after its naming block"
    )
    used = {(kind, int(n)) for kind, n in USE.findall("\n".join(block))}
    for kind, arity in (("KEYS", declared.keys), ("ARGV", declared.args)):
        assert {n for k, n in used if k == kind} == set(range(1, arity.fixed + 1)), (
            f"{name}.lua: the naming block must read exactly the declared {kind}"
        )
        if arity.more:
            assert f"{kind}, {arity.fixed + 1}" in "\n".join(block), (
                f"{name}.lua: the list {kind}[{arity.fixed + 1}..] is not named"
            )


@pytest.mark.parametrize("name", LIBRARIES)
def test_libraries_read_no_keys_or_args_and_are_included(name: str) -> None:
    assert not re.search(r"\b(KEYS|ARGV)\b", code_of(name))
    including = [s for s in SCRIPT_NAMES if name in header(s).includes]
    assert name == PRELUDE or including, f"{name}.lua is included by no script"
    assert all(lib in LIBRARIES for s in SCRIPT_NAMES for lib in header(s).includes)


def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_every_script_is_run_by_storage_code() -> None:
    modules = [p for p in STORAGE.glob("*.py") if p.name != "scripts.py"]
    constants = set().union(*(_string_constants(p) for p in modules))
    assert [name for name in SCRIPT_NAMES if name not in constants] == []


@pytest.mark.parametrize("name", LUA_FILES)
def test_no_key_name_is_spelled_in_lua(name: str) -> None:
    literals = STRING_LITERAL.findall(code_of(name))
    assert [s for s in literals if ":" in s] == [], f"{name}.lua spells a key name: use keys.py"


@pytest.mark.parametrize("name", LUA_FILES)
def test_no_state_name_is_spelled_in_lua(name: str) -> None:
    # state names come from kiln/common/states.py: `S.running`, `B.paused`, `TERMINAL[...]`
    literals = [literal[1:-1] for literal in STRING_LITERAL.findall(code_of(name))]
    spelled = [literal for literal in literals if literal in {*JobState, *BatchStatus}]
    assert spelled == [], f"{name}.lua spells a state: use S.<state> or B.<status>"


@pytest.mark.every_redis
def test_the_state_tables_are_the_enums_and_refuse_other_names(store_redis_url: str) -> None:
    client = redis.Redis.from_url(store_redis_url, decode_responses=True)
    names = scripts.state_names()
    read_all = "local out = {} for i, n in ipairs(ARGV) do out[i] = TABLE[n] end return out"
    try:
        states, statuses = list(JobState), list(BatchStatus)
        assert client.eval(f"{names}\n{read_all.replace('TABLE', 'S')}", 0, *states) == states
        assert client.eval(f"{names}\n{read_all.replace('TABLE', 'B')}", 0, *statuses) == statuses
        terminal = "local out = {} for i, n in ipairs(ARGV) do out[i] = TERMINAL[n] and n or '' end"
        got = client.eval(f"{names}\n{terminal} return out", 0, *JobState)
        assert set(got) - {""} == TERMINAL_STATES
        with pytest.raises(redis.ResponseError, match="no job state runing"):
            client.eval(f"{names}\nreturn S.runing", 0)
        with pytest.raises(redis.ResponseError, match="no batch status pausd"):
            client.eval(f"{names}\nreturn B.pausd", 0)
    finally:
        client.close()


def test_only_keys_py_builds_key_names() -> None:
    # the namespace reaches no module but keys.py, except as the argument that makes a Keys
    # (settings.py declares it and names it in the start-up line, which builds no key)
    for path in STORAGE.glob("*.py"):
        if path.name in ("keys.py", "settings.py"):
            continue
        tree = ast.parse(path.read_text())
        into_keys = {
            id(arg)
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Keys"
            for arg in node.args
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("ns", "redis_namespace"):
                assert id(node) in into_keys, (
                    f"{path.name}:{node.lineno}: key names belong in keys.py"
                )


@pytest.mark.every_redis
def test_every_script_compiles(store_redis_url: str) -> None:
    client = redis.Redis.from_url(store_redis_url, decode_responses=True)
    try:
        for name in SCRIPT_NAMES:
            assert client.script_load(scripts.source(name))
    finally:
        client.close()


def test_a_call_must_match_the_header(storage_settings: StorageSettings) -> None:
    client = redis.Redis.from_url(storage_settings.redis_url, decode_responses=True)
    try:
        renew = Script(client, "renew")  # 3 KEYS, 3 ARGV
        with pytest.raises(ValueError, match="takes 3 KEYS, not 2"):
            renew(["a", "b"], ["job", "1", 10])
        with pytest.raises(ValueError, match="takes 3 ARGV, not 4"):
            renew(["a", "b", "c"], ["job", "1", 10, "extra"])
        audit = Script(client, "audit_claim")  # ARGV[2..]: any number of queues
        with pytest.raises(ValueError, match="takes at least 1 ARGV, not 0"):
            audit(["claims", "lapse"], [])
    finally:
        client.close()
