"""The lock (deploy/lock/): what `make setup`, CI and the images install, pinned and hashed.

It must cover pyproject.toml's requirements, each pinned inside its range with the hashes pip
checks, and the images' locks must agree with the one the tests run on. A range without a lock
let a fresh clone install redis-py 8.2.0 the day it came out, and the same commit that had passed
failed; the lock makes a clone install what CI tested.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "deploy" / "lock"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = canonicalize_name(PYPROJECT["project"]["name"])
# Left out of every lock on purpose: torch (its build is the machine's: CPU here, CUDA on a GPU
# node) and Kiln itself.
UNLOCKED = {"torch", PROJECT}


def pins(lock: Path) -> dict[str, tuple[str, list[str]]]:
    """{name: (version, hashes)} of a pip-compile lock with hashes."""
    found: dict[str, tuple[str, list[str]]] = {}
    name = ""
    for raw in lock.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("--hash="):
            found[name][1].append(line.removeprefix("--hash=").rstrip(" \\"))
            continue
        requirement = Requirement(line.rstrip(" \\"))
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"{lock.name}: {line} is not pinned"
        name = canonicalize_name(requirement.name)
        found[name] = (spec.version, [])
    return found


def requirements(*extras: str) -> list[Requirement]:
    """pyproject.toml's requirements of the base install and `extras`, without Kiln itself."""
    project = PYPROJECT["project"]
    listed = [*project["dependencies"]]
    for extra in extras:
        listed += project["optional-dependencies"][extra]
    return [r for r in map(Requirement, listed) if canonicalize_name(r.name) not in UNLOCKED]


@pytest.mark.parametrize(
    ("lock", "extras"),
    [
        ("dev.txt", tuple(PYPROJECT["project"]["optional-dependencies"])),
        ("slim.txt", ()),
        ("flower.txt", ("flower",)),
        ("worker.txt", ("worker",)),
    ],
)
def test_every_requirement_is_pinned_inside_its_range_with_hashes(
    lock: str, extras: tuple[str, ...]
) -> None:
    locked = pins(LOCKS / lock)
    assert locked, f"{lock} pins nothing"
    for name, (_, hashes) in locked.items():
        assert hashes, f"{lock}: {name} has no hash"
        assert all(h.startswith("sha256:") for h in hashes), f"{lock}: {name}: {hashes}"
    assert not UNLOCKED & set(locked), f"{lock} pins {UNLOCKED & set(locked)}"
    for requirement in requirements(*extras):
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{lock} lacks {requirement}"
        assert requirement.specifier.contains(locked[name][0], prereleases=True), (
            f"{lock}: {name}=={locked[name][0]} is outside pyproject's {requirement}"
        )


@pytest.mark.parametrize("image_lock", ["slim.txt", "flower.txt", "worker.txt"])
def test_the_images_install_the_versions_the_tests_ran_on(image_lock: str) -> None:
    dev = pins(LOCKS / "dev.txt")
    image = pins(LOCKS / image_lock)
    differ = {n: (v, dev.get(n, ("absent", []))[0]) for n, (v, _) in image.items()}
    assert {n: vs for n, vs in differ.items() if vs[0] != vs[1]} == {}


def _stages(dockerfile: str) -> dict[str, str]:
    """Each named stage of the Dockerfile and its text."""
    stages: dict[str, str] = {}
    name = ""
    for line in dockerfile.splitlines():
        if line.startswith("FROM ") and " AS " in line:
            name = line.rsplit(" AS ", 1)[1].strip()
            stages[name] = ""
        elif name:
            stages[name] += line + "\n"
    return stages


@pytest.mark.parametrize(
    ("stage", "lock"),
    [
        ("builder", "slim.txt"),
        ("slim", "slim.txt"),
        ("flower", "flower.txt"),
        ("worker", "worker.txt"),
    ],
)
def test_every_image_installs_its_lock_with_hashes_and_nothing_else(stage: str, lock: str) -> None:
    text = _stages((ROOT / "Dockerfile").read_text())[stage]
    assert f"COPY deploy/lock/{lock} /tmp/lock.txt" in text
    assert "pip install --require-hashes --no-deps -r /tmp/lock.txt" in text
    # whatever else pip installs there takes nothing from the index but torch (the worker's own)
    for line in text.splitlines():
        if "pip install" in line and "-r /tmp/lock.txt" not in line:
            assert "--no-deps" in line or "torch==" in line, line


def test_make_setup_installs_the_lock_with_hashes() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "LOCK := deploy/lock/dev.txt" in makefile
    assert "pip install -q --require-hashes --no-deps -r $(LOCK)" in makefile
    assert "pip install -q --no-deps --no-build-isolation -e ." in makefile
