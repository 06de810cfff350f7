"""docker-compose.yml's services as local processes, with the compose file's own command lines.

Containers cannot run here, so each service runs what its container would: the `entrypoint` and
`command` of the compose file, or the ENTRYPOINT and CMD of the Dockerfile target it builds, with
the image's ENV, the env file and `environment` layered as compose layers them. Only what a
container has and a local process lacks is rewritten (`Localizer`): service host names become
127.0.0.1 and the port that process really listens on, each listening port is a free one, the GPU
is the CPU, the `models` volume a folder, and the programs come from this virtual environment.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kiln.tasks.cli.embedded import free_port
from tests.e2e.cluster import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
ENV_EXAMPLE = REPO_ROOT / "deploy" / "kiln.env.example"
# Settings naming a port a process listens on: each process gets its own free one, as each
# container has its own network namespace.
LISTEN_PORT_SETTINGS = ("KILN_API_PORT", "KILN_METRICS_PORT", "FLOWER_PORT")
# The image's layout, not a setting: the virtual environment's own PATH stands in for it.
IMAGE_ONLY_ENV = ("PATH", "VIRTUAL_ENV")
_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: Any, variables: Mapping[str, str]) -> Any:
    """Compose's `${NAME}`, `${NAME:-default}` and `$$`, through nested lists and mappings."""
    if isinstance(value, dict):
        return {key: interpolate(item, variables) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, variables) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return variables.get(match.group(1)) or match.group(2) or ""

    return _VARIABLE.sub(substitute, value)


def load_compose(variables: Mapping[str, str]) -> dict[str, Any]:
    """docker-compose.yml's services, anchors merged and variables substituted."""
    document = yaml.safe_load(COMPOSE_FILE.read_text())
    services: dict[str, Any] = interpolate(document["services"], variables)
    return services


def read_env_file(path: Path) -> dict[str, str]:
    """An env file as compose reads it: KEY=VALUE lines, values literal, `#` lines skipped."""
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value
    return values


@dataclass
class ImageTarget:
    """What a Dockerfile stage hands its containers: ENTRYPOINT, CMD, ENV and HEALTHCHECK."""

    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    healthcheck: list[str] | None = None


def dockerfile_targets(text: str) -> dict[str, ImageTarget]:
    """Each named stage of a Dockerfile, with what it inherits from the stage it builds on."""
    stages: dict[str, ImageTarget] = {}
    current = ImageTarget()
    for instruction in _instructions(text):
        keyword, _, rest = instruction.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            base, _, name = rest.partition(" AS ")
            parent = stages.get(base.strip(), ImageTarget())
            current = ImageTarget(
                list(parent.entrypoint), list(parent.cmd), dict(parent.env), parent.healthcheck
            )
            stages[name.strip()] = current
        elif keyword == "ENV":
            current.env.update(_env_pairs(rest))
        elif keyword == "ENTRYPOINT":
            current.entrypoint, current.cmd = json.loads(rest), []  # Docker resets CMD too
        elif keyword == "CMD":
            current.cmd = json.loads(rest)
        elif keyword == "HEALTHCHECK":
            current.healthcheck = json.loads(rest.split(" CMD ", 1)[1]) if " CMD " in rest else None
    return stages


def _env_pairs(rest: str) -> dict[str, str]:
    pairs = (pair.partition("=") for pair in shlex.split(rest))
    return {key: value for key, _, value in pairs}


def _instructions(text: str) -> list[str]:
    joined = re.sub(r"\\\n(\s*#.*\n)*", " ", text)  # continuation lines (comments inside skipped)
    lines = (line.strip() for line in joined.splitlines())
    return [line for line in lines if line and not line.startswith(("#", "ARG "))]


@dataclass
class Localizer:
    """Rewrites a container's command line and environment for a process on this machine."""

    addresses: dict[str, str]  # "redis:6379" → "127.0.0.1:<port>"
    volumes: dict[str, Path]  # "/models" → a folder
    listen_ports: dict[str, int] = field(default_factory=dict)

    def text(self, value: str) -> str:
        """Service addresses in URLs point at the local processes; listeners stay on loopback."""
        for service, local in self.addresses.items():
            value = value.replace(f"//{service}", f"//{local}")
        for mount, folder in self.volumes.items():
            if value == mount or value.startswith(mount + "/"):
                value = str(folder) + value[len(mount) :]
        return "127.0.0.1" if value == "0.0.0.0" else value

    def argv(self, argv: Sequence[str]) -> list[str]:
        """The program from this virtual environment; the GPU becomes the CPU."""
        local = [self.text(arg) for arg in argv]
        program = Path(sys.executable).parent / local[0]
        if program.exists():
            local[0] = str(program)
        return [re.sub(r"^cuda:\d+$", "cpu", arg) for arg in local]

    def env(self, layers: Sequence[Mapping[str, str]]) -> dict[str, str]:
        """The layers (image, env file, `environment`) merged, last wins, then localized."""
        merged: dict[str, str] = {}
        for layer in layers:
            merged.update({key: str(value) for key, value in layer.items()})
        for key in IMAGE_ONLY_ENV:
            merged.pop(key, None)
        local = {key: self.text(value) for key, value in merged.items()}
        for setting in LISTEN_PORT_SETTINGS:
            self.listen_ports[setting] = free_port()
            local[setting] = str(self.listen_ports[setting])
        return local


@dataclass
class ServiceProcess:
    """One compose service running as a local process."""

    name: str
    process: subprocess.Popen[bytes]
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    healthcheck: list[str] | None

    def healthy(self) -> bool:
        """Whether the service's own healthcheck command passes (run as compose would)."""
        if self.healthcheck is None:
            return self.process.poll() is None
        check = subprocess.run(
            self.healthcheck, env=self.env, capture_output=True, timeout=30, check=False
        )
        return check.returncode == 0

    def port(self, setting: str) -> int:
        """The local port behind a listening-port setting."""
        return int(self.env[setting])

    def log(self) -> str:
        """The tail of the service's output."""
        return self.log_path.read_text(errors="replace")[-6000:]

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (what `docker compose stop` sends) and the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout_s)

    def stop(self) -> None:
        """Stop by any means (teardown)."""
        try:
            self.terminate(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


@dataclass
class ComposeServices:
    """The compose file's services, launchable here."""

    services: dict[str, Any]
    targets: dict[str, ImageTarget]
    localizer: Localizer
    folder: Path
    base_env: dict[str, str]

    def kiln_services(self) -> list[str]:
        """Services built from this repository's Dockerfile."""
        return [name for name, spec in self.services.items() if "build" in spec]

    def launch(self, name: str, command: Sequence[str] | None = None) -> ServiceProcess:
        """Start service `name` (with `command` instead of its own, like `compose run`)."""
        spec = self.services[name]
        target = self.targets[spec["build"]["target"]]
        entrypoint = spec.get("entrypoint", target.entrypoint)
        argv = [*entrypoint, *(command or spec.get("command", target.cmd))]
        env_files = [read_env_file(REPO_ROOT / path) for path in spec.get("env_file", [])]
        env = self.localizer.env([target.env, *env_files, spec.get("environment", {})])
        env = {**self.base_env, **env}
        check = spec.get("healthcheck", {}).get("test") or ["CMD", *(target.healthcheck or [])]
        healthcheck = self.localizer.argv(check[1:]) if check[0] == "CMD" and check[1:] else None
        workdir = self.folder / name
        workdir.mkdir(exist_ok=True)
        log_path = self.folder / f"{'-'.join([name, *(command or [])[:1]])}.log"
        local_argv = self.localizer.argv(argv)
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                local_argv,
                env=env,
                cwd=workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return ServiceProcess(name, process, local_argv, env, log_path, healthcheck)

    def launch_image(self, name: str, local_args: Sequence[str]) -> ServiceProcess:
        """Start a service of a public image (Redis) from its `command`, plus `local_args`."""
        log_path = self.folder / f"{name}.log"
        argv = [*self.services[name]["command"], *local_args]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                argv, env=self.base_env, cwd=self.folder, stdout=log, stderr=subprocess.STDOUT
            )
        return ServiceProcess(name, process, argv, self.base_env, log_path, None)


def host_environment() -> dict[str, str]:
    """What a local process needs that a container's image provides (and the test pipeline)."""
    keep = ("PATH", "HOME", "LANG", "TMPDIR")
    env = {key: os.environ[key] for key in keep if key in os.environ}
    # The fixture pipeline (`python:tests.e2e.pipelines:sleepy`) lives in the checkout.
    return {**env, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
