"""Helpers of the API, client and webhook tests: a real uvicorn server, keys, a receiver."""

from __future__ import annotations

import base64
import http.server
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI

from kiln.storage.apikeys import ApiKeyStore
from kiln.storage.job_store import JobRecord, JobStore, NewJob
from kiln.storage.settings import StorageSettings
from kiln.tasks.api.auth import hash_api_key, new_api_key
from kiln.tasks.api.context import ApiContext
from kiln.tasks.api.http_guard import uvicorn_config
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.intake.intake import ANONYMOUS, Intake
from kiln.tasks.intake.refusal import Refused
from kiln.tasks.webhooks.ssrf import Resolver, system_resolver
from tests.waiting import wait_until

# a fresh Standard Webhooks secret: `whsec_` + base64 of 32 random bytes
WEBHOOK_SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def fake_dns(table: dict[str, list[str]]) -> Resolver:
    """A resolver that knows some extra names (DNS is outside Kiln), else asks the system."""

    def resolve(host: str, port: int) -> list[str]:
        return table[host] if host in table else system_resolver(host, port)

    return resolve


class ThreadServer:
    """uvicorn serving an app on 127.0.0.1 (free port) in a thread."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # the API's own uvicorn configuration (deadlines, keep-alive) from the app's settings
        settings: KilnSettings = app.state.kiln.settings
        config = uvicorn_config(app, settings, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, args=([self.sock],), daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()

        def started() -> bool:
            assert self.thread.is_alive(), "uvicorn's thread ended before it started serving"
            return self.server.started

        wait_until(started, timeout_s=30, poll_s=0.01, what="uvicorn started")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@dataclass
class Api:
    """A running API and what tests need around it."""

    url: str
    ctx: ApiContext
    settings: KilnSettings
    storage_settings: StorageSettings
    keys: dict[str, str] = field(default_factory=dict)  # name -> secret
    key_ids: dict[str, str] = field(default_factory=dict)  # name -> key id

    @property
    def store(self) -> JobStore:
        """The API's job store."""
        return self.ctx.store

    def auth(self, name: str = "alice") -> dict[str, str]:
        """Authorization header of a named key."""
        return {"Authorization": f"Bearer {self.keys[name]}"}

    def add_key(self, name: str, admin: bool = False) -> str:
        """Create a key; returns its secret."""
        secret = new_api_key()
        pepper = self.settings.api_key_pepper.get_secret_value()
        key = ApiKeyStore(self.store.redis, self.storage_settings).create(
            hash_api_key(secret, pepper), name, admin
        )
        self.keys[name], self.key_ids[name] = secret, key.id
        return secret


def api_settings(**overrides: Any) -> KilnSettings:
    """Test settings: auth on, webhooks signed, local receivers allowed, short schedules."""
    values: dict[str, Any] = {
        "auth_enabled": True,
        "webhook_secret": WEBHOOK_SECRET,
        "webhook_allow_http": True,
        "webhook_allow_hosts": ["127.0.0.1"],
        "webhook_retry_schedule_s": [0.2, 0.2, 0.2],
        "webhook_retry_jitter": 0.0,
        "sse_block_ms": 100,
        # long: a pooled client connection must not be closed under a test on a slow machine
        "http_keepalive_timeout_s": 30,
        "pipelines": ["default", "tiny", "tiny-video"],
    }
    values.update(overrides)
    return KilnSettings(**values)


ApiFactory = Callable[..., Api]


def drive_to_success(store: JobStore, job_id: str, steps: int = 3) -> JobRecord:
    """Move a job queued → running → progress × steps → succeeded through the real store."""
    return finish_with_success(store, job_id, start_job(store, job_id), steps)


def start_job(store: JobStore, job_id: str) -> int:
    """Lease a queued job and move it to running; returns the lease token."""
    token = store.acquire_lease(job_id, "test-node")
    store.start(job_id, token)
    return token


def finish_with_success(store: JobStore, job_id: str, token: int, steps: int = 3) -> JobRecord:
    """Move a running job → progress × steps → succeeded (one output) and release its lease."""
    for step in range(1, steps + 1):
        store.set_progress(job_id, token, {"stage": "denoising", "step": step, "total": steps})
    outputs = [
        {
            "key": f"outputs/{job_id}/0.png",
            "content_type": "image/png",
            "bytes": 3,
            "sha256": "ab" * 32,
            "width": 64,
            "height": 64,
            "frames": 1,
        }
    ]
    record = store.succeed(job_id, token, outputs, {"queue_s": 0.1, "run_s": 0.2})
    store.release_lease(job_id, token)
    return record


def queued_job(store: JobStore, request: JobRequest | None = None, owner: str | None = None) -> str:
    """Create a queued job straight in the store (no API)."""
    import uuid

    job_id = uuid.uuid4().hex
    body = (request or JobRequest(prompt="a kiln", width=64, height=64)).to_record()
    store.create_job(NewJob(id=job_id, request=body, owner=owner))
    return job_id


@dataclass
class Hit:
    """One request a receiver got."""

    path: str
    headers: dict[str, str]
    body: bytes


class Receiver:
    """A local HTTP webhook receiver; `script` gives the status for each hit (then 200)."""

    def __init__(
        self,
        script: list[int | tuple[int, dict[str, str]]] | None = None,
        on_hit: Callable[[int], None] | None = None,
    ) -> None:
        self.script = list(script or [])
        self.hits: list[Hit] = []
        self.lock = threading.Lock()
        # called with the hit's number (1-based) before answering: the sender waits for it
        self.on_hit = on_hit
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with receiver.lock:
                    receiver.hits.append(Hit(self.path, dict(self.headers.items()), body))
                    step = receiver.script.pop(0) if receiver.script else 200
                    number = len(receiver.hits)
                if receiver.on_hit is not None:
                    receiver.on_hit(number)
                code, headers = step if isinstance(step, tuple) else (step, {})
                self.send_response(code)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def wait_for(self, count: int, timeout: float = 60.0) -> list[Hit]:
        """Block until `count` hits arrived (generous timeout: the machine is shared)."""

        def arrived() -> list[Hit]:
            with self.lock:
                return list(self.hits)

        return wait_until(
            arrived, lambda hits: len(hits) >= count, timeout_s=timeout, poll_s=0.02,
            what=f"{count} hits",
        )  # fmt: skip

    def close(self) -> None:
        """Stop serving."""
        self.httpd.shutdown()
        self.httpd.server_close()


def write_many(intake: Intake, requests: list[JobRequest]) -> list[str]:
    """Jobs the intake accepts, written in one pipelined step and published (bulk set-up).

    Each distinct request is checked once; Refused names the first one the intake refuses.
    """
    checked: set[str] = set()
    for request in requests:
        text = request.model_dump_json()
        if text not in checked:
            refusal = intake.refusal(request, ANONYMOUS, None)
            if refusal is not None:
                raise Refused(refusal)
            checked.add(text)
    news = [intake.accept(request, ANONYMOUS).new for request in requests]
    intake.store.create_jobs(news)
    for record in intake.store.get_many([new.id for new in news]):
        if record is not None:
            intake.submitter.publish(record)
    return [new.id for new in news]
