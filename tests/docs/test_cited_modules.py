"""Every module a comment, docstring or doc page cites exists, so a rename cannot leave one stale.

Read: the comments and docstrings of Kiln's Python files (storage, tasks, gpu_worker, kiln, tests),
the comments of the Lua scripts, docs/*.md and README.md. Cited: a file path whose first folder is
one of Kiln's (`storage/keys.py`, `tasks/node/held.py`, or relative to a package, `node/held.py`,
`lua/_prelude.lua`), and a dotted module path from a package's name (`kiln.storage.keys`,
`storage.keys.Keys`, `tasks.contract.limits.PipelineLimits`). A dotted path names a module, then
perhaps one of its attributes: the longest prefix that is a module must exist, and the first name
after it must occur in that module's source. In backticks, a dotted path may start from a room of
`tasks` or a subpackage of `gpu_worker` (`contract.batches.BatchView`, `ranks.leader`).

docs/architecture.md's room table names a room's files bare: each `name.py`, `folder/` and
lowercase `name` listed in a room's row (after `(`, `, ` or `; `) is a module or folder of that
room (or, for a bare name, a function defined there, like `run_job`).
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KILN = REPO / "kiln"
# where a relative file path may start: the repository, the `kiln` folder and each package
PATH_ROOTS = (REPO, KILN, KILN / "tasks", KILN / "gpu_worker", KILN / "storage")
PACKAGES = ("kiln", "storage", "tasks", "gpu_worker")
SCANNED_PY = ("storage", "tasks", "gpu_worker", "kiln", "tests")

FILE_PATH = re.compile(r"(?<![\w/.~-])((?:[\w-]+/)+[\w-]+\.(?:py|lua|md))\b")
# not in a host name or label (`kiln.dev/pipeline`)
DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.\w+)+)(?![\w/-])")
FILE_SUFFIXES = {"py", "lua", "md", "json", "jsonl", "txt", "toml", "yml", "yaml"}
# a quoted `kiln.<name>` in the code: a Celery task's name (`kiln.run_job`), not a module
TASK_NAME = re.compile(r"""["'](kiln\.\w+)["']""")


def python_files() -> Iterator[Path]:
    """Kiln's Python files, each once (the `kiln` folder's links to the packages not followed)."""
    for top in SCANNED_PY:
        for path in sorted((REPO / top).rglob("*.py")):
            if top == "kiln" and path.relative_to(KILN).parts[0] in PACKAGES[1:]:
                continue
            if path.resolve() != Path(__file__).resolve():
                yield path


def python_prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each comment and docstring of a Python file."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                yield first.lineno, first.value.value


def lua_prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each comment of a Lua script."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if "--" in line:
            yield number, line[line.index("--") :]


def page_prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each line of a doc page."""
    yield from enumerate(path.read_text().splitlines(), 1)


def prose() -> Iterator[tuple[Path, int, str]]:
    """Every piece of prose that may cite a module, with where it is."""
    for path in python_files():
        for line, text in python_prose(path):
            yield path, line, text
    for path in sorted((REPO / "storage" / "lua").glob("*.lua")):
        for line, text in lua_prose(path):
            yield path, line, text
    for path in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        for line, text in page_prose(path):
            yield path, line, text


def file_cited_exists(cited: str) -> bool | None:
    """Whether a cited file exists; None if its first folder is none of Kiln's (not a citation)."""
    first = cited.split("/", 1)[0]
    roots = [root for root in PATH_ROOTS if (root / first).is_dir()]
    if not roots:
        return None
    return any((root / cited).is_file() for root in roots)


@functools.cache
def source_of(path: Path) -> str:
    """A module's source, read once."""
    return path.read_text()


@functools.cache
def module_file(parts: tuple[str, ...]) -> Path | None:
    """The source of module `kiln.<parts>` (a package's `__init__.py`), if it exists."""
    base = KILN.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def task_names() -> set[str]:
    """The Celery task names the code defines (`kiln.run_job`, ...)."""
    return {name for path in python_files() for name in TASK_NAME.findall(path.read_text())}


def dotted_cited_problem(cited: str, tasks: frozenset[str] = frozenset()) -> str | None:
    """Why a dotted citation is stale (None: it is not): no such module, or no such name in it."""
    parts = cited.split(".")
    if parts[-1] in FILE_SUFFIXES:  # a file name written with its dot (`tasks.py`), not a module
        return None
    if cited in tasks:
        return None
    if parts[0] == "kiln":
        parts = parts[1:]
    found = max(
        (n for n in range(1, len(parts) + 1) if module_file(tuple(parts[:n])) is not None),
        default=0,
    )
    if found == 0:
        return "no such module"
    rest = parts[found:]
    if not rest:
        return None
    source = module_file(tuple(parts[:found]))
    assert source is not None
    if re.search(rf"\b{re.escape(rest[0])}\b", source_of(source)):
        return None
    return f"kiln.{'.'.join(parts[:found])} has no {rest[0]!r}"


def stale_citations() -> list[str]:
    """Each cited module that does not exist, as `file:line: citation (why)`."""
    stale, tasks = room_table_stale(), frozenset(task_names())
    for path, line, text in prose():
        where = f"{path.relative_to(REPO)}:{line}"
        stale += backticked_stale(text, where, tasks)
        for match in FILE_PATH.finditer(text):
            if file_cited_exists(match.group(1)) is False:
                stale.append(f"{where}: {match.group(1)} (no such file)")
        for match in DOTTED.finditer(text):
            problem = dotted_cited_problem(match.group(1), tasks)
            if problem:
                stale.append(f"{where}: {match.group(1)} ({problem})")
    return stale


@functools.cache
def rooms() -> dict[str, str]:
    """The folders a backticked dotted path may start from, with their package (`node`: tasks)."""
    return {
        folder.name: package
        for package in ("tasks", "gpu_worker")
        for folder in sorted((KILN / package).iterdir())
        if (folder / "__init__.py").is_file()
    }


@functools.cache
def room_dotted(starts: tuple[str, ...]) -> re.Pattern[str]:
    """A backticked dotted path from one of these folders."""
    return re.compile(rf"`((?:{'|'.join(starts)})(?:\.\w+)+)")


def backticked_stale(text: str, where: str, tasks: frozenset[str]) -> Iterator[str]:
    """Stale room-relative dotted paths in backticks (`contract.batches.BatchView`)."""
    starts = rooms()
    for match in room_dotted(tuple(starts)).finditer(text):
        cited = match.group(1)
        problem = dotted_cited_problem(f"{starts[cited.split('.')[0]]}.{cited}", tasks)
        if problem:
            yield f"{where}: {cited} ({problem})"


def listed_names(cells: str) -> list[str]:
    """The file, folder and module names a room's row lists (a name after `(`, `, ` or `; `)."""
    names = []
    for opening, name in re.findall(r"(.?.?)`([^`]+)`", cells):
        listed = opening.endswith("(") or opening in (", ", "; ")  # not the `unacked` layout
        module = re.fullmatch(r"[a-z_]+", name) and name != "kiln"  # `kiln`: the command
        if re.fullmatch(r"[\w/]+\.(?:py|lua)|\w+/", name) or (listed and module):
            names.append(name)
    return names


def room_table_stale() -> list[str]:
    """The names docs/architecture.md's room table gives that are not in their room."""
    page = REPO / "docs" / "architecture.md"
    stale = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        row = re.match(r"\| `([\w/]+?)/?` \|(.*)\|\s*$", line)
        if not row:
            continue
        room = REPO / row.group(1)
        code = "\n".join(p.read_text() for p in room.rglob("*.py"))
        for name in listed_names(row.group(2)):
            if name.endswith("/"):
                found = any(p.is_dir() for p in room.rglob(name.rstrip("/")))
            elif "." in name:
                found = any(room.rglob(name)) or bool(file_cited_exists(name))
            else:
                found = any(room.rglob(f"{name}.py")) or any(room.rglob(name))
                found = found or re.search(rf"\bdef {name}\(", code) is not None
            if not found:
                stale.append(f"docs/architecture.md:{number}: {name} (not in {row.group(1)})")
    return stale


def test_every_cited_module_exists() -> None:
    stale = stale_citations()
    assert not stale, "stale citations:\n" + "\n".join(stale)


def test_a_renamed_module_is_found_stale() -> None:
    assert file_cited_exists("storage/keys.py") is True
    assert file_cited_exists("node/held.py") is True  # relative to the tasks package
    assert file_cited_exists("storage/status.py") is False
    assert file_cited_exists("kombu/transport/redis.py") is None  # not one of Kiln's folders
    assert dotted_cited_problem("kiln.storage.keys.Keys") is None
    assert dotted_cited_problem("storage.keys") is None
    assert dotted_cited_problem("tasks.limits.PipelineLimits") is not None
    assert dotted_cited_problem("storage.keys.NoSuchName") is not None
    assert dotted_cited_problem("tasks.py") is None
    cited = DOTTED.findall("the `kiln.dev/pipeline` label, kiln.storage.keys.")
    assert cited == ["kiln.storage.keys"]
    assert "kiln.run_job" in task_names()  # a task's name, not a module
    assert dotted_cited_problem("kiln.no_such_thing") == "no such module"
    assert list(backticked_stale("`contract.batches.BatchView`", "x", frozenset())) == []
    assert list(backticked_stale("`contract.uploads`", "x", frozenset())) != []
    row = "(`held`), `run_job`: a; `a.py`, the `unacked` layout, `kiln` (`ranks/`, `Script`)"
    assert listed_names(row) == ["held", "run_job", "a.py", "ranks/"]
