"""A real `kiln worker --idle-sleep-s ... --sleep-mode drop` behind a real `kiln api`.

The idle node says `asleep` in its heartbeat (GET /v1/nodes), the next job wakes it and carries
the wait in its metrics (`wake_s`), and the node's `/metrics` counts the wake.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from kiln.common.states import JobState
from tests.e2e.cluster import SLEEPY, Cluster
from tests.e2e.test_observability import free_port, scrape, start_api, submit_over_http, value
from tests.waiting import wait_until

SLEEP_FLAGS = ("--idle-sleep-s", "0.5", "--sleep-mode", "drop")


def node_view(api_url: str, node_id: str) -> dict[str, object]:
    """The node as GET /v1/nodes shows it (empty when it is not listed)."""
    nodes = httpx.get(f"{api_url}/v1/nodes", timeout=10).json()["nodes"]
    return next((node for node in nodes if node["node_id"] == node_id), {})


def sleeps_of(node: dict[str, object]) -> object:
    """How many times the node's group slept, as its heartbeat says (None before one)."""
    coordinator = node.get("coordinator")
    return coordinator.get("sleeps") if isinstance(coordinator, dict) else None


def test_an_idle_node_sleeps_and_the_next_job_wakes_it(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory()
    port = free_port()
    worker = cluster.start_worker(
        f"sleepy={SLEEPY}", extra_env={"KILN_METRICS_PORT": str(port)}, extra_args=SLEEP_FLAGS
    )
    api = start_api(cluster)
    try:
        # Started and idle for longer than the threshold already: the node sleeps.
        wait_until(
            lambda: node_view(api.url, worker.node_id), lambda node: node.get("asleep") is True
        )

        woken = submit_over_http(api, prompt="wakes it", pipeline="sleepy", steps=2)

        record = cluster.wait_for(woken)
        assert record.state == JobState.SUCCEEDED
        assert (record.metrics or {})["wake_s"] > 0
        samples = scrape(f"http://127.0.0.1:{port}")
        assert value(samples, "kiln_node_wake_seconds_count") == 1
        # Idle again after the job: asleep again, a second sleep counted (a heartbeat from
        # before the job would still say asleep, with one).
        wait_until(lambda: node_view(api.url, worker.node_id), lambda node: sleeps_of(node) == 2)
        again = node_view(api.url, worker.node_id)
        assert again["asleep"] is True
        coordinator = again["coordinator"]
        assert isinstance(coordinator, dict)
        assert coordinator["wakes"] == 1
    finally:
        api.stop()
