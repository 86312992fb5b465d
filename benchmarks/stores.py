"""How fast each key store verifies keys, and how many round trips a request costs.

For memory, SQLite (a temporary file), PostgreSQL and Redis, in one run:

- `KeyManager.verify` per second, one call after another and with 50 concurrent tasks;
- requests per second through `APIKeyMiddleware` (raw ASGI, one after another), with the
  memory limiter and with the Redis limiter;
- round trips per authenticated request, counted for real: the store's (and the Redis
  limiter's) connections go through a TCP proxy (`tests/tcpproxy.py`) that counts, per
  connection, every reply that follows something the client sent, so pipelined commands
  count once, as they cost one wait. Usage flushes are held back during the count and
  measured on their own: one flush per process per interval, whatever the traffic. For
  Redis the server's own `INFO commandstats` delta is printed beside it (commands, not round
  trips, and server-wide: anyone else using the server adds to it);
- baselines measured in the same run: bare `PING` on redis-py's asyncio client and bare
  `SELECT 1` on asyncpg, sequential and 50 concurrent, against which the network stores'
  rates are set as ratios. SQLite is set against the ~2,500 verifications/s quoted in the
  issue for djangorestframework-api-key: a quoted figure, not measured here.

PostgreSQL: `APIKEYS_TEST_POSTGRES_URL` (default `postgresql://postgres@127.0.0.1:5432/postgres`),
in a table of the run's own, dropped after. Redis: `APIKEYS_TEST_REDIS_URL` (default
`redis://127.0.0.1:6379/0`), under a key prefix of the run's own, deleted after. A store
whose server cannot be reached is skipped with a message. Nothing here asserts on time.

Run: `python benchmarks/stores.py [--seconds 1.0] [--json results.json]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from apikeys import APIKeyMiddleware, Hasher, KeyManager, RateLimiter, store_from_url
from apikeys.stores import KeyStore

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks")]
from benchmarks._common import (  # noqa: E402
    PEPPER,
    POSTGRES_URL,
    REDIS_URL,
    UNLIMITED,
    asgi_caller,
    delete_redis_keys,
    fmt,
    reachable,
)
from tests.tcpproxy import TcpProxy  # noqa: E402 - the test suite's proxy, from the repo root

CONCURRENCY = 50
POSTGRES_POOL_MAX = 20
QUOTED_DRF_RATE = 2500.0
RUN = uuid.uuid4().hex[:10]


def where(url: str) -> str:
    """Host and port of `url`, never its password."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)


# --- stores -------------------------------------------------------------------------------


class Target:
    """One store of the run: its URL, options that isolate the run, and its cleanup."""

    def __init__(self, name: str, url: str, options: dict[str, Any], network: bool) -> None:
        self.name = name
        self.url = url
        self.options = options
        self.network = network

    def store(self, url: str | None = None, **extra: Any) -> KeyStore:
        return store_from_url(url or self.url, **self.options, **extra)

    async def cleanup(self) -> None:
        if self.name == "postgres":
            import asyncpg

            conn = await asyncpg.connect(self.url)
            try:
                table = self.options["table_name"]
                await conn.execute(f'DROP TABLE IF EXISTS "{table}", "{table}_usage_batches"')
            finally:
                await conn.close()
        elif self.name == "redis":
            await delete_redis_keys(f"{self.options['key_prefix']}*")


def targets(directory: Path, wanted: list[str]) -> tuple[list[Target], list[str]]:
    found, skipped = [], []
    for name in wanted:
        if name == "memory":
            found.append(Target("memory", "memory://", {}, network=False))
        elif name == "sqlite":
            found.append(Target("sqlite", f"sqlite:///{directory / 'keys.db'}", {}, network=False))
        elif name == "postgres":
            if reachable(POSTGRES_URL, 5432):
                # Pools as large as the baseline's POSTGRES_POOL_MAX connections (the
                # defaults, 2 and 0, are sized for many workers sharing one server).
                options = {"table_name": f"bench_keys_{RUN}", "pool_size": 10, "max_overflow": 10}
                found.append(Target("postgres", POSTGRES_URL, options, network=True))
            else:
                skipped.append(f"postgres: skipped, nothing answers at {where(POSTGRES_URL)}")
        elif name == "redis":
            if reachable(REDIS_URL, 6379):
                options = {"key_prefix": f"apikeys-bench-{RUN}:"}
                found.append(Target("redis", REDIS_URL, options, network=True))
            else:
                skipped.append(f"redis: skipped, nothing answers at {where(REDIS_URL)}")
    return found, skipped


# --- timing -------------------------------------------------------------------------------


Call = Callable[[], Awaitable[object]]


async def rates(loops: list[tuple[Call, int]], seconds: float, rounds: int = 3) -> list[float]:
    """Calls per second of each `(call, concurrent loops)`, over about `seconds` each.

    The calls take turns, round by round, so that whatever else the machine does hits them
    alike; each gets the best of its rounds, the one least disturbed.
    """
    for call, _ in loops:
        for _ in range(20):
            await call()
    best = [0.0] * len(loops)
    for _ in range(rounds):
        for index, (call, tasks) in enumerate(loops):
            done = 0
            deadline = time.perf_counter() + seconds / rounds

            async def loop(call: Call, deadline: float) -> None:
                nonlocal done
                while time.perf_counter() < deadline:
                    await call()
                    done += 1

            started = time.perf_counter()
            await asyncio.gather(*(loop(call, deadline) for _ in range(tasks)))
            best[index] = max(best[index], done / (time.perf_counter() - started))
    return best


async def rate(call: Call, seconds: float, tasks: int = 1) -> float:
    return (await rates([(call, tasks)], seconds))[0]


async def endpoint(request: Any) -> PlainTextResponse:
    return PlainTextResponse("ok")


def protected(manager: KeyManager, limiter: RateLimiter) -> APIKeyMiddleware:
    return APIKeyMiddleware(
        Starlette(routes=[Route("/api/v1/contacts", endpoint)]),
        manager=manager,
        scopes={"GET /api/v1/contacts": "contacts:read"},
        protect="/api/",
        limiter=limiter,
    )


def bearer(token: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {token}".encode())]


def limiter_for(kind: str, url: str | None = None) -> RateLimiter:
    if kind == "memory":
        return RateLimiter(UNLIMITED, "memory://")
    return RateLimiter(UNLIMITED, url or REDIS_URL, key_prefix=f"apikeys-bench-{RUN}-limits")


@asynccontextmanager
async def managed(store: KeyStore, flush_interval: float = 1.0) -> AsyncIterator[KeyManager]:
    manager = KeyManager(store, hasher=Hasher(pepper=PEPPER), usage_flush_interval=flush_interval)
    await store.setup()
    try:
        yield manager
    finally:
        await manager.aclose()


# --- round trips --------------------------------------------------------------------------


async def redis_commands() -> int:
    """Commands the Redis server has run since its stats were reset, `INFO` excluded."""
    from redis.asyncio import Redis

    client = Redis.from_url(REDIS_URL)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return sum(int(value["calls"]) for name, value in stats.items() if name != "cmdstat_info")


async def round_trips(
    target: Target, token: str, limiter_kind: str, count: int, local: KeyManager
) -> dict[str, Any]:
    """Round trips per request (store, limiter) and per usage flush, through counting proxies.

    A network store gets a store of its own through a proxy; memory and SQLite keep `local`
    (a second memory store would not know the key) and have no round trips to count.
    """
    store_proxy = TcpProxy.to_url(target.url).start() if target.network else None
    limiter_proxy = TcpProxy.to_url(REDIS_URL).start() if limiter_kind == "redis" else None
    proxies = [proxy for proxy in (store_proxy, limiter_proxy) if proxy]
    counts_redis = "redis" in (target.name, limiter_kind)
    limiter = limiter_for(limiter_kind, limiter_proxy.url(REDIS_URL) if limiter_proxy else None)
    try:
        async with contextlib.AsyncExitStack() as stack:
            manager = local
            if store_proxy:
                # Flushes an hour apart: the per-request count is the hot path alone.
                store = target.store(store_proxy.url(target.url))
                manager = await stack.enter_async_context(managed(store, flush_interval=3600))
            call = asgi_caller(
                protected(manager, limiter), [(b"authorization", f"Bearer {token}".encode())]
            )
            for _ in range(20):  # connections open, statements prepared, scripts loaded
                await call()
            await manager.flush()
            for proxy in proxies:
                proxy.reset_counts()
            commands = await redis_commands() if counts_redis else 0
            for _ in range(count):
                await call()
            if counts_redis:
                commands = await redis_commands() - commands
            store_trips = store_proxy.round_trips if store_proxy else 0
            limiter_trips = limiter_proxy.round_trips if limiter_proxy else 0
            flush_trips = None
            if store_proxy:
                store_proxy.reset_counts()
                await manager.flush()
                flush_trips = store_proxy.round_trips
    finally:
        await limiter.aclose()
        for proxy in proxies:
            proxy.close()
    return {
        "store_round_trips_per_request": store_trips / count if store_proxy else None,
        "limiter_round_trips_per_request": limiter_trips / count,
        "round_trips_per_usage_flush": flush_trips,
        "redis_commands_per_request": commands / count if counts_redis else None,
    }


# --- one store ----------------------------------------------------------------------------


class Baseline:
    """The bare round trip of a network store's server: sequential, and concurrent."""

    def __init__(self, what: str, sequential: Call, concurrent: Call, tasks: int) -> None:
        self.what = what
        self.sequential = sequential
        self.concurrent = concurrent
        self.tasks = tasks


@asynccontextmanager
async def baseline(target: Target, manager: KeyManager) -> AsyncIterator[Baseline | None]:
    if target.name == "redis":
        # The store's own client (its pool, timeouts, RESP2): the road a verify takes.
        client = manager.store.client  # type: ignore[attr-defined]

        async def ping() -> None:
            await client.ping()

        yield Baseline("PING on the store's redis-py client", ping, ping, CONCURRENCY)
    elif target.name == "postgres":
        import asyncpg

        # As many connections as the store's pool may open (pool_size 10 + max_overflow 10),
        # a loop on each: asyncpg's own pool costs more per call than the store's does.
        connections = [await asyncpg.connect(target.url) for _ in range(POSTGRES_POOL_MAX)]
        free = list(connections)

        async def select_one() -> None:
            await connections[0].fetchval("SELECT 1")

        async def on_own_connection() -> None:
            connection = free.pop()
            try:
                await connection.fetchval("SELECT 1")
            finally:
                free.append(connection)

        try:
            yield Baseline(
                f"asyncpg SELECT 1 (concurrent: {POSTGRES_POOL_MAX} connections, a loop each)",
                select_one,
                on_own_connection,
                POSTGRES_POOL_MAX,
            )
        finally:
            for connection in connections:
                await connection.close()
    else:
        yield None


async def measure(target: Target, seconds: float, count: int) -> dict[str, Any]:
    result: dict[str, Any] = {"store": target.name, "baseline": None}
    async with managed(target.store()) as manager:
        created = await manager.create(name="bench", workspace="bench", scopes=["contacts:read"])
        token = created.key

        async def verify() -> None:
            await manager.verify(token)

        async with baseline(target, manager) as base:
            if base is None:
                result["verify_per_s"] = await rate(verify, seconds)
                result["verify_per_s_concurrent"] = await rate(verify, seconds, CONCURRENCY)
            else:
                # Verify and the bare round trip take turns: their ratio is what counts.
                verify_rate, base_rate = await rates([(verify, 1), (base.sequential, 1)], seconds)
                verify_concurrent, base_concurrent = await rates(
                    [(verify, CONCURRENCY), (base.concurrent, base.tasks)], seconds
                )
                result["verify_per_s"] = verify_rate
                result["verify_per_s_concurrent"] = verify_concurrent
                result["baseline"] = {
                    "what": base.what,
                    "per_s": base_rate,
                    "per_s_concurrent": base_concurrent,
                }
        for kind in ("memory", "redis"):
            if kind == "redis" and not reachable(REDIS_URL, 6379):
                result[f"requests_per_s_{kind}_limiter"] = None
                continue
            limiter = limiter_for(kind)
            call = asgi_caller(
                protected(manager, limiter), [(b"authorization", f"Bearer {token}".encode())]
            )
            result[f"requests_per_s_{kind}_limiter"] = await rate(call, seconds / 2)
            await limiter.aclose()
            trips = await round_trips(target, token, kind, count, manager)
            result[f"round_trips_{kind}_limiter"] = trips
    return result


# --- report -------------------------------------------------------------------------------


def report(results: list[dict[str, Any]], skipped: list[str]) -> None:
    print("\nVerifications and requests per second (higher is better)")
    header = (
        f"{'store':<9} {'verify/s':>10} {'verify/s x50':>13} "
        f"{'req/s mem lim':>14} {'req/s redis lim':>16}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['store']:<9} {fmt(r['verify_per_s']):>10} {fmt(r['verify_per_s_concurrent']):>13} "
            f"{fmt(r['requests_per_s_memory_limiter']):>14} "
            f"{fmt(r['requests_per_s_redis_limiter']):>16}"
        )

    print("\nRound trips per authenticated request through the middleware (TCP-level count)")
    header = (
        f"{'store':<9} {'limiter':<8} {'store RT/req':>13} {'limiter RT/req':>15} "
        f"{'RT per usage flush':>19} {'Redis cmds/req':>15}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        for kind in ("memory", "redis"):
            trips = r.get(f"round_trips_{kind}_limiter")
            if trips is None:
                continue
            print(
                f"{r['store']:<9} {kind:<8} {fmt(trips['store_round_trips_per_request'], 2):>13} "
                f"{fmt(trips['limiter_round_trips_per_request'], 2):>15} "
                f"{fmt(trips['round_trips_per_usage_flush']):>19} "
                f"{fmt(trips['redis_commands_per_request'], 2):>15}"
            )
    print(
        "  store RT n/a: no network (memory, or SQLite's file in this process). A usage flush\n"
        "  writes every key's buffered count in one batch, once per interval (1 s) per process.\n"
        "  Redis cmds/req: the server's INFO commandstats delta, server-wide (other clients\n"
        "  inflate it); a MULTI/EXEC or script counts each command inside it."
    )

    print("\nRatios")
    sqlite = next((r for r in results if r["store"] == "sqlite"), None)
    if sqlite:
        print(
            f"  SQLite verify/s vs ~{QUOTED_DRF_RATE:,.0f}/s (djangorestframework-api-key, "
            "quoted in the issue, NOT measured here): "
            f"{sqlite['verify_per_s'] / QUOTED_DRF_RATE:.1f}x sequential, "
            f"{sqlite['verify_per_s_concurrent'] / QUOTED_DRF_RATE:.1f}x with 50 tasks"
        )
    for r in results:
        base = r["baseline"]
        if not base:
            continue
        print(
            f"  {r['store']}: bare {base['what']}: {fmt(base['per_s'])}/s sequential, "
            f"{fmt(base['per_s_concurrent'])}/s concurrent (measured in turns with verify)"
        )
        print(
            f"    verify/s vs that: {r['verify_per_s'] / base['per_s']:.2f} sequential, "
            f"{r['verify_per_s_concurrent'] / base['per_s_concurrent']:.2f} concurrent "
            "(1.00 = as fast as the bare round trip)"
        )
    if skipped:
        print()
    for line in skipped:
        print(line)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    wanted = [name.strip() for name in args.stores.split(",") if name.strip()]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as directory:
        found, skipped = targets(Path(directory), wanted)
        if not reachable(REDIS_URL, 6379):
            skipped.append(f"redis limiter: skipped, nothing answers at {where(REDIS_URL)}")
        for line in skipped:
            print(line, flush=True)
        for target in found:
            print(f"measuring {target.name} ...", flush=True)
            try:
                results.append(await measure(target, args.seconds, args.requests))
            finally:
                await target.cleanup()
        if reachable(REDIS_URL, 6379):
            await delete_redis_keys(f"*apikeys-bench-{RUN}*")
    report(results, skipped)
    return {
        "python": sys.version.split()[0],
        "seconds_per_measurement": args.seconds,
        "requests_counted": args.requests,
        "concurrency": CONCURRENCY,
        "quoted_reference_verify_per_s": {"djangorestframework-api-key": QUOTED_DRF_RATE},
        "results": results,
        "skipped": skipped,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="per rate measurement")
    parser.add_argument("--requests", type=int, default=300, help="requests per round-trip count")
    parser.add_argument("--stores", default="memory,sqlite,postgres,redis")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    arguments = parser.parse_args()
    started = time.perf_counter()
    output = asyncio.run(main(arguments))
    output["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(f"\n(run took {output['elapsed_s']} s)")
    if arguments.json:
        arguments.json.write_text(json.dumps(output, indent=2) + "\n")
        print(f"results written to {arguments.json}")
