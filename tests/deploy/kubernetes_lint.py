"""`make lint`'s check of deploy/kubernetes/: each overlay rendered, each object validated offline.

Kubernetes objects are checked with kubernetes-validate against the schemas of KUBERNETES_VERSION
(bundled with the package, strict: an unknown field is an error); KEDA's ScaledObjects against
the schema in deploy/kubernetes/schemas/ (their CRD's, which kubernetes-validate does not know).

    .venv/bin/python -m tests.deploy.kubernetes_lint
"""

from __future__ import annotations

import sys
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from tests.deploy.kustomize import KUBERNETES_DIR, OVERLAYS, Resource, render

# The oldest Kubernetes the manifests promise to work on (autoscaling/v2, policy/v1, generic
# ephemeral volumes and sidecar-free pods all hold from 1.25 on).
KUBERNETES_VERSION = "1.30.0"
KEDA_SCHEMA = KUBERNETES_DIR / "schemas" / "keda-scaledobject-v1alpha1.yaml"
PROMETHEUS_SCRAPE = KUBERNETES_DIR / "prometheus-scrape.yml"


def keda_validator() -> jsonschema.protocols.Validator:
    """A validator of KEDA ScaledObjects."""
    schema = yaml.safe_load(KEDA_SCHEMA.read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator: jsonschema.protocols.Validator = validator_class(schema)
    return validator


def problems(resource: Resource, keda: jsonschema.protocols.Validator) -> list[str]:
    """What is wrong with one object (empty when it is valid)."""
    if resource.get("apiVersion", "").startswith("keda.sh/"):
        return [
            f"{'.'.join(str(p) for p in error.absolute_path) or '(root)'}: {error.message}"
            for error in keda.iter_errors(resource)
        ]
    try:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path) or "(root)"
        return [f"{path}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"no schema for {exc}"]
    return []


def check_overlay(name: str, keda: jsonschema.protocols.Validator) -> list[str]:
    """Every problem of one rendered overlay, each line naming its object."""
    lines: list[str] = []
    for resource in render(OVERLAYS[name]):
        label = f"{name}: {resource.get('kind')}/{resource.get('metadata', {}).get('name')}"
        lines.extend(f"{label}: {problem}" for problem in problems(resource, keda))
    return lines


def check_scrape_config() -> list[str]:
    """The Prometheus snippet parses and keeps only annotated pods."""
    document: dict[str, Any] = yaml.safe_load(PROMETHEUS_SCRAPE.read_text())
    jobs = document.get("scrape_configs") or []
    if not jobs or not all("kubernetes_sd_configs" in job for job in jobs):
        return [f"{PROMETHEUS_SCRAPE}: expected scrape_configs with kubernetes_sd_configs"]
    return []


def main() -> int:
    """Validate everything; print each problem; exit 1 if any."""
    keda = keda_validator()
    lines = [line for name in OVERLAYS for line in check_overlay(name, keda)]
    lines += check_scrape_config()
    for line in lines:
        print(line, file=sys.stderr)
    count = sum(len(render(path)) for path in OVERLAYS.values())
    print(
        f"kubernetes manifests: {count} objects in {len(OVERLAYS)} overlays, "
        f"Kubernetes {KUBERNETES_VERSION}: {len(lines)} problems"
    )
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
