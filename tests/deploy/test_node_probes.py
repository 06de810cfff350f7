"""A node pod's probes (base/node-default.yaml), each its own command line, against a real Redis.

Liveness must restart a node that stopped living (its heartbeat lapsed while Redis answers) and
never one that merely cannot reach Redis; startup and readiness wait for the heartbeat itself.
tests/e2e/test_kubernetes_manifests.py runs the same commands against a real node it freezes.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.cli.embedded import free_port
from tests.deploy.kustomize import OVERLAYS, by_kind, render
from tests.waiting import wait_until

POD_NAME = "kiln-node-default-5d8f7c9b4-x2x7q"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def node_container(overlay: str) -> dict[str, Any]:
    """The node Deployment's container, as the overlay renders it."""
    deployment = by_kind(render(OVERLAYS[overlay]), "Deployment")["kiln-node-default"]
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def run_probe(probe: dict[str, Any], settings: StorageSettings, *, crash_ok: bool = False) -> int:
    """The probe's exit code, run as the kubelet would in the pod (`python`: this interpreter).

    A traceback fails the test unless `crash_ok`: an exit 1 must be the probe's own verdict.
    """
    program, *args = probe["exec"]["command"]
    assert program == "python"
    env = {
        "KILN_REDIS_URL": settings.redis_url,
        "KILN_REDIS_NAMESPACE": settings.redis_namespace,
        "POD_NAME": POD_NAME,
    }
    done = subprocess.run(
        [sys.executable, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=probe["timeoutSeconds"],
        check=False,
    )
    assert crash_ok or "Traceback" not in done.stderr, done.stderr
    return done.returncode


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_a_node_pod_has_startup_readiness_and_liveness_probes(overlay: str) -> None:
    container = node_container(overlay)
    assert set(PROBES) <= set(container)
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    # Warm-up (model load, compile) may take minutes: liveness waits for the startup probe.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    # A restart costs a cold start: one missed heartbeat or slow probe is not enough.
    assert liveness["failureThreshold"] * liveness["periodSeconds"] >= 60


def test_the_probes_follow_the_node_heartbeat(storage_settings: StorageSettings) -> None:
    container = node_container("gpu")
    store = JobStore.from_settings(storage_settings)
    # Redis answers, no heartbeat of this pod (another node's does not count): all fail.
    store.publish_node("kiln-node-default-other", {"pipelines": ["default"]}, 30)
    assert {p: run_probe(container[p], storage_settings) for p in PROBES} == dict.fromkeys(
        PROBES, 1
    )
    # Its heartbeat, as the node's heartbeat loop publishes it: all pass.
    store.publish_node(POD_NAME, {"pipelines": ["default"]}, 30)
    assert {p: run_probe(container[p], storage_settings) for p in PROBES} == dict.fromkeys(
        PROBES, 0
    )
    # The heartbeat lapses (a wedged or dead node stops renewing it) while Redis answers.
    store.publish_node(POD_NAME, {"pipelines": ["default"]}, 0.2)
    wait_until(
        lambda: {n["node_id"] for n in store.live_nodes()},
        lambda live: POD_NAME not in live,
        what="the heartbeat lapsed",
    )
    assert run_probe(container["livenessProbe"], storage_settings) == 1


def test_liveness_passes_while_redis_cannot_be_asked(storage_settings: StorageSettings) -> None:
    """A Redis outage stops every node's heartbeat: restarting them would not bring Redis back."""
    container = node_container("gpu")
    unreachable = storage_settings.model_copy(
        update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"}
    )
    assert run_probe(container["livenessProbe"], unreachable) == 0
    # Readiness fails (an exit code, whatever the reason): the pod is not counted as ready.
    assert run_probe(container["readinessProbe"], unreachable, crash_ok=True) != 0
