"""What APIKeyMiddleware adds to a request, measured in-process.

A trivial Starlette endpoint is called through raw ASGI (no server, no client library) bare
and behind `APIKeyMiddleware` (memory store, memory limiter, default hasher), in
alternating rounds so that drift in the machine's speed hits both alike. Prints the time
per request of each, the difference and the ratio. Run: `python benchmarks/overhead.py`.

`--rate-limit` sets the key's limit (one limit that never refuses by default); for
several policies, say `--rate-limit "a=1000000000/second, b=1000000000/minute,
c=1000000000/day"`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks")]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._common import UNLIMITED, asgi_caller  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import PlainTextResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from apikeys import APIKeyMiddleware, Hasher, KeyManager, MemoryStore  # noqa: E402


async def endpoint(request: Any) -> PlainTextResponse:
    return PlainTextResponse("ok")


def build_apps(rate_limit: str = UNLIMITED) -> tuple[Any, Any, KeyManager]:
    bare = Starlette(routes=[Route("/api/v1/contacts", endpoint)])
    manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=os.urandom(32)))
    protected = APIKeyMiddleware(
        Starlette(routes=[Route("/api/v1/contacts", endpoint)]),
        manager=manager,
        scopes={"GET /api/v1/contacts": "contacts:read"},
        protect="/api/",
        rate_limit=rate_limit,
    )
    return bare, protected, manager


async def run_round(app: Any, headers: list[tuple[bytes, bytes]], count: int) -> float:
    """Seconds per request over `count` requests through `app`."""
    call = asgi_caller(app, headers)
    start = time.perf_counter()
    for _ in range(count):
        await call()
    return (time.perf_counter() - start) / count


async def main(rounds: int, per_round: int, rate_limit: str = UNLIMITED) -> None:
    bare, protected, manager = build_apps(rate_limit)
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
    print(f"rate limit:              {rate_limit}")
    print(f"bare Starlette:          {bare_us:8.2f} us/request")
    print(f"with APIKeyMiddleware:   {auth_us:8.2f} us/request")
    print(f"added by the middleware: {auth_us - bare_us:8.2f} us/request")
    print(f"ratio:                   {auth_us / bare_us:8.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=5000)
    parser.add_argument("--rate-limit", default=UNLIMITED, help="the key's limit or policies")
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.per_round, args.rate_limit))
