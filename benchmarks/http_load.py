"""HTTP throughput and latency: one trivial endpoint under uvicorn, bare and behind the middleware.

The same Starlette endpoint (`GET /api/v1/contacts`, a 2-byte `ok`) is served by uvicorn, one
worker, without access log, on uvloop and httptools when the server's interpreter has them
(else asyncio and h11: the report says which). One server runs it bare; for each store the
other runs it behind `APIKeyMiddleware` (memory, SQLite, PostgreSQL and Redis stores, with
the memory limiter for memory and SQLite, the Redis limiter for Redis, both for PostgreSQL).
Two first servers run it behind the hand-written check of `benchmarks/handwritten.py`, the
yardstick, alone and adding the two RateLimit headers apikeys sends: what they reach of
bare is as far as such a check gets on this machine, and the figure the HTTP aims for
apikeys are read against.
The load comes from a second process: `wrk` (Debian's package) when it is installed, else an
async httpx loop, which is much slower than the server and says so. Bare and authenticated
runs alternate, round by round, so the machine's drift hits both alike; the ratio is taken
per pair of runs. The key has a rate limit of a billion a minute: nothing is ever refused,
and any non-2xx answer makes the run fail loudly.

Round trips: for PostgreSQL and Redis, another server goes through counting TCP proxies
(`tests/tcpproxy.py`) to the store and to the Redis limiter and takes sequential requests: a
round trip is a reply after something was sent, per connection. The servers' own counters
are printed beside it: Redis `INFO commandstats` deltas (server-wide, so other clients add
to them) and PostgreSQL `pg_stat_database.xact_commit` of a database of the run's own.

Run: `python benchmarks/http_load.py [--quick] [--json out.json] [--profile]`. `bench.py` runs it
with the bench venv's python as the server's interpreter (uvloop, httptools).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks")]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import AsyncIterator, Iterator  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._common import (  # noqa: E402
    BENCH_TAG,
    PEPPER,
    POSTGRES_URL,
    REDIS_URL,
    RESULTS,
    UNLIMITED,
    create_database,
    delete_redis_keys,
    drop_database,
    fmt,
    free_port,
    interrupt_on_sigterm,
    postgres_reachable,
    python_has,
    redis_reachable,
    run_id,
    sqlite_rates,
    stop_process,
    summary,
    table,
    token_for,
    wait_for_port,
    write_json,
)

PATH = "/api/v1/contacts"
SERVED_PATH = "/bench/served"
STATEMENTS_PATH = "/bench/sqlite-statements"
HAND_SCOPE = "contacts:read"
# What uvicorn imports in the server processes: this module's build_app.
APP_TARGET = "benchmarks.http_load:build_app"

# --- the server side: uvicorn imports this module and calls build_app() ----------------------


def build_app() -> Any:
    """The app a benchmark server serves, configured by `BENCH_*` environment variables."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    served = [0]

    async def contacts(request: Request) -> PlainTextResponse:
        served[0] += 1
        return PlainTextResponse("ok")

    async def served_count(request: Request) -> PlainTextResponse:
        return PlainTextResponse(str(served[0]))

    mode = os.environ.get("BENCH_MODE", "bare")
    if mode == "bare":
        return Starlette(routes=[Route(PATH, contacts)])
    if mode == "hand-written":
        # The yardstick of benchmarks/handwritten.py, served: what the aims leave to apikeys.
        from benchmarks.handwritten import HandWrittenCheck

        check = HandWrittenCheck(
            Starlette(routes=[Route(PATH, contacts)]), PEPPER.encode(), {("GET", PATH): HAND_SCOPE}
        )
        check.add_key(os.environ["BENCH_TOKEN"], [HAND_SCOPE])
        if not os.environ.get("BENCH_HAND_HEADERS"):
            return check
        # The same check sending the two RateLimit headers apikeys sends for this key, the
        # way apikeys adds them: what those headers cost the server, apart.
        rate_headers = [
            (b"ratelimit-policy", b'"default";q=1000000000;w=60'),
            (b"ratelimit", b'"default";r=999999999;t=60'),
        ]

        async def with_headers(scope: Any, receive: Any, send: Any) -> None:
            def send_with_rate_headers(message: Any) -> Any:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", ()), *rate_headers]
                return send(message)

            await check(scope, receive, send_with_rate_headers)

        return with_headers

    from benchmarks._common import bench_record

    sqlite_store = os.environ["BENCH_STORE_URL"].startswith("sqlite")
    statements = count_sqlite_statements() if sqlite_store else collections.Counter()

    async def statement_count(request: Request) -> PlainTextResponse:
        return PlainTextResponse(json.dumps(statements))

    from apikeys import APIKeyMiddleware, Hasher, KeyManager, RateLimiter, store_from_url
    from apikeys.keys import split_key
    from apikeys.types import StoredKey

    options = json.loads(os.environ.get("BENCH_STORE_OPTIONS") or "{}")
    store = store_from_url(os.environ["BENCH_STORE_URL"], **options)
    hasher = Hasher(pepper=PEPPER)
    manager = KeyManager(
        store,
        hasher=hasher,
        usage_flush_interval=float(os.environ.get("BENCH_FLUSH_INTERVAL") or 1.0),
        cache=os.environ.get("BENCH_CACHE", "on") == "on",
    )
    limiter = RateLimiter(
        UNLIMITED,
        os.environ.get("BENCH_LIMITER_URL", "memory://"),
        key_prefix=os.environ.get("BENCH_LIMITER_PREFIX", "apikeys"),
    )
    _, key_id, secret = split_key(os.environ["BENCH_TOKEN"])

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await store.setup()
        if await store.get(key_id) is None:
            await store.insert(StoredKey(bench_record(key_id), hasher.hash(secret)))
        try:
            yield
        finally:
            await limiter.aclose()
            await manager.aclose()

    # SERVED_PATH, outside the protected prefix, tells how many requests the endpoint answered.
    routes = [
        Route(PATH, contacts),
        Route(SERVED_PATH, served_count),
        Route(STATEMENTS_PATH, statement_count),
    ]
    return APIKeyMiddleware(
        Starlette(routes=routes, lifespan=lifespan),
        manager=manager,
        scopes={f"GET {PATH}": "contacts:read"},
        protect="/api/",
        rate_limit=UNLIMITED,
        limiter=limiter,
    )


# The store's read of one key, as SQLAlchemy compiles it (and the trace shows it, expanded).
_KEY_READ = re.compile(r"FROM apikeys_keys\s+WHERE apikeys_keys\.id = ")


def count_sqlite_statements() -> collections.Counter[str]:
    """Count every statement this process runs on SQLite: the store's operations, by kind.

    Every sqlite3 connection made from now on (aiosqlite makes its own in its thread, the
    store and its channel their own) reports each statement to a trace callback. Kinds:
    `all`; `probes`, the key cache channel's `PRAGMA data_version`, run every poll interval
    whatever the traffic; `key_reads`, the store's read of one key, what a request costs the
    store when its key is not cached. The rest (the usage flush, the registry of readers,
    the change log's reads and pruning, the webhooks' poll) also runs on a clock.
    """
    import sqlite3

    counter: collections.Counter[str] = collections.Counter(all=0, probes=0, key_reads=0)
    connect = sqlite3.connect

    def trace(statement: str) -> None:
        counter["all"] += 1
        if statement == "PRAGMA data_version":
            counter["probes"] += 1
        elif _KEY_READ.search(statement):
            counter["key_reads"] += 1

    def counting_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        connection = connect(*args, **kwargs)
        connection.set_trace_callback(trace)
        return connection

    sqlite3.connect = counting_connect  # type: ignore[assignment]
    return counter


# --- servers ------------------------------------------------------------------------------


class Server:
    """One uvicorn process serving `build_app()` on a port of its own."""

    def __init__(self, python: str, env: dict[str, str], loop: str, http: str, log: Path) -> None:
        self.port = free_port()
        self.log = log
        command = [
            python,
            "-m",
            "uvicorn",
            APP_TARGET,
            "--factory",
            "--app-dir",
            str(ROOT),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--no-access-log",
            "--log-level",
            "warning",
            "--loop",
            loop,
            "--http",
            http,
        ]
        full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        self._log_file = log.open("ab")
        self.process = subprocess.Popen(
            command, env=full_env, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=str(ROOT)
        )
        try:
            wait_for_port(self.port, self.process)
        except Exception:
            self.stop()
            raise RuntimeError(f"the server did not start:\n{log.read_text()[-3000:]}") from None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{PATH}"

    def cpu_seconds(self) -> float | None:
        """User and system CPU time the server process has used so far (Linux only)."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        stop_process(self.process)
        self._log_file.close()


@contextlib.contextmanager
def serving(python: str, env: dict[str, str], loop: str, http: str, log: Path) -> Iterator[Server]:
    server = Server(python, env, loop, http, log)
    try:
        yield server
    finally:
        server.stop()


# --- load ---------------------------------------------------------------------------------

_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s)", text.strip())
    if match is None:
        raise ValueError(f"not a wrk duration: {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_wrk(output: str) -> dict[str, Any]:
    """Requests/s, latency percentiles (ms) and errors from `wrk --latency` output."""
    rps = re.search(r"Requests/sec:\s*([\d.]+)", output)
    if rps is None:
        raise RuntimeError(f"wrk printed no Requests/sec:\n{output}")
    latency = {
        f"p{pct}": _ms(value)
        for pct, value in re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", output, re.M)
    }
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", output)
    errors = re.search(r"Socket errors: (.*)", output)
    total = re.search(r"(\d+) requests in", output)
    return {
        "rps": float(rps.group(1)),
        "p50_ms": latency.get("p50"),
        "p99_ms": latency.get("p99"),
        "requests": int(total.group(1)) if total else None,
        "non_2xx": int(non_2xx.group(1)) if non_2xx else 0,
        "socket_errors": errors.group(1) if errors else None,
    }


class Load:
    """Runs the load generator: wrk, else the httpx loop of this file in a second process."""

    def __init__(self, connections: int, seconds: float, python: str, threads: int = 1) -> None:
        self.connections = connections
        self.seconds = seconds
        self.threads = threads
        self.python = python
        self.wrk = shutil.which("wrk")

    def describe(self) -> dict[str, Any]:
        if self.wrk:
            version = subprocess.run(
                [self.wrk, "--version"], capture_output=True, text=True, check=False
            ).stdout.split("[")[0]
            return {
                "tool": version.strip() or "wrk",
                "threads": self.threads,
                "connections": self.connections,
                "seconds_per_run": self.seconds,
            }
        return {
            "tool": "httpx async loop (wrk not installed): the client, not the server, "
            "may be the limit",
            "connections": self.connections,
            "seconds_per_run": self.seconds,
        }

    def run(self, url: str, token: str | None, seconds: float | None = None) -> dict[str, Any]:
        duration = seconds or self.seconds
        if self.wrk:
            command = [
                self.wrk,
                f"-t{self.threads}",
                f"-c{self.connections}",
                f"-d{max(1, round(duration))}s",  # wrk takes whole seconds
                "--latency",
                "--timeout",
                "5s",
            ]
            if token:
                command += ["-H", f"Authorization: Bearer {token}"]
            output = subprocess.run(
                [*command, url], capture_output=True, text=True, check=True, timeout=duration + 30
            ).stdout
            result = parse_wrk(output)
        else:
            command = [
                self.python,
                str(Path(__file__)),
                "--load-only",
                url,
                "--seconds",
                str(duration),
                "--connections",
                str(self.connections),
            ]
            if token:
                command += ["--token", token]
            output = subprocess.run(
                command, capture_output=True, text=True, check=True, timeout=duration + 60
            ).stdout
            result = json.loads(output.strip().splitlines()[-1])
        if result["non_2xx"] or (result.get("socket_errors") or "").strip(" ,").replace(
            "connect 0, read 0, write 0, timeout 0", ""
        ):
            raise RuntimeError(
                f"the load run against {url} had errors ({result}): the numbers would mean nothing"
            )
        return result


async def httpx_load(url: str, token: str | None, seconds: float, connections: int) -> None:
    """The fallback load generator: `connections` loops of GETs, for `seconds`."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    latencies: list[float] = []
    non_2xx = 0
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(limits=limits, headers=headers) as client:
        deadline = time.perf_counter() + seconds

        async def loop() -> None:
            nonlocal non_2xx
            while (now := time.perf_counter()) < deadline:
                response = await client.get(url)
                latencies.append(time.perf_counter() - now)
                if response.status_code >= 300:
                    non_2xx += 1

        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(connections)))
        elapsed = time.perf_counter() - started
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000

    print(
        json.dumps(
            {
                "rps": len(latencies) / elapsed,
                "p50_ms": pct(0.50),
                "p99_ms": pct(0.99),
                "requests": len(latencies),
                "non_2xx": non_2xx,
                "socket_errors": None,
            }
        )
    )


# --- round trips --------------------------------------------------------------------------


def _proxy_class() -> Any:
    from tests.tcpproxy import TcpProxy

    return TcpProxy


async def redis_commandstats() -> dict[str, int]:
    from redis.asyncio import Redis

    client = Redis.from_url(REDIS_URL)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return {
        name.removeprefix("cmdstat_"): int(value["calls"])
        for name, value in stats.items()
        if name != "cmdstat_info"
    }


async def postgres_counters(database: str) -> tuple[int, int]:
    """(transactions committed, backends connected) of `database`, read from another one."""
    import asyncpg

    conn = await asyncpg.connect(POSTGRES_URL)
    try:
        row = await conn.fetchrow(
            "SELECT xact_commit + xact_rollback AS xacts,"
            " (SELECT count(*) FROM pg_stat_activity WHERE datname = $1) AS backends"
            " FROM pg_stat_database WHERE datname = $1",
            database,
        )
    finally:
        await conn.close()
    return int(row["xacts"]), int(row["backends"])


async def settled_postgres_counter(database: str) -> int:
    """The database's transaction count once no backend is left to report more."""
    deadline = time.monotonic() + 15.0
    last = None
    while True:
        xacts, backends = await postgres_counters(database)
        if backends == 0 and xacts == last:
            return xacts
        if time.monotonic() > deadline:
            return xacts
        last = xacts
        await asyncio.sleep(0.3)


def count_round_trips(
    config: Config,
    python: str,
    loop: str,
    http: str,
    token: str,
    requests: int,
    logs: Path,
    load: Load | None = None,
) -> dict[str, Any]:
    """Round trips per request to the store and the limiter, through counting proxies.

    First `requests` sequential requests (the hot path's own count), then, with `load`, a
    few seconds of concurrent load: what the pools do under it (new connections, and the
    round trips that opening them costs) shows there and only there.
    """
    import httpx

    proxy_class = _proxy_class()
    store_proxy = proxy_class.to_url(config.store_url).start() if config.network_store else None
    limiter_proxy = proxy_class.to_url(REDIS_URL).start() if config.limiter == "redis" else None
    env = config.server_env(token)
    env["BENCH_FLUSH_INTERVAL"] = "3600"  # no usage flush during the count: measured apart
    if store_proxy:
        env["BENCH_STORE_URL"] = store_proxy.url(config.store_url)
    if limiter_proxy:
        env["BENCH_LIMITER_URL"] = limiter_proxy.url(REDIS_URL)
    proxies = [proxy for proxy in (store_proxy, limiter_proxy) if proxy]
    result: dict[str, Any] = {"requests": requests}
    try:
        if config.store == "postgres":
            xacts_before = asyncio.run(settled_postgres_counter(config.database))
        server_args = (python, env, loop, http)
        server = Server(python, env, loop, http, logs / f"rt-{config.name}.log")
        try:
            with httpx.Client(headers={"Authorization": f"Bearer {token}"}) as client:
                for _ in range(20):  # connections opened, statements prepared, scripts loaded
                    client.get(server.url).raise_for_status()
                for proxy in proxies:
                    proxy.reset_counts()
                commands_before = asyncio.run(redis_commandstats()) if config.uses_redis else {}
                for _ in range(requests):
                    client.get(server.url).raise_for_status()
                commands_after = asyncio.run(redis_commandstats()) if config.uses_redis else {}
            store_trips = store_proxy.round_trips if store_proxy else 0
            limiter_trips = limiter_proxy.round_trips if limiter_proxy else 0
            if store_proxy:
                store_proxy.reset_counts()
        finally:
            server.stop()  # graceful: the usage flush on lifespan shutdown goes out now
        result["store_round_trips_per_request"] = store_trips / requests
        result["limiter_round_trips_per_request"] = limiter_trips / requests
        result["round_trips_per_request"] = (store_trips + limiter_trips) / requests
        result["round_trips_of_usage_flush_at_shutdown"] = (
            store_proxy.round_trips if store_proxy else None
        )
        if config.uses_redis:
            deltas = {
                name: (commands_after.get(name, 0) - commands_before.get(name, 0)) / requests
                for name in commands_after
            }
            result["redis_commands_per_request"] = {
                name: round(value, 3) for name, value in sorted(deltas.items()) if value >= 0.05
            }
        if config.store == "postgres":
            xacts_after = asyncio.run(settled_postgres_counter(config.database))
            result["postgres_transactions_per_request"] = (xacts_after - xacts_before) / requests
            result["postgres_transactions_note"] = (
                f"whole server life over {requests} requests: startup, 20 warm-up requests "
                "and the shutdown flush included"
            )
        if load is not None:
            named = {"store": store_proxy, "limiter": limiter_proxy}
            live = {name: proxy for name, proxy in named.items() if proxy is not None}
            result["under_load"] = count_under_load(server_args, live, token, load, logs)
    finally:
        for proxy in proxies:
            proxy.close()
    return result


@contextlib.contextmanager
def private_redis(logs: Path) -> Iterator[str]:
    """A Redis server of the benchmark's own, so that its command count is ours alone."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: cannot count Redis commands")
    port = free_port()
    log = (logs / f"redis-{port}.log").open("ab")
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_port(port, process)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_process(process)
        log.close()


async def redis_total_commands(url: str) -> int:
    from redis.asyncio import Redis

    client = Redis.from_url(url)
    try:
        stats = await client.info("stats")
    finally:
        await client.aclose()
    return int(stats["total_commands_processed"])


def count_store_operations(
    config: Config, python: str, loop: str, http: str, token: str, load: Load, logs: Path
) -> dict[str, Any]:
    """Store operations per authenticated request in steady state, counted by the store.

    - Redis: commands processed by a Redis server of the benchmark's own (the key store and
      the limiter both on it), during 3 s of load after a warm-up;
    - SQLite: statements the server process ran on the database (a trace callback), likewise;
    - PostgreSQL: transactions the server counted in the benchmark's own database over the
      server's whole life (startup, warm-up, load, shutdown flush) divided by the requests
      it answered: an upper bound, since PostgreSQL reports other backends' counts late.
    """
    import httpx

    env = config.server_env(token)
    result: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        redis_url = None
        if config.store == "redis":
            redis_url = stack.enter_context(private_redis(logs))
            env["BENCH_STORE_URL"] = redis_url
            if config.limiter == "redis":
                env["BENCH_LIMITER_URL"] = redis_url
        if config.store == "postgres":
            xacts_before = asyncio.run(settled_postgres_counter(config.database))
        server = Server(python, env, loop, http, logs / f"ops-{config.name}.log")
        served_url = server.url.replace(PATH, SERVED_PATH)
        statements_url = server.url.replace(PATH, STATEMENTS_PATH)
        try:
            with httpx.Client(headers={"Authorization": f"Bearer {token}"}) as client:
                for _ in range(20):
                    client.get(server.url).raise_for_status()
                load.run(server.url, token, seconds=1)
                time.sleep(0.5)
                served_before = int(client.get(served_url).text)
                statements_before = client.get(statements_url).json()
                window_started = time.monotonic()
                commands_before = asyncio.run(redis_total_commands(redis_url)) if redis_url else 0
                load.run(server.url, token, seconds=3)
                time.sleep(0.5)
                commands_after = asyncio.run(redis_total_commands(redis_url)) if redis_url else 0
                statements_after = client.get(statements_url).json()
                window = time.monotonic() - window_started
                served_after = int(client.get(served_url).text)
        finally:
            server.stop()
        served = max(1, served_after - served_before)
        result["requests"] = served
        if config.store == "redis":
            # Minus the second INFO, which Redis counts before answering it.
            result["store_operations_per_request"] = (commands_after - commands_before - 1) / served
            result["unit"] = "Redis commands (store and limiter), a server of its own"
        elif config.store == "sqlite":
            ran = {
                kind: statements_after[kind] - statements_before[kind] for kind in statements_after
            }
            result["store_operations_per_request"] = ran["all"] / served
            result["unit"] = "SQLite statements of the server process"
            # Nearly all of them run on a clock, not per request: the figure above is their
            # rate over the request rate, and moves with the machine's load. Shown apart.
            result["requests_per_second"] = served / window
            result["statements_per_second"] = ran["all"] / window
            result["probes_per_second"] = ran["probes"] / window
            result["key_reads_per_request"] = ran["key_reads"] / served
        elif config.store == "postgres":
            xacts_after = asyncio.run(settled_postgres_counter(config.database))
            result["store_operations_per_request"] = (xacts_after - xacts_before) / max(
                1, served_after
            )
            result["unit"] = (
                "PostgreSQL transactions over the server's whole life / requests answered"
            )
    return result


def count_under_load(
    server_args: tuple[str, dict[str, str], str, str],
    proxies: dict[str, Any],
    token: str,
    load: Load,
    logs: Path,
) -> dict[str, Any]:
    """Round trips and connections opened per request under wrk's concurrent load, on a
    server of its own through the same proxies. A first second of load lets the pools grow
    to the concurrency; only what happens after it (steady state) is counted."""
    import httpx

    python, env, loop, http = server_args
    server = Server(python, env, loop, http, logs / "rt-load.log")
    served_url = server.url.replace(PATH, SERVED_PATH)
    try:
        with httpx.Client(headers={"Authorization": f"Bearer {token}"}) as client:
            for _ in range(20):
                client.get(server.url).raise_for_status()
            load.run(server.url, token, seconds=1)
            time.sleep(0.5)  # requests still in flight when wrk stopped finish uncounted
            for proxy in proxies.values():
                proxy.reset_counts()
            before = int(client.get(served_url).text)
            run = load.run(server.url, token, seconds=3)
            # Requests in flight when wrk stops are answered by the server but not counted by
            # wrk, while their round trips are: the server's own count includes them.
            time.sleep(0.5)
            served = int(client.get(served_url).text) - before
        counts = {name: (proxy.round_trips, proxy.connections) for name, proxy in proxies.items()}
    finally:
        server.stop()
    done = served or 1
    result: dict[str, Any] = {
        "requests": served,
        "requests_counted_by_load": run["requests"],
        "load_connections": load.connections,
        "round_trips_per_request": sum(trips for trips, _ in counts.values()) / done,
    }
    for name, (trips, opened) in counts.items():
        result[f"{name}_round_trips_per_request"] = trips / done
        result[f"{name}_connections_opened"] = opened
    return result


# --- configurations -----------------------------------------------------------------------


class Config:
    """One authenticated setup: a store, a limiter, and the key cache on or off."""

    def __init__(
        self,
        store: str,
        limiter: str,
        run: str,
        directory: Path,
        database: str,
        cache: bool = True,
    ) -> None:
        self.store = store
        self.limiter = limiter
        self.run = run
        self.database = database
        self.cache = cache
        self.options: dict[str, Any] = {}
        if store == HAND_WRITTEN:
            self.store_url = ""
        elif store == "memory":
            self.store_url = "memory://"
        elif store == "sqlite":
            self.store_url = f"sqlite:///{directory / f'http-{limiter}.db'}"
        elif store == "postgres":
            self.store_url = POSTGRES_URL.rpartition("/")[0] + "/" + database
        else:
            self.store_url = REDIS_URL
            self.options = {"key_prefix": f"{BENCH_TAG}-{run}:"}

    @property
    def name(self) -> str:
        if self.store == HAND_WRITTEN:
            return HAND_WRITTEN if self.limiter == "none" else f"{HAND_WRITTEN}+{self.limiter}"
        cache = "" if self.store == "memory" else ("+cache" if self.cache else "+no-cache")
        return f"{self.store}+{self.limiter}-limiter{cache}"

    @property
    def network_store(self) -> bool:
        return self.store in ("postgres", "redis")

    @property
    def uses_redis(self) -> bool:
        return self.store == "redis" or self.limiter == "redis"

    def server_env(self, token: str) -> dict[str, str]:
        if self.store == HAND_WRITTEN:
            headers = {"BENCH_HAND_HEADERS": "1"} if self.limiter == "headers" else {}
            return {"BENCH_MODE": HAND_WRITTEN, "BENCH_TOKEN": token, **headers}
        return {
            "BENCH_MODE": "auth",
            "BENCH_STORE_URL": self.store_url,
            "BENCH_STORE_OPTIONS": json.dumps(self.options),
            "BENCH_LIMITER_URL": REDIS_URL if self.limiter == "redis" else "memory://",
            "BENCH_LIMITER_PREFIX": f"{BENCH_TAG}-{self.run}-limits",
            "BENCH_TOKEN": token,
            "BENCH_CACHE": "on" if self.cache else "off",
        }


def server_flavour(python: str, want_fast: bool = True) -> tuple[str, str]:
    """uvicorn's --loop and --http for `python`: uvloop and httptools when it has them."""
    loop = "uvloop" if want_fast and python_has(python, "uvloop") else "asyncio"
    http = "httptools" if want_fast and python_has(python, "httptools") else "h11"
    return loop, http


def check_answer(url: str, token: str, limited: bool = True) -> dict[str, str]:
    """One request: it must be a 200 with the rate-limit headers (when `limited`), or
    nothing is worth timing."""
    import httpx

    response = httpx.get(url, headers={"Authorization": f"Bearer {token}"})
    if response.status_code != 200 or (limited and "ratelimit" not in response.headers):
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:300]}")
    return {"status": str(response.status_code), "ratelimit": response.headers.get("ratelimit", "")}


def measure_config(
    config: Config,
    bare: Server,
    load: Load,
    python: str,
    loop: str,
    http: str,
    token: str,
    rounds: int,
    logs: Path,
    profile: bool,
) -> dict[str, Any]:
    print(f"  {config.name}: serving", flush=True)
    result: dict[str, Any] = {"store": config.store, "limiter": config.limiter}
    env = config.server_env(token)
    with serving(python, env, loop, http, logs / f"{config.name}.log") as auth:
        check_answer(auth.url, token, limited=config.name != HAND_WRITTEN)
        load.run(bare.url, None, seconds=1)
        load.run(auth.url, token, seconds=1)
        bare_runs, auth_runs = [], []
        for index in range(rounds):
            # Alternate which goes first, so a drift within a round hits both alike.
            order = ("bare", "auth") if index % 2 == 0 else ("auth", "bare")
            for which in order:
                if which == "bare":
                    bare_runs.append(loaded(bare, load, None))
                else:
                    auth_runs.append(loaded(auth, load, token))
            print(
                f"    round {index + 1}/{rounds}: bare {bare_runs[-1]['rps']:,.0f} req/s, "
                f"authenticated {auth_runs[-1]['rps']:,.0f} req/s",
                flush=True,
            )
        if profile:
            result["profile"] = profile_server(auth, load, token, logs, config.name)
    result["bare"] = runs_summary(bare_runs)
    result["auth"] = runs_summary(auth_runs)
    ratios = [a["rps"] / b["rps"] for a, b in zip(auth_runs, bare_runs, strict=True)]
    result["ratio_paired"] = summary(ratios)
    result["ratio_of_best"] = result["auth"]["rps"]["best"] / result["bare"]["rps"]["best"]
    result["ratio_of_medians"] = result["auth"]["rps"]["median"] / result["bare"]["rps"]["median"]
    if result["bare"]["cpu_us_per_request"] and result["auth"]["cpu_us_per_request"]:
        result["cpu_us_added_per_request"] = (
            result["auth"]["cpu_us_per_request"]["median"]
            - result["bare"]["cpu_us_per_request"]["median"]
        )
    return result


def loaded(server: Server, load: Load, token: str | None) -> dict[str, Any]:
    """One load run, with the server's CPU time per request (user + system)."""
    before = server.cpu_seconds()
    result = load.run(server.url, token)
    after = server.cpu_seconds()
    if before is not None and after is not None and result.get("requests"):
        result["cpu_us_per_request"] = (after - before) / result["requests"] * 1e6
    return result


def runs_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    cpu = [run["cpu_us_per_request"] for run in runs if "cpu_us_per_request" in run]
    return {
        "rps": summary([run["rps"] for run in runs]),
        "cpu_us_per_request": summary(cpu, higher_is_better=False) if cpu else None,
        "p50_ms": summary([run["p50_ms"] for run in runs], higher_is_better=False),
        "p99_ms": summary([run["p99_ms"] for run in runs], higher_is_better=False),
        "runs": runs,
    }


def profile_server(server: Server, load: Load, token: str, logs: Path, name: str) -> Any:
    """Sample the authenticated server with py-spy under load; the hottest functions."""
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    bench_pyspy = ROOT / "benchmarks" / ".venv" / "bin" / "py-spy"
    if not Path(pyspy).exists() and bench_pyspy.exists():
        pyspy = str(bench_pyspy)
    if not Path(pyspy).exists():
        return "py-spy not found: install it in the bench venv"
    out = RESULTS / f"profile-{name}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    seconds = max(5, int(load.seconds))
    sampler = subprocess.Popen(
        [
            pyspy,
            "record",
            "--pid",
            str(server.process.pid),
            "--duration",
            str(seconds),
            "--rate",
            "500",
            "--format",
            "raw",
            "--nonblocking",
            "-o",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    before = server.cpu_seconds()
    run = load.run(server.url, token, seconds=seconds)
    after = server.cpu_seconds()
    sampler.wait(seconds + 30)
    profile = summarise_profile(out)
    if before is not None and after is not None and run.get("requests"):
        # The load ran a little shorter than the sampler: close enough to scale shares to time.
        cpu_us = (after - before) / run["requests"] * 1e6
        profile["server_cpu_us_per_request"] = round(cpu_us, 1)
        for key in ("self", "inclusive"):
            profile[key] = [
                (frame, share, round(share * cpu_us / 100, 2)) for frame, share in profile[key]
            ]
    return profile


def summarise_profile(path: Path, top: int = 25) -> dict[str, Any]:
    """Self and inclusive sample shares per function, from py-spy's collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = [_function(frame) for frame in stack.split(";")]
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    if not total:
        return {"samples": 0}
    return {
        "samples": total,
        "file": str(path.relative_to(ROOT)),
        "self": [(frame, round(100 * n / total, 1)) for frame, n in own.most_common(top)],
        "inclusive": [
            (frame, round(100 * n / total, 1)) for frame, n in inclusive.most_common(top * 2)
        ],
    }


def _function(frame: str) -> str:
    """`name (file)` of a py-spy frame `name (path:line)`: one entry per function."""
    match = re.fullmatch(r"\s*(.*?) \((.*?)(?::\d+)?\)\s*", frame)
    if not match:
        return frame.strip()
    name, location = match.groups()
    for marker in ("site-packages/", "src/", "lib/python3.11/", "lib/python3"):
        if marker in location:
            location = location.split(marker, 1)[1]
    return f"{name} ({location})"


# --- the whole section --------------------------------------------------------------------


# The yardstick's row: the hand-written check of benchmarks/handwritten.py behind the same
# server (a Bearer header, a peppered HMAC-SHA256, a dict lookup, a scope test; no key
# format, limits, RateLimit headers or usage counts). What it reaches is the ceiling of
# the aims on this machine: apikeys does all it does and more.
HAND_WRITTEN = "hand-written"

# (store, limiter, key cache): every store with its cache, and without it as the baseline
# measured in the same run.
CONFIGS = (
    (HAND_WRITTEN, "none", True),
    (HAND_WRITTEN, "headers", True),
    ("memory", "memory", True),
    ("sqlite", "memory", True),
    ("sqlite", "memory", False),
    ("postgres", "memory", True),
    ("postgres", "memory", False),
    ("postgres", "redis", True),
    ("redis", "redis", True),
    ("redis", "redis", False),
)


def run(args: argparse.Namespace) -> dict[str, Any]:
    python = args.server_python or sys.executable
    loop, http = server_flavour(python, not args.slow_server)
    load = Load(args.connections, args.seconds, python)
    run_tag = run_id()
    database = f"apikeys_bench_{run_tag}"
    wanted = [name.strip() for name in args.stores.split(",") if name.strip()]
    skipped: list[str] = []
    configs_wanted = []
    for store, limiter, cache in CONFIGS:
        if store not in wanted:
            continue
        if (store == "postgres" and not postgres_reachable()) or (
            (store == "redis" or limiter == "redis") and not redis_reachable()
        ):
            skipped.append(f"{store}+{limiter}: server not reachable")
            continue
        configs_wanted.append((store, limiter, cache))
    version = subprocess.run(
        [python, "-c", "import uvicorn; print(uvicorn.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    output: dict[str, Any] = {
        "server": {
            "uvicorn": version,
            "workers": 1,
            "loop": loop,
            "http": http,
            "access_log": False,
            "interpreter": python,
        },
        "load": {**load.describe(), "rounds": args.rounds},
        "endpoint": f"GET {PATH} -> 200 'ok' (Starlette PlainTextResponse)",
        "configs": [],
        "skipped": skipped,
    }
    print(
        f"http: uvicorn {version}, 1 worker, --loop {loop} --http {http} --no-access-log; "
        f"load: {output['load']['tool']}, {args.connections} connections, "
        f"{args.rounds} rounds of {args.seconds:g} s",
        flush=True,
    )
    from apikeys.keys import generate_key

    parsed = generate_key()
    token = token_for(parsed.id, parsed.secret)
    with tempfile.TemporaryDirectory(prefix="apikeys-bench-http-") as tmp:
        directory = Path(tmp)
        made_database = False
        try:
            if any(store == "postgres" for store, _, _ in configs_wanted):
                asyncio.run(create_database(database))
                made_database = True
            with serving(
                python, {"BENCH_MODE": "bare"}, loop, http, directory / "bare.log"
            ) as bare:
                for store, limiter, cache in configs_wanted:
                    config = Config(store, limiter, run_tag, directory, database, cache)
                    try:
                        result = measure_config(
                            config,
                            bare,
                            load,
                            python,
                            loop,
                            http,
                            token,
                            args.rounds,
                            directory,
                            store in args.profile.split(","),
                        )
                        result["cache"] = cache
                        if store not in ("memory", HAND_WRITTEN):
                            result["store_operations"] = count_store_operations(
                                config, python, loop, http, token, load, directory
                            )
                        if cache and (config.network_store or config.limiter == "redis"):
                            result["round_trips"] = count_round_trips(
                                config, python, loop, http, token, args.requests, directory, load
                            )
                    except Exception as exc:
                        print(f"  {config.name}: FAILED: {exc}", flush=True)
                        result = {
                            "store": store,
                            "limiter": limiter,
                            "cache": cache,
                            "error": str(exc),
                        }
                    output["configs"].append(result)
        finally:
            if made_database:
                asyncio.run(drop_database(database))
            if redis_reachable():
                asyncio.run(delete_redis_keys(f"*{BENCH_TAG}-{run_tag}*"))
    report(output)
    return output


def report(output: dict[str, Any]) -> None:
    rows = []
    for r in output["configs"]:
        if "error" in r:
            rows.append([config_label(r), "FAILED", *[""] * 10])
            continue
        ops = (r.get("store_operations") or {}).get("store_operations_per_request")
        rows.append(
            [
                config_label(r),
                fmt(r["bare"]["rps"]["median"]),
                fmt(r["auth"]["rps"]["median"]),
                fmt(r["auth"]["rps"]["best"]),
                fmt(r["ratio_paired"]["median"], 2),
                fmt(r["ratio_of_best"], 2),
                fmt(r["auth"]["p50_ms"]["median"], 2),
                fmt(r["auth"]["p99_ms"]["median"], 2),
                fmt(r["bare"]["p50_ms"]["median"], 2),
                fmt(r["bare"]["p99_ms"]["median"], 2),
                fmt(r.get("cpu_us_added_per_request"), 1),
                fmt(ops, 4),
            ]
        )
    print("\nHTTP: requests/s and latency (median of the rounds; best where said)")
    print(
        table(
            [
                "store + limiter",
                "bare rps",
                "auth rps",
                "auth best",
                "ratio",
                "ratio best",
                "auth p50 ms",
                "auth p99 ms",
                "bare p50 ms",
                "bare p99 ms",
                "CPU us added",
                "store ops/req",
            ],
            rows,
        )
    )
    print(
        "  ratio: authenticated / bare, median of the paired rounds; ratio best: best / best\n"
        "  CPU us added: the server's user + system CPU time per request, authenticated minus "
        "bare (medians)\n"
        "  store ops/req: counted by the store in steady state: Redis commands (a server of its "
        "own), SQLite statements, PostgreSQL transactions (whole server life: an upper bound)"
    )
    for r in output["configs"]:
        ops = r.get("store_operations") or {}
        if "statements_per_second" in ops:
            print(f"  {config_label(r)}: {sqlite_rates(ops)}")
    rt_rows = []
    for r in output["configs"]:
        trips = r.get("round_trips")
        if not trips:
            continue
        commands = trips.get("redis_commands_per_request")
        rt_rows.append(
            [
                config_label(r),
                fmt(trips["store_round_trips_per_request"], 2),
                fmt(trips["limiter_round_trips_per_request"], 2),
                fmt(trips["round_trips_per_request"], 2),
                fmt(trips.get("round_trips_of_usage_flush_at_shutdown")),
                fmt(trips.get("postgres_transactions_per_request"), 2),
                fmt((trips.get("under_load") or {}).get("round_trips_per_request"), 2),
                fmt((trips.get("under_load") or {}).get("store_connections_opened")),
                ", ".join(f"{k} {v:g}" for k, v in commands.items()) if commands else "",
            ]
        )
    if rt_rows:
        print(
            "\nRound trips per authenticated request (TCP-level count): sequential requests, "
            "and 'under load' (wrk, 3 s) with the store connections opened meanwhile"
        )
        print(
            table(
                [
                    "store + limiter",
                    "store",
                    "limiter",
                    "total",
                    "usage flush",
                    "pg xacts/req",
                    "under load",
                    "store conns opened",
                    "Redis commands/req (server-wide)",
                ],
                rt_rows,
            )
        )
    for line in output["skipped"]:
        print(f"  skipped: {line}")


def hand_label(result: dict[str, Any]) -> str:
    """The label of a yardstick row: the hand-written check, with its headers or not."""
    if result["limiter"] == "headers":
        return "hand-written check + RateLimit headers (yardstick)"
    return "hand-written check (yardstick)"


def config_label(result: dict[str, Any]) -> str:
    if result["store"] == HAND_WRITTEN:
        return hand_label(result)
    label = f"{result['store']} + {result['limiter']} limiter"
    if result["store"] != "memory":
        label += ", cache" if result.get("cache", True) else ", no cache"
    return label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="per load run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--requests", type=int, default=1000, help="per round-trip count")
    parser.add_argument("--stores", default=f"{HAND_WRITTEN},memory,sqlite,postgres,redis")
    parser.add_argument("--server-python", help="interpreter of the servers (default: this one)")
    parser.add_argument("--slow-server", action="store_true", help="asyncio and h11 regardless")
    parser.add_argument(
        "--profile",
        default="",
        metavar="STORES",
        help="py-spy the authenticated server of these stores (e.g. memory,redis) under load; "
        "collapsed stacks go to benchmarks/results/profile-*.txt",
    )
    parser.add_argument("--json", type=Path, help="write the results to this file")
    parser.add_argument("--load-only", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--token", help=argparse.SUPPRESS)
    args = parser.parse_args()
    interrupt_on_sigterm()
    if args.load_only:
        asyncio.run(httpx_load(args.load_only, args.token, args.seconds, args.connections))
        return
    if args.quick:
        args.rounds, args.seconds, args.requests = 2, 2.0, 300
    output = run(args)
    if args.json:
        write_json(args.json, output)


if __name__ == "__main__":
    main()
