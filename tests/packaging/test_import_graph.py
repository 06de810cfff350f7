"""No import cycle among Kiln's modules, counting every import a module makes.

import-linter's contracts exclude type-checking imports (`exclude_type_checking_imports`), and no
contract looks inside functions, so a cycle hidden by `if TYPE_CHECKING:` or by an import in a
function body passes `make lint`. This test reads each module's syntax tree instead: module-level,
type-checking and in-function imports alike are edges, and any strongly connected set of two or
more modules fails the test with one cycle through it spelled out.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# the checkout, whose kiln/ links tasks/, gpu_worker/ and storage/
ROOT = Path(__file__).resolve().parents[2]


def kiln_modules(root: Path) -> dict[str, Path]:
    """Every module under `root/kiln` (links followed) by its dotted name."""
    modules: dict[str, Path] = {}
    base = root / "kiln"
    for folder, _, files in os.walk(base, followlinks=True):  # rglob would not follow them
        for file in sorted(f for f in files if f.endswith(".py")):
            path = Path(folder) / file
            parts = ("kiln", *path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _targets(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """The names an import statement may load: the module imported and `module.name` for each."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            kept = package[: len(package) - node.level + 1]
            base = ".".join([*kept, *([node.module] if node.module else [])])
        else:
            base = node.module or ""
        yield base
        for alias in node.names:
            yield f"{base}.{alias.name}"


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's Kiln imports, wherever in the module they are written.

    An import of a package that contains the importing module is left out: by then Python has
    run (or is running) that package's `__init__`, so it is no edge of its own.
    """
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        found: set[str] = set()
        for node in ast.walk(tree):
            for target in _targets(node, name, is_package):
                if target in modules and target != name and not name.startswith(target + "."):
                    found.add(target)
        edges[name] = found
    return edges


def _reachable(start: str, edges: dict[str, set[str]]) -> set[str]:
    """The modules `start` loads, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for child in edges[todo.pop()]:
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (first module repeated at the end) through each strongly connected set."""
    reach = {name: _reachable(name, edges) for name in edges}  # a few hundred modules: cheap
    components: list[set[str]] = []
    placed: set[str] = set()
    for name in sorted(edges):
        if name in placed or name not in reach[name]:
            continue
        component = {other for other in reach[name] if name in reach[other]}
        placed |= component
        components.append(component)
    return [_cycle_in(component, edges) for component in components]


def _cycle_in(component: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest way from the component's first module back to itself (breadth first)."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in sorted(edges[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle in {sorted(component)}")  # a component always has one


def test_no_import_cycle_among_kiln_modules() -> None:
    modules = kiln_modules(ROOT)
    assert "kiln.tasks.batches.feeder" in modules  # the links were followed
    found = cycles(import_graph(modules))
    assert not found, "import cycles (type-checking and in-function imports count):\n" + "\n".join(
        " -> ".join(cycle) for cycle in found
    )


@pytest.mark.parametrize(
    "hidden",
    [
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kiln.a import A\n",
        "def late():\n    from kiln.a import A\n    return A\n",
        "def late():\n    from . import a\n    return a\n",
    ],
    ids=["type-checking", "in-function", "relative-in-function"],
)
def test_a_hidden_import_closes_a_cycle(tmp_path: Path, hidden: str) -> None:
    package = tmp_path / "kiln"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from kiln.b import B\nA = 1\n")
    (package / "b.py").write_text(hidden + "B = 2\n")
    assert cycles(import_graph(kiln_modules(tmp_path))) == [["kiln.a", "kiln.b", "kiln.a"]]
