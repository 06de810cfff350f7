"""The pods of a rendered deploy/kubernetes/ overlay as local processes, with their own commands.

Containers cannot run here, so each pod's container runs what the kubelet would start: its
`command` and `args` (or the ENTRYPOINT and CMD of the Dockerfile target its image names), with
the environment the kubelet builds: the image's ENV, `envFrom` ConfigMaps and Secrets, then `env`
(values, ConfigMap and Secret keys, the downward API's pod name), `$(VAR)` references expanded in
env values, command and args, and the Service links of every Service unless the pod turns them
off. Then only what a container has and a process lacks is rewritten, by compose_stack's
Localizer: Service names become 127.0.0.1 and a local port, listening ports free ones, mounted
volumes folders, the GPU the CPU.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.deploy.kustomize import Resource, by_kind
from tests.e2e.compose_stack import ImageTarget, Localizer, ServiceProcess

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# Mounts the kubelet provides that a local process has already (or does not need as a folder).
HOST_MOUNTS = ("/dev/shm",)


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` (unknown names stay as written) and `$$` escapes."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(substitute, value)


def service_links(services: Sequence[Resource]) -> dict[str, str]:
    """The variables the kubelet puts into a pod for each Service (enableServiceLinks default)."""
    links = {}
    for number, service in enumerate(services, start=1):
        prefix = service["metadata"]["name"].upper().replace("-", "_")
        host = f"10.96.0.{number}"
        ports = service["spec"]["ports"]
        links[f"{prefix}_SERVICE_HOST"] = host
        links[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
        links[f"{prefix}_PORT"] = f"tcp://{host}:{ports[0]['port']}"
        for port in ports:
            proto = port.get("protocol", "TCP")
            base = f"{prefix}_PORT_{port['port']}_{proto}"
            links[base] = f"{proto.lower()}://{host}:{port['port']}"
            links[f"{base}_PROTO"] = proto.lower()
            links[f"{base}_PORT"] = str(port["port"])
            links[f"{base}_ADDR"] = host
    return links


class PodLocalizer(Localizer):
    """compose_stack's Localizer, also for a Service named after credentials (`redis://:pw@host`)."""

    def text(self, value: str) -> str:
        """As Localizer.text, with `@service` rewritten like `//service`."""
        for service, local in self.addresses.items():
            value = value.replace(f"@{service}", f"@{local}")
        return super().text(value)


@dataclass
class Cluster:
    """A rendered overlay, its Secret's values, and how its pods become local processes."""

    resources: list[Resource]
    secrets: dict[str, dict[str, str]]  # Secret name → its keys
    targets: dict[str, ImageTarget]  # Dockerfile targets by image tag (kiln:slim → slim)
    localizer: Localizer
    folder: Path
    base_env: dict[str, str]

    def workload(self, name: str) -> Resource:
        """The Deployment or StatefulSet of that name."""
        found = {**by_kind(self.resources, "Deployment"), **by_kind(self.resources, "StatefulSet")}
        return found[name]

    def config_map(self, name: str) -> dict[str, str]:
        """A ConfigMap's data."""
        data: dict[str, str] = by_kind(self.resources, "ConfigMap")[name]["data"]
        return data

    def pod_env(
        self, pod: Mapping[str, Any], container: Mapping[str, Any], pod_name: str
    ) -> dict[str, str]:
        """The environment the kubelet gives the container, before localizing."""
        target = self.image_target(container["image"])
        env = dict(target.env if target else {})
        if pod.get("enableServiceLinks", True):
            env.update(service_links(list(by_kind(self.resources, "Service").values())))
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                env.update(self.config_map(source["configMapRef"]["name"]))
            else:
                env.update(self.secrets[source["secretRef"]["name"]])
        for variable in container.get("env", []):
            env[variable["name"]] = self.env_value(variable, env, pod_name)
        return env

    def env_value(self, variable: Mapping[str, Any], env: Mapping[str, str], pod_name: str) -> str:
        """One `env` entry's value: literal (with `$(VAR)`), a key, or the pod's name."""
        if "value" in variable:
            return expand(str(variable["value"]), env)
        source = variable["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return self.config_map(ref["name"])[ref["key"]]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            return self.secrets[ref["name"]][ref["key"]]
        if source.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            return pod_name
        raise AssertionError(f"env source not run here: {source}")

    def image_target(self, image: str) -> ImageTarget | None:
        """The Dockerfile target a Kiln image is built from; None for a public image."""
        name, _, tag = image.partition(":")
        return self.targets.get(tag) if name.endswith("kiln") else None

    def argv(self, container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
        """What the container runs: command/args over the image's ENTRYPOINT/CMD, expanded."""
        target = self.image_target(container["image"]) or ImageTarget()
        command = container.get("command", target.entrypoint)
        # A `command` without `args` drops the image's CMD, as the kubelet does.
        default_args = target.cmd if "command" not in container else []
        return [expand(arg, env) for arg in [*command, *container.get("args", default_args)]]

    def launch(
        self,
        workload: str,
        pod_name: str,
        extra_args: Sequence[str] = (),
        exec_argv: Sequence[str] | None = None,
    ) -> ServiceProcess:
        """Start the workload's (first) container as pod `pod_name`.

        `exec_argv`: run that instead, in the container's environment (`kubectl exec`).
        """
        pod = self.workload(workload)["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = self.pod_env(pod, container, pod_name)
        argv = [*self.argv(container, env), *extra_args] if exec_argv is None else exec_argv
        argv = self.localizer.argv(argv)
        local_env = {**self.base_env, **self.localizer.env([env])}
        probe = container.get("readinessProbe", {}).get("exec", {}).get("command")
        workdir = self.folder / pod_name
        workdir.mkdir(exist_ok=True)
        log_path = self.folder / f"{pod_name}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                argv, env=local_env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT
            )
        check = self.localizer.argv(probe) if probe else None
        return ServiceProcess(pod_name, process, argv, local_env, log_path, check)

    def volumes_of(self, workload: str) -> dict[str, Path]:
        """A folder here for each volume the workload's container mounts."""
        pod = self.workload(workload)["spec"]["template"]["spec"]
        mounts = pod["containers"][0].get("volumeMounts", [])
        folders = {
            m["mountPath"]: self.folder / workload / m["name"]
            for m in mounts
            if m["mountPath"] not in HOST_MOUNTS
        }
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)  # the volume exists when the pod starts
        return folders
