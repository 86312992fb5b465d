"""Several real uvicorn processes sharing one store: usage, rate limits and revocation.

Each store kind gets a pair of separate `uvicorn` processes on two ports (so a test can talk
to each process in turn) serving `tests/mp_app.py`; the graceful-shutdown tests run
`uvicorn --workers 2` instead. Keys are created, read and revoked through a `KeyManager` in
the test process, on the same store the servers use.

| kind     | key store                     | limiter                  |
|----------|-------------------------------|--------------------------|
| sqlite   | a SQLite file                 | memory (one per process) |
| postgres | a table of its own            | Redis (shared)           |
| redis    | a key prefix of its own       | Redis (shared)           |
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from apikeys import Hasher, KeyManager, KeyRecord, store_from_url
from apikeys.types import utcnow
from tests.conftest import TEST_PEPPER, delete_redis_keys, redis_prefix
from tests.test_manager import wrong_secret
from tests.test_middleware import assert_problem, bearer

ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 30.0
STOP_TIMEOUT = 20.0
# The contract: usage is visible within 2 seconds. Half a second more for a loaded machine.
VISIBLE_WITHIN = 2.5

KINDS = [
    pytest.param("sqlite", marks=pytest.mark.sqlite, id="sqlite"),
    pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.redis], id="postgres"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
]
SHARED_LIMITER_KINDS = [param for param in KINDS if param.id != "sqlite"]

AUTHENTICATED = {200, 403, 429}


# --- configuration -------------------------------------------------------------------------


@dataclass
class Config:
    """Where one kind's servers keep keys and count requests."""

    kind: str
    store_url: str
    store_options: dict[str, Any]
    limiter_url: str
    redis_prefix: str = ""
    """What the servers' Redis keys (store and limiter) start with or contain, if any."""

    def env(self, flush_interval: float) -> dict[str, str]:
        """The environment `tests/mp_app.py` reads its configuration from."""
        return {
            **os.environ,
            "APIKEYS_STORE_URL": self.store_url,
            "APIKEYS_TEST_STORE_OPTIONS": json.dumps(self.store_options),
            "APIKEYS_LIMITER_URL": self.limiter_url,
            "APIKEYS_TEST_LIMITER_PREFIX": self.redis_prefix or "apikeys",
            "APIKEYS_RATE_LIMIT": "100000/minute",
            "APIKEYS_PEPPER": TEST_PEPPER,
            "APIKEYS_TEST_FLUSH_INTERVAL": str(flush_interval),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }

    @asynccontextmanager
    async def manager(self) -> AsyncIterator[KeyManager]:
        """A `KeyManager` of the test process on the servers' store."""
        store = store_from_url(self.store_url, **self.store_options)
        async with KeyManager(store, hasher=Hasher(pepper=TEST_PEPPER)) as manager:
            yield manager

    async def cleanup(self) -> None:
        """Delete what the servers left on a shared Redis (PostgreSQL's database is dropped
        at the end of the session anyway)."""
        if self.redis_prefix:
            await delete_redis_keys(self.limiter_url, f"*{self.redis_prefix}*")


def make_config(kind: str, request: pytest.FixtureRequest, directory: Path) -> Config:
    """The configuration of `kind`, skipping (or failing) when its servers are missing."""
    suffix = uuid.uuid4().hex[:10]
    if kind == "sqlite":
        return Config(kind, f"sqlite:///{directory / f'keys-{suffix}.db'}", {}, "memory://")
    redis_url = str(request.getfixturevalue("redis_url"))
    if kind == "postgres":
        postgres_url = str(request.getfixturevalue("postgres_url"))
        # Small pools: four server processes of this file may share the server at once.
        options = {"table_name": f"mp_keys_{suffix}", "pool_size": 5, "max_overflow": 5}
        return Config(kind, postgres_url, options, redis_url, redis_prefix("mp"))
    if kind == "redis":
        prefix = redis_prefix("mp")
        return Config(kind, redis_url, {"key_prefix": f"{prefix}:"}, redis_url, prefix)
    raise AssertionError(kind)


# --- server processes ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    """One `uvicorn` command: a single process, or a supervisor and its workers."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def terminate(self) -> None:
        """SIGTERM: uvicorn shuts down gracefully (lifespan shutdown flushes usage)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def kill(self) -> None:
        """Kill whatever is left of the process group this test started (workers too).

        A command that exited cleanly has already joined its workers: its group is gone.
        """
        if self.process.poll() is not None and self.process.returncode == 0:
            return
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.process.wait(5)


def _spawn(env: dict[str, str], log: Path, workers: int) -> Server:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "tests.mp_app:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-access-log",
        "--log-level",
        "warning",
        "--timeout-graceful-shutdown",
        "10",
    ]
    if workers > 1:
        command += ["--workers", str(workers)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so workers can be killed too
        )
    return Server(process, f"http://127.0.0.1:{port}", log)


def _ready(server: Server, deadline: float) -> bool:
    """Poll `/health` until it answers; False if the process died (e.g. port taken)."""
    with httpx.Client(trust_env=False, timeout=1.0) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                return False
            with suppress(httpx.HTTPError):
                if client.get(server.url + "/health").status_code == 200:
                    return True
            time.sleep(0.05)
    return False


def start_servers(
    config: Config, directory: Path, *, count: int, workers: int = 1, flush_interval: float = 1.0
) -> list[Server]:
    """Start `count` uvicorn commands at once and wait until each answers."""
    env = config.env(flush_interval)
    started: list[Server] = []

    def spawn(log: Path) -> Server:
        server = _spawn(env, log, workers)
        started.append(server)
        return server

    try:
        ready: list[Server] = []
        pending = [spawn(directory / f"uvicorn-{uuid.uuid4().hex[:8]}.log") for _ in range(count)]
        for _attempt in range(3):
            deadline = time.monotonic() + STARTUP_TIMEOUT
            retry: list[Server] = []
            for server in pending:
                if _ready(server, deadline):
                    ready.append(server)
                    continue
                log = server.log_tail()
                server.kill()
                if "address already in use" not in log.lower():
                    pytest.fail(f"uvicorn did not start ({config.kind}):\n{log}")
                retry.append(spawn(server.log))  # the free port was taken meanwhile: again
            pending = retry
            if not pending:
                return ready
        pytest.fail("uvicorn could not find a free port three times")
    except BaseException:
        for server in started:
            server.kill()
        raise


def stop_servers(servers: Sequence[Server]) -> list[int]:
    """Stop gracefully (SIGTERM, all at once) and return the exit codes; kill leftovers."""
    try:
        for server in servers:
            server.terminate()
        return [server.wait(STOP_TIMEOUT) for server in servers]
    finally:
        for server in servers:
            server.kill()


@dataclass
class Cluster:
    """Two separate server processes on one store."""

    config: Config
    servers: list[Server]
    pids: list[int] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]


class Clusters:
    """Starts one `Cluster` per kind on first use and stops them all at the end."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._clusters: dict[str, Cluster] = {}

    def get(self, kind: str, request: pytest.FixtureRequest) -> Cluster:
        cluster = self._clusters.get(kind)
        if cluster is None:
            config = make_config(kind, request, self.directory)  # skips before anything starts
            asyncio.run(_setup_store(config))
            servers = start_servers(config, self.directory, count=2)
            cluster = self._clusters[kind] = Cluster(config, servers)
            cluster.pids = [_pid(server.url) for server in servers]
        return cluster

    def close(self) -> None:
        try:
            stop_servers([server for c in self._clusters.values() for server in c.servers])
        finally:
            for cluster in self._clusters.values():
                asyncio.run(cluster.config.cleanup())


def _pid(url: str) -> int:
    with httpx.Client(trust_env=False) as client:
        return int(client.get(url + "/health").json()["pid"])


async def _setup_store(config: Config) -> None:
    # Create the table (or load the scripts) once, before two processes race to do it.
    async with config.manager():
        pass


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clusters]:
    pool = Clusters(tmp_path_factory.mktemp("multiprocess"))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def cluster(clusters: Clusters, kind: str, request: pytest.FixtureRequest) -> Cluster:
    return clusters.get(kind, request)


@pytest.fixture
def config(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Config]:
    # A plain fixture: `postgres_url` may only be set up outside the test's event loop.
    made = make_config(kind, request, tmp_path)
    try:
        yield made
    finally:
        asyncio.run(made.cleanup())


# --- load ---------------------------------------------------------------------------------


async def fire(requests: Sequence[tuple[str, str]], concurrency: int = 50) -> list[httpx.Response]:
    """Send `(url, token)` GETs, `concurrency` at a time, answers in order of `requests`.

    Each lane has a client (and a connection) of its own: one httpx pool juggling 50
    connections costs more time than the servers do.
    """
    answers: list[httpx.Response | None] = [None] * len(requests)
    work = iter(enumerate(requests))

    async def lane() -> None:
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
            for index, (url, token) in work:
                answers[index] = await client.get(url, headers=bearer(token))

    await asyncio.gather(*(lane() for _ in range(min(concurrency, len(requests)))))
    return [answer for answer in answers if answer is not None]


def mixed_load(
    urls: Sequence[str], token: str, bad_token: str, total: int
) -> list[tuple[str, str]]:
    """`total` requests spread evenly over `urls` and over a path the key may use and one it
    may not (403), plus a tenth as many with a wrong secret (401, not counted)."""
    paths = ["/api/v1/contacts", "/api/v1/admin"]
    load = [(urls[(i // 2) % len(urls)] + paths[i % 2], token) for i in range(total)]
    for i in range(total // 10):
        load.insert(i * 10, (urls[i % len(urls)] + paths[0], bad_token))
    return load


async def wait_for_count(
    manager: KeyManager, key_id: str, expected: int, within: float
) -> KeyRecord:
    """The record once its `request_count` is `expected`; fails if it passes it or is late."""
    deadline = time.monotonic() + within
    while True:
        record = await manager.get(key_id)
        assert record.request_count <= expected, "counted more requests than were answered"
        if record.request_count == expected:
            return record
        if time.monotonic() > deadline:
            pytest.fail(f"request_count {record.request_count}, expected {expected}")
        await asyncio.sleep(0.05)


def check_counted(answers: Sequence[httpx.Response]) -> int:
    """How many answers the key's usage must count; every answer is one the mix allows."""
    statuses = {answer.status_code for answer in answers}
    assert statuses <= AUTHENTICATED | {401}, sorted(statuses)
    for answer in answers:
        if answer.status_code == 401:
            assert_problem(answer, 401, "invalid_api_key")
    return sum(answer.status_code in AUTHENTICATED for answer in answers)


# --- tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_if_load_is_spread_over_two_processes_then_request_count_is_exact(
    cluster: Cluster,
) -> None:
    async with cluster.config.manager() as manager:
        created = await manager.create(
            name="load", workspace="mp", scopes=["contacts:read"], rate_limit="120/minute"
        )
        started = utcnow()
        answers = await fire(
            mixed_load(cluster.urls, created.key, wrong_secret(created.key), total=400)
        )
        answered = utcnow()

        counted = check_counted(answers)
        assert counted == 400
        statuses = {answer.status_code for answer in answers}
        assert {200, 403, 429} <= statuses, sorted(statuses)
        served_by = {answer.json()["pid"] for answer in answers if answer.status_code == 200}
        assert served_by == set(cluster.pids)

        record = await wait_for_count(manager, created.record.id, counted, VISIBLE_WITHIN)
        assert record.last_used_at is not None
        assert started <= record.last_used_at <= answered


@pytest.mark.parametrize("kind", KINDS)
async def test_if_uvicorn_workers_stop_gracefully_then_every_request_is_counted(
    config: Config, tmp_path: Path
) -> None:
    try:
        async with config.manager() as manager:
            created = await manager.create(
                name="shutdown", workspace="mp", scopes=["contacts:read"], rate_limit="60/minute"
            )
            # Flushes an hour apart: only the shutdown flush can write these counts.
            servers = start_servers(config, tmp_path, count=1, workers=2, flush_interval=3600)
            try:
                url = servers[0].url
                answers = await fire(
                    mixed_load([url], created.key, wrong_secret(created.key), total=200)
                )
                counted = check_counted(answers)
                assert counted == 200
                assert (await manager.get(created.record.id)).request_count == 0
            finally:
                exit_codes = stop_servers(servers)
            assert exit_codes == [0], servers[0].log_tail()

            record = await manager.get(created.record.id)
            assert record.request_count == counted
            assert record.last_used_at is not None
    finally:
        await config.cleanup()


@pytest.mark.parametrize("kind", SHARED_LIMITER_KINDS)
async def test_if_limiter_is_shared_then_exactly_the_limit_is_admitted_across_processes(
    cluster: Cluster,
) -> None:
    limit = 25
    async with cluster.config.manager() as manager:
        created = await manager.create(
            name="limited", workspace="mp", scopes=["contacts:read"], rate_limit=f"{limit}/minute"
        )
        load = [(cluster.urls[i % 2] + "/api/v1/contacts", created.key) for i in range(200)]
        answers = await fire(load)

        admitted = [answer for answer in answers if answer.status_code == 200]
        refused = [answer for answer in answers if answer.status_code != 200]
        assert len(admitted) == limit
        assert len(refused) == 200 - limit
        for answer in refused:
            assert_problem(answer, 429, "rate_limited")
            retry_after = answer.headers["retry-after"]
            assert retry_after.isdigit()
            # The window is 60 s; Redis reports its TTL in whole seconds, so one more may show.
            assert 1 <= int(retry_after) <= 61
            assert answer.headers["ratelimit"].startswith('"default";r=0;')
        await wait_for_count(manager, created.record.id, 200, VISIBLE_WITHIN)


async def _each(urls: Sequence[str], token: str) -> list[httpx.Response]:
    """One request to every process, at the same time."""
    return await fire([(url + "/api/v1/contacts", token) for url in urls])


@pytest.mark.parametrize("kind", KINDS)
async def test_if_key_revoked_then_401_in_every_process(cluster: Cluster) -> None:
    async with cluster.config.manager() as manager:
        created = await manager.create(name="revoke", workspace="mp", scopes=["contacts:read"])
        key_id, token = created.record.id, created.key

        for _ in range(2):
            # Each process has just seen the key usable: nothing may keep serving that.
            served = await _each(cluster.urls, token)
            assert [answer.status_code for answer in served] == [200, 200]
            assert [answer.json()["pid"] for answer in served] == cluster.pids

            await manager.disable(key_id)
            for answer in await _each(cluster.urls, token):
                assert_problem(answer, 401, "key_disabled")

            await manager.enable(key_id)
            assert [answer.status_code for answer in await _each(cluster.urls, token)] == [200, 200]

        await manager.revoke(key_id)
        for _ in range(2):
            for answer in await _each(cluster.urls, token):
                assert_problem(answer, 401, "key_revoked")


@pytest.mark.parametrize("kind", KINDS)
async def test_if_a_key_has_credits_then_exactly_that_many_are_admitted_across_processes(
    cluster: Cluster,
) -> None:
    credits = 30
    async with cluster.config.manager() as manager:
        created = await manager.create(
            name="credits",
            workspace="mp",
            scopes=["contacts:read"],
            rate_limit="100000/minute",
            credits=credits,
        )
        load = [(cluster.urls[i % 2] + "/api/v1/contacts", created.key) for i in range(120)]
        answers = await fire(load)

        admitted = [answer for answer in answers if answer.status_code == 200]
        assert len(admitted) == credits
        for answer in answers:
            if answer.status_code != 200:
                body = assert_problem(answer, 429, "credits_exhausted")
                assert "retry-after" not in answer.headers  # no refill: no time to wait for
                assert "retry_after" not in body
        left = sorted(
            int(answer.headers["ratelimit"].split('"credits";r=')[1].split(";")[0].split(",")[0])
            for answer in admitted
        )
        assert left == list(range(credits))  # each credit spent once, none below zero
        assert (await manager.get(created.record.id)).credits == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_if_a_key_is_rolled_then_both_keys_spend_one_balance_across_processes(
    cluster: Cluster,
) -> None:
    async with cluster.config.manager() as manager:
        old = await manager.create(
            name="credits",
            workspace="mp",
            scopes=["contacts:read"],
            rate_limit="100000/minute",
            credits=40,
        )
        spent = await fire([(cluster.urls[i % 2] + "/api/v1/contacts", old.key) for i in range(10)])
        assert [answer.status_code for answer in spent] == [200] * 10
        new = await manager.roll(old.record.id, grace=timedelta(hours=24))
        assert new.record.credits == 30
        # Both keys, in both processes, at once.
        load = [
            (cluster.urls[i % 2] + "/api/v1/contacts", (old.key, new.key)[(i // 2) % 2])
            for i in range(120)
        ]
        answers = await fire(load)

        admitted = [answer for answer in answers if answer.status_code == 200]
        assert len(admitted) == 30  # what was left when rolled, once for the pair
        for answer in answers:
            if answer.status_code != 200:
                assert_problem(answer, 429, "credits_exhausted")
        left = sorted(
            int(answer.headers["ratelimit"].split('"credits";r=')[1].split(";")[0].split(",")[0])
            for answer in admitted
        )
        assert left == list(range(30))
        assert (await manager.get(old.record.id)).credits == 0
        assert (await manager.get(new.record.id)).credits == 0
