"""What APIKeyMiddleware adds to a request, measured in-process.

A trivial Starlette endpoint is called through raw ASGI (no server, no client library) bare
and behind `APIKeyMiddleware` (memory store, memory limiter, default hasher), in
alternating rounds so that drift in the machine's speed hits both alike. Prints the time
per request of each, the difference and the ratio. Run: `python benchmarks/overhead.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time
from typing import Any

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from apikeys import APIKeyMiddleware, Hasher, KeyManager, MemoryStore


async def endpoint(request: Any) -> PlainTextResponse:
    return PlainTextResponse("ok")


def build_apps() -> tuple[Any, Any, KeyManager]:
    bare = Starlette(routes=[Route("/api/v1/contacts", endpoint)])
    manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=os.urandom(32)))
    protected = APIKeyMiddleware(
        Starlette(routes=[Route("/api/v1/contacts", endpoint)]),
        manager=manager,
        scopes={"GET /api/v1/contacts": "contacts:read"},
        protect="/api/",
        rate_limit="1000000000/minute",
    )
    return bare, protected, manager


async def run_round(app: Any, headers: list[tuple[bytes, bytes]], count: int) -> float:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/api/v1/contacts",
        "raw_path": b"/api/v1/contacts",
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 8000),
    }
    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    start = time.perf_counter()
    for _ in range(count):
        await app(dict(scope), receive, send)
    elapsed = time.perf_counter() - start
    if any(status != 200 for status in statuses):
        raise SystemExit(f"unexpected statuses: {sorted(set(statuses))}")
    return elapsed / count


async def main(rounds: int, per_round: int) -> None:
    bare, protected, manager = build_apps()
    created = await manager.create(name="bench", workspace="bench", scopes=["contacts:read"])
    auth = [(b"authorization", f"Bearer {created.key}".encode())]
    plain = [(b"user-agent", b"bench")]
    await run_round(bare, plain, 2000)
    await run_round(protected, auth, 2000)
    gc.collect()
    bare_times, auth_times = [], []
    for _ in range(rounds):
        bare_times.append(await run_round(bare, plain, per_round))
        auth_times.append(await run_round(protected, auth, per_round))
    await manager.aclose()
    # The fastest round of each is the least disturbed by whatever else the machine runs.
    bare_us = min(bare_times) * 1e6
    auth_us = min(auth_times) * 1e6
    print(f"requests per round: {per_round}, rounds: {rounds} (best round of each)")
    print(f"bare Starlette:          {bare_us:8.2f} us/request")
    print(f"with APIKeyMiddleware:   {auth_us:8.2f} us/request")
    print(f"added by the middleware: {auth_us - bare_us:8.2f} us/request")
    print(f"ratio:                   {auth_us / bare_us:8.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=5000)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.per_round))
