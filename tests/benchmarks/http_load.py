"""A light HTTP load generator: N keep-alive connections in one asyncio loop, like `wrk`.

httpx spends about as much CPU per request as the API itself; on a 2-core machine shared by
server and load, a generator that heavy measures itself. Here each connection sends one
pre-encoded request, reads the status line, the headers up to the blank line and exactly
`content-length` bytes of body, and sends the next: no per-request objects beyond that.
Every response must carry the expected status, else the run fails (a fast 500 is no throughput).

Run on its own: `python tests/benchmarks/http_load.py PORT KEY JOBS CONCURRENCY`; prints jobs/s.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

DEFAULT_BODY = {"prompt": "a kiln at dusk", "width": 64, "height": 64, "steps": 4, "seed": 1}


def post_request(path: str, key: str, body: dict[str, object], host: str = "127.0.0.1") -> bytes:
    """One HTTP/1.1 POST with a JSON body and a bearer key, keep-alive, as raw bytes."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


async def _connection(
    host: str, port: int, request: bytes, count: int, expect: frozenset[int]
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for _ in range(count):
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length)
            if status not in expect:
                raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
    finally:
        writer.close()


async def _run(
    host: str, port: int, request: bytes, jobs: int, concurrency: int, expect: frozenset[int]
) -> None:
    base, extra = divmod(jobs, concurrency)
    shares = [base + (1 if i < extra else 0) for i in range(concurrency)]
    await asyncio.gather(*(_connection(host, port, request, n, expect) for n in shares))


def post_many(
    port: int,
    key: str,
    jobs: int,
    concurrency: int,
    *,
    body: dict[str, object] | None = None,
    host: str = "127.0.0.1",
    expect: frozenset[int] = frozenset({201}),
) -> float:
    """POST /v1/jobs `jobs` times over `concurrency` keep-alive connections; returns seconds."""
    request = post_request("/v1/jobs", key, body or DEFAULT_BODY, host)
    started = time.perf_counter()
    asyncio.run(_run(host, port, request, jobs, concurrency, expect))
    return time.perf_counter() - started


if __name__ == "__main__":
    port_arg, key_arg, jobs_arg, concurrency_arg = sys.argv[1:5]
    jobs_n = int(jobs_arg)
    elapsed = post_many(int(port_arg), key_arg, jobs_n, int(concurrency_arg))
    print(f"{jobs_n} jobs {elapsed:.2f} s {jobs_n / elapsed:.0f} jobs/s")
