"""deploy/kubernetes/: `make lint`'s validation, the renderer, and what the manifests promise."""

from __future__ import annotations

import copy
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.settings_check import check_environment
from tests.deploy.kubernetes_lint import check_overlay, keda_validator, main, problems
from tests.deploy.kustomize import (
    KUBERNETES_DIR,
    OVERLAYS,
    Resource,
    by_kind,
    render,
    strategic_merge,
)
from tests.e2e.compose_stack import read_env_file
from tests.e2e.kubernetes_pods import service_links

SECRETS_EXAMPLE = KUBERNETES_DIR / "kiln-secrets.env.example"
# SIGTERM's ladder after the drain grace: rank 0 asked, then SIGTERM, 3 s later SIGKILL
# (docs/operations.md §4); a denoising step and a margin come on top.
RANK_KILL_S = 3
# One or two denoising steps of a large model and the drain's checkpoint write: a job that takes
# checkpoints stops at its next step boundary (tests/e2e/test_drain_checkpoint.py: 0.6 s on CPU)
STEP_AND_CHECKPOINT_S = 10


# The secrets each workload's processes read (settings of kiln-secrets.env.example): the API signs
# nothing but hashes API keys and refuses webhooks without a secret; the webhook worker signs and
# presigns output URLs; a node uploads and may download gated models; Redis takes its password
# from its URL; MinIO (and its bucket Job) are the S3 keys.
S3_KEYS = {"KILN_S3_ACCESS_KEY_ID", "KILN_S3_SECRET_ACCESS_KEY"}
SECRETS_READ = {
    "kiln-api": {"KILN_REDIS_URL", *S3_KEYS, "KILN_API_KEY_PEPPER", "KILN_WEBHOOK_SECRET"},
    "kiln-webhooks": {"KILN_REDIS_URL", *S3_KEYS, "KILN_WEBHOOK_SECRET"},
    "kiln-control": {"KILN_REDIS_URL", *S3_KEYS},
    "kiln-node-default": {"KILN_REDIS_URL", *S3_KEYS, "HF_TOKEN"},
    "kiln-redis": {"KILN_REDIS_URL"},
    "kiln-minio": S3_KEYS,
    "kiln-minio-bucket": S3_KEYS,
}


def pod_specs(resources: list[Resource]) -> dict[str, dict[str, Any]]:
    """Each workload's pod spec, by workload name."""
    return {
        r["metadata"]["name"]: r["spec"]["template"]["spec"]
        for r in resources
        if "template" in r.get("spec", {})
    }


def kiln_containers(resources: list[Resource]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod spec, container) of every container running a Kiln image."""
    return [
        (pod, container)
        for pod in pod_specs(resources).values()
        for container in pod["containers"]
        if container["image"].split(":")[0].endswith("kiln")
    ]


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_object_of_the_overlay_is_valid(overlay: str) -> None:
    assert check_overlay(overlay, keda_validator()) == []


def test_make_lint_entry_point_passes() -> None:
    assert main() == 0


def test_a_wrong_field_is_an_error_for_kubernetes_and_keda() -> None:
    resources = render(OVERLAYS["gpu"])
    keda = keda_validator()
    deployment = copy.deepcopy(by_kind(resources, "Deployment")["kiln-node-default"])
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 200
    assert problems(deployment, keda) != []
    scaled = copy.deepcopy(by_kind(resources, "ScaledObject")["kiln-node-default"])
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 1  # must be a string
    assert problems(scaled, keda) != []
    del scaled["spec"]["triggers"]
    assert problems(scaled, keda) != []


def test_strategic_merge_merges_keyed_lists_and_deletes_nulls() -> None:
    original = {
        "containers": [{"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}]}],
        "limits": {"gpu": 1, "memory": "1Gi"},
    }
    patch = {
        "containers": [{"name": "a", "env": [{"name": "B", "value": "2"}]}],
        "limits": {"gpu": None},
    }
    assert strategic_merge(original, patch) == {
        "containers": [
            {
                "name": "a",
                "image": "x",
                "env": [{"name": "B", "value": "2"}, {"name": "A", "value": "1"}],
            }
        ],
        "limits": {"memory": "1Gi"},
    }


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_renderer_matches_kubectl_kustomize(overlay: str) -> None:
    built = subprocess.run(
        ["kubectl", "kustomize", str(OVERLAYS[overlay])],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    theirs = {(r["kind"], r["metadata"]["name"]): r for r in yaml.safe_load_all(built) if r}
    ours = {(r["kind"], r["metadata"]["name"]): r for r in render(OVERLAYS[overlay])}
    assert ours == theirs


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_kiln_variable_is_a_kiln_setting(overlay: str) -> None:
    """An unknown KILN_* name stops every `kiln` command (exit 2)."""
    resources = render(OVERLAYS[overlay])
    names = dict.fromkeys(read_env_file(SECRETS_EXAMPLE), "x")
    for config in by_kind(resources, "ConfigMap").values():
        names.update(config["data"])
    for _, container in kiln_containers(resources):
        names.update({v["name"]: "x" for v in container.get("env", [])})
    check_environment(names)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_no_kiln_pod_gets_service_links(overlay: str) -> None:
    """The kubelet would add KILN_API_PORT=tcp://... for Service kiln-api: not a setting."""
    resources = render(OVERLAYS[overlay])
    links = service_links(list(by_kind(resources, "Service").values()))
    assert "KILN_API_PORT" in links  # what a pod with links would get
    with pytest.raises(ValueError, match="KILN_API_SERVICE_HOST"):
        check_environment(links)
    for pod, _ in kiln_containers(resources):
        assert pod.get("enableServiceLinks") is False


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_secret_and_config_reference_exists(overlay: str) -> None:
    resources = render(OVERLAYS[overlay])
    secret_keys = set(read_env_file(SECRETS_EXAMPLE))
    configs = by_kind(resources, "ConfigMap")
    for pod in pod_specs(resources).values():
        for container in pod["containers"]:
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in configs
                else:
                    assert source["secretRef"]["name"] == "kiln-secrets"
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    assert ref["secretKeyRef"]["name"] == "kiln-secrets"
                    assert ref["secretKeyRef"]["key"] in secret_keys
                if "configMapKeyRef" in ref:
                    assert (
                        ref["configMapKeyRef"]["key"]
                        in configs[ref["configMapKeyRef"]["name"]]["data"]
                    )


def secret_keys(container: dict[str, Any]) -> set[str]:
    """The Secret keys a container's environment gets (a whole Secret fails the test)."""
    assert all("secretRef" not in source for source in container.get("envFrom", []))
    return {
        variable["valueFrom"]["secretKeyRef"]["key"]
        for variable in container.get("env", [])
        if "secretKeyRef" in variable.get("valueFrom", {})
    }


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_each_pod_gets_only_the_secrets_it_reads(overlay: str) -> None:
    pods = pod_specs(render(OVERLAYS[overlay]))
    got = {name: set().union(*map(secret_keys, pod["containers"])) for name, pod in pods.items()}
    assert got == {name: keys for name, keys in SECRETS_READ.items() if name in pods}
    assert "HF_TOKEN" not in got["kiln-api"] | got["kiln-webhooks"]
    assert "KILN_API_KEY_PEPPER" not in got["kiln-node-default"] | got["kiln-webhooks"]
    assert "KILN_WEBHOOK_SECRET" not in got["kiln-node-default"]
    # Every key the operator writes is read by some pod.
    assert set().union(*got.values()) == set(read_env_file(SECRETS_EXAMPLE))


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_a_node_pod_outlasts_its_drain(overlay: str) -> None:
    """The grace covers KILN_DRAIN_GRACE_S, a step and its checkpoint, the ranks' shutdown.

    SIGTERM itself is the drain (docs/operations.md §4): no preStop hook holds the GPU while
    running jobs finish.
    """
    resources = render(OVERLAYS[overlay])
    config = by_kind(resources, "ConfigMap")["kiln-config"]["data"]
    nodes = {
        n: d for n, d in by_kind(resources, "Deployment").items() if n.startswith("kiln-node-")
    }
    assert nodes
    for deployment in nodes.values():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {v["name"]: v.get("value") for v in container["env"]}
        needed = (
            float(config["KILN_DRAIN_GRACE_S"])
            + GpuWorkerSettings.model_fields["shutdown_grace_s"].get_default()
            + RANK_KILL_S
            + STEP_AND_CHECKPOINT_S
        )
        assert pod["terminationGracePeriodSeconds"] > needed
        assert "lifecycle" not in container
        assert env["POD_NAME"] is None  # from the downward API
        assert "$(POD_NAME)" in container["args"]
        # Prometheus scrapes the port the node serves its metrics on, from another pod: on
        # every interface, not the node's loopback default.
        assert config["KILN_METRICS_HOST"] == "0.0.0.0"
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == config["KILN_METRICS_PORT"]
        assert {"name": "metrics", "containerPort": int(config["KILN_METRICS_PORT"])} in (
            container["ports"]
        )


def test_the_gpu_nodes_scale_on_their_pipelines_backlog() -> None:
    resources = render(OVERLAYS["gpu"])
    scaled = {
        s["spec"]["scaleTargetRef"]["name"]: s for s in by_kind(resources, "ScaledObject").values()
    }
    nodes = {
        n: d for n, d in by_kind(resources, "Deployment").items() if n.startswith("kiln-node-")
    }
    assert set(scaled) == set(nodes)
    for name, deployment in nodes.items():
        pipeline = deployment["metadata"]["labels"]["kiln.dev/pipeline"]
        spec = scaled[name]["spec"]
        assert "replicas" not in deployment["spec"]  # KEDA's HPA owns it
        assert spec["minReplicaCount"] == 0
        assert spec["maxReplicaCount"] >= 1
        (trigger,) = spec["triggers"]
        assert (
            f'kiln_pipeline_desired_nodes{{namespace="kiln", pipeline="{pipeline}"}}'
            in (trigger["metadata"]["query"])
        )
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert f"{pipeline}=" in " ".join(container["args"])


def test_the_scrape_config_keeps_annotated_kiln_pods() -> None:
    document = yaml.safe_load((KUBERNETES_DIR / "prometheus-scrape.yml").read_text())
    (job,) = document["scrape_configs"]
    keeps = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert {tuple(r["source_labels"]) for r in keeps} == {
        ("__meta_kubernetes_pod_annotation_prometheus_io_scrape",),
        ("__meta_kubernetes_pod_label_app_kubernetes_io_name",),
    }


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_cluster_loops_run_in_the_control_pods_not_the_nodes(overlay: str) -> None:
    """The nodes leave their loops to kiln-control, which runs `kiln control` in two replicas."""
    deployments = by_kind(render(OVERLAYS[overlay]), "Deployment")
    control = deployments["kiln-control"]
    assert control["spec"]["replicas"] >= 2  # one pod's restart stops no loop
    (container,) = control["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["control"]
    assert container["image"].endswith("kiln:slim")  # CPU-only: no torch in the image
    nodes = [d for name, d in deployments.items() if name.startswith("kiln-node-")]
    assert nodes
    for node in nodes:
        for node_container in node["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in node_container.get("env", [])}
            assert env["KILN_NODE_CONTROL_LOOPS"] == "false"
