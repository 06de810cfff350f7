"""Event streams end and are shared fairly: lifetime, fair share of the total, revoked keys.

Real uvicorn and Redis; streams read with httpx and with the Kiln client (httpx-sse).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx

from kiln.storage.apikeys import ApiKeyStore
from kiln.tasks.api.sse import StreamSlots
from kiln.tasks.client.client import KilnClient
from kiln.tasks.contract.schemas import JobRequest
from tests.tasks.helpers import Api, ApiFactory, finish_with_success, start_job

REQUEST = JobRequest(prompt="a kiln", width=64, height=64, steps=2)
# the failure bound of a read, not a threshold: streams here end within a second or two
READ_TIMEOUT = httpx.Timeout(30.0)


def _submit(api: Api, who: str) -> str:
    with KilnClient(api.url, api.keys[who], timeout=30) as client:
        return client.submit(REQUEST).id


# how long a stream that should end may run before the test fails (keep-alives every 0.1 s
# let the read see the time pass): a failure bound, not a threshold
ENDS_WITHIN_S = 30.0


def _read_to_end(lines_of: httpx.Response | Iterator[str]) -> list[str]:
    """Every line of a stream until the server ends it; fails if it goes on and on."""
    source = lines_of.iter_lines() if isinstance(lines_of, httpx.Response) else lines_of
    lines: list[str] = []
    deadline = time.monotonic() + ENDS_WITHIN_S
    for line in source:
        lines.append(line)
        assert time.monotonic() < deadline, f"the stream did not end: {lines[-4:]}"
    return lines


def test_a_stream_ends_at_its_lifetime_and_the_client_resumes_losing_nothing(
    make_api: ApiFactory,
) -> None:
    api = make_api(sse_max_lifetime_s=0.5, sse_keepalive_s=0.1)
    job = _submit(api, "alice")
    url = f"{api.url}/v1/jobs/{job}/events"
    with httpx.stream("GET", url, headers=api.auth(), timeout=READ_TIMEOUT) as response:
        assert response.status_code == 200
        lines = _read_to_end(response)  # the job never ends: only the lifetime ends this
    assert ": stream closed (lifetime); reconnect to resume" in lines
    assert not any(line.startswith("event: succeeded") for line in lines)

    steps = 12  # written over about 2 s: the client's streams end several times meanwhile

    def run() -> None:
        token = start_job(api.store, job)
        for step in range(1, steps + 1):
            api.store.set_progress(job, token, {"stage": "denoising", "step": step, "total": steps})
            time.sleep(0.15)
        finish_with_success(api.store, job, token, steps=0)

    writer = threading.Thread(target=run)
    writer.start()
    with KilnClient(api.url, api.keys["alice"], timeout=30) as client:
        events = list(client.events(job))
    writer.join()
    assert [e.seq for e in events] == list(range(1, len(events) + 1))  # none lost, none twice
    assert [e.type for e in events][-1] == "succeeded"
    assert [e.type for e in events].count("progress") == steps


def test_a_fifth_key_gets_a_stream_while_four_hold_every_slot(make_api: ApiFactory) -> None:
    api = make_api(sse_max_streams_per_key=2, sse_max_streams_total=8, sse_keepalive_s=0.1)
    holders = ["alice", "bob", "carol", "dave"]
    for who in ("carol", "dave", "eve"):
        api.add_key(who)
    jobs = {who: _submit(api, who) for who in [*holders, "eve"]}
    limits = httpx.Limits(max_connections=20, max_keepalive_connections=0)
    with ExitStack() as stack, httpx.Client(timeout=READ_TIMEOUT, limits=limits) as client:

        def open_stream(who: str) -> httpx.Response:
            url = f"{api.url}/v1/jobs/{jobs[who]}/events"
            request = client.build_request("GET", url, headers=api.auth(who))
            response = client.send(request, stream=True)
            stack.callback(response.close)
            return response

        held = {who: [open_stream(who) for _ in range(2)] for who in holders}
        assert all(r.status_code == 200 for streams in held.values() for r in streams)
        assert open_stream("eve").status_code == 200  # the total was full: a slot was made
        # the oldest stream of the key holding the most (of equals, the first to hold) ended
        # to make room: alice's first, which is over her share of 8 // 5 = 1
        assert _read_to_end(held["alice"][0])[-2:] == [
            ": stream closed (evicted); reconnect to resume",
            "",
        ]
        assert api.ctx.sse_slots.streams_of(api.key_ids["alice"]) == 1
        assert api.ctx.sse_slots.streams_of(api.key_ids["eve"]) == 1
        # alice now holds her share: while the total is full she may not take more
        again = open_stream("alice")
        assert again.status_code == 429
        assert again.headers["Retry-After"]


def test_a_revoked_keys_stream_is_closed(make_api: ApiFactory) -> None:
    api = make_api(api_key_cache_s=0.2, sse_keepalive_s=0.1)
    api.add_key("carol")
    job = _submit(api, "carol")
    url = f"{api.url}/v1/jobs/{job}/events"
    with httpx.stream("GET", url, headers=api.auth("carol"), timeout=READ_TIMEOUT) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines) == "id: 1"  # open, delivering (the job's `queued` event)
        assert ApiKeyStore(api.store.redis, api.storage_settings).revoke(api.key_ids["carol"])
        rest = _read_to_end(lines)
    assert rest[-2:] == [": stream closed (revoked); reconnect to resume", ""]
    refused = httpx.get(url, headers=api.auth("carol"))
    assert refused.status_code == 401


def test_the_fair_share_rule() -> None:
    slots = StreamSlots(per_key=3, total=6)
    a = [slots.acquire("a") for _ in range(3)]
    b = [slots.acquire("b") for _ in range(3)]
    assert None not in a + b
    assert slots.acquire("a") is None  # its own cap
    c1 = slots.acquire("c")  # share 6 // 3 = 2: a's oldest ends for c
    assert c1 is not None
    assert a[0] is not None
    assert a[0].ended_by == "evicted"
    c2 = slots.acquire("c")  # b is the one over its share now
    assert c2 is not None
    assert b[0] is not None
    assert b[0].ended_by == "evicted"
    assert slots.acquire("c") is None  # c holds its share; a and b hold theirs
    assert slots.acquire("a") is None
    a[0].release()  # an ended stream's release frees nothing twice
    assert slots.acquire("d") is not None  # share 6 // 4 = 1: a key over 1 gives way
    assert sum(slots.streams_of(k) for k in "abcd") == 6
