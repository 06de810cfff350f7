"""The kustomize overlays of deploy/kubernetes/ rendered in Python, offline.

`make lint` and the tests must render the overlays on any machine, and a kustomize binary is not
installable from the registries this project uses, so this renders the subset of kustomize the
overlays use: `resources` (files and folders with a kustomization), `namespace`, `images` and
`patches` given by `path` (strategic merge patches, targeted by their own kind and name). Anything
else in a kustomization is refused rather than ignored. tests/deploy/test_kubernetes_lint.py
compares the output with `kubectl kustomize` where kubectl is installed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = {name: KUBERNETES_DIR / "overlays" / name for name in ("cpu-demo", "gpu")}
SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
# Strategic merge: the lists Kubernetes merges item by item, by this key (the API's
# patchMergeKey); any other list is replaced whole.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}
# Kinds without a namespace, which the `namespace` field leaves alone.
CLUSTER_SCOPED = {
    "Namespace",
    "PersistentVolume",
    "StorageClass",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PriorityClass",
}

Resource = dict[str, Any]


class KustomizeError(ValueError):
    """A kustomization this renderer does not support, or a patch that matches nothing."""


def load_documents(path: Path) -> list[Resource]:
    """Every non-empty YAML document of a file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render(folder: Path) -> list[Resource]:
    """The resources a kustomization folder builds, as `kubectl kustomize FOLDER` prints them."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED_FIELDS
    if unknown:
        raise KustomizeError(f"{folder}: unsupported kustomization fields {sorted(unknown)}")
    resources: list[Resource] = []
    for entry in spec.get("resources", []):
        target = (folder / entry).resolve()
        resources.extend(render(target) if target.is_dir() else load_documents(target))
    for patch_entry in spec.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise KustomizeError(f"{folder}: only `patches: - path: FILE` is supported")
        for patch in load_documents(folder / patch_entry["path"]):
            apply_patch(resources, patch, folder / patch_entry["path"])
    for image in spec.get("images", []):
        set_image(resources, image)
    if "namespace" in spec:
        for resource in resources:
            if resource["kind"] not in CLUSTER_SCOPED:
                resource.setdefault("metadata", {})["namespace"] = spec["namespace"]
    return resources


def apply_patch(resources: list[Resource], patch: Resource, source: Path) -> None:
    """Merge a strategic merge patch into the one resource of its kind and name."""
    name = patch["metadata"]["name"]
    matches = [r for r in resources if r["kind"] == patch["kind"] and r["metadata"]["name"] == name]
    if len(matches) != 1:
        raise KustomizeError(f"{source}: {patch['kind']}/{name} matches {len(matches)} resources")
    merged = strategic_merge(matches[0], patch)
    matches[0].clear()
    matches[0].update(merged)


def strategic_merge(original: Any, patch: Any, field: str = "") -> Any:
    """Kubernetes' strategic merge: maps merge, null deletes, keyed lists merge item by item."""
    if isinstance(original, dict) and isinstance(patch, dict):
        merged = dict(original)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = _without_nulls(value)
        return merged
    key = MERGE_KEYS.get(field)
    if key and isinstance(original, list) and isinstance(patch, list):
        originals = {item[key]: item for item in original}
        # kustomize's order: the patch's items (merged into their originals), then the rest
        result = [strategic_merge(originals.get(item[key], {}), item, "") for item in patch]
        patched = {item[key] for item in patch}
        return result + [item for item in original if item[key] not in patched]
    return _without_nulls(copy.deepcopy(patch))


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def set_image(resources: list[Resource], image: dict[str, str]) -> None:
    """Kustomize's `images` entry: a new name and/or tag for every container of that image."""
    for container in iter_containers(resources):
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            new_tag = image.get("newTag", tag)
            container["image"] = image.get("newName", name) + (f":{new_tag}" if new_tag else "")


def iter_containers(resources: list[Resource]) -> list[dict[str, Any]]:
    """The containers (and init containers) of every workload's pod template."""
    found = []
    for resource in resources:
        template = resource.get("spec", {}).get("template", {}).get("spec", {})
        found.extend(template.get("initContainers", []))
        found.extend(template.get("containers", []))
    return found


def by_kind(resources: list[Resource], kind: str) -> dict[str, Resource]:
    """The resources of one kind, by name."""
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}
