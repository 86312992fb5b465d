from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import sqlite3
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

import apikeys
from apikeys import Hasher, KeyManager, MemoryStore, store_from_url
from apikeys.stores import KeyStore
from tests import redis_servers, services
from tests.bytecode import compiled
from tests.pg_tables import PostgresTables
from tests.pgbouncer import PgBouncer, free_port
from tests.webhooks.receiver import Receiver

# A property test is about inputs, not speed: no deadline, so a loaded machine (CI, two
# cores shared by several runs) cannot fail a test that is right. `ci` is the default;
# HYPOTHESIS_PROFILE=dev runs fewer examples while writing a test.
settings.register_profile("ci", deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=20)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# One table of stores for every test that takes the `store` fixture (or `store_url`): each
# behaviour runs on memory, SQLite, PostgreSQL and Redis alike.
STORES = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", marks=pytest.mark.sqlite, id="sqlite"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
]

# The Redis store on a local Redis Cluster and through Sentinel (tests/redis_servers.py), for
# the suites that check every deployment: the store conformance suite and the CLI.
SCALE_OUT_STORES = [
    pytest.param("redis-cluster", marks=pytest.mark.redis, id="redis-cluster"),
    pytest.param("redis-sentinel", marks=pytest.mark.redis, id="redis-sentinel"),
]


async def _create_database(admin_url: str, name: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


async def _drop_database(admin_url: str, name: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL database of the suite's own, created for the session and dropped after."""
    services.require(services.POSTGRES_URL, "PostgreSQL", "APIKEYS_TEST_POSTGRES_URL")
    name = f"apikeys_test_{uuid.uuid4().hex[:12]}"
    asyncio.run(_create_database(services.POSTGRES_URL, name))
    base = services.POSTGRES_URL.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        asyncio.run(_drop_database(services.POSTGRES_URL, name))


@pytest.fixture
def redis_url() -> str:
    services.require(services.REDIS_URL, "Redis", "APIKEYS_TEST_REDIS_URL")
    return services.REDIS_URL


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[redis_servers.LocalCluster]:
    """A local Redis Cluster (3 masters, 3 replicas), started on first use, stopped at the end."""
    redis_servers.require_redis_binaries()
    cluster = redis_servers.LocalCluster()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[redis_servers.LocalSentinel]:
    """A local Sentinel set (master, replica, 3 sentinels), started on first use."""
    redis_servers.require_redis_binaries()
    sentinel = redis_servers.LocalSentinel()
    sentinel.start()
    try:
        yield sentinel
    finally:
        sentinel.close()


ROOT = Path(__file__).resolve().parent.parent


_BYTECODE = pytest.StashKey[contextlib.ExitStack]()


def pytest_configure(config: pytest.Config) -> None:
    """The processes tests start find apikeys, the tests' helpers and the examples compiled
    (`tests/bytecode.py`), instead of each compiling them again: compiled once by the process
    that runs the session (with `-n`, the one that starts the workers), before any test."""
    if hasattr(config, "workerinput"):  # a worker of `pytest -n`: its controller compiled
        return
    package = Path(apikeys.__file__).resolve().parent
    stack = contextlib.ExitStack()
    stack.enter_context(compiled([package, ROOT / "tests", ROOT / "examples", ROOT / "benchmarks"]))
    config.stash[_BYTECODE] = stack


def pytest_unconfigure(config: pytest.Config) -> None:
    stack = config.stash.get(_BYTECODE, None)
    if stack is not None:
        stack.close()


# Every Redis key the suite writes carries this session's tag (`redis_prefix` makes the
# prefixes), so the session can check at its end that it left none behind, on a server other
# runs share.
REDIS_SESSION_TAG = f"apikeys-test-{uuid.uuid4().hex[:8]}"


def redis_prefix(label: str = "t") -> str:
    """A Redis key prefix of one test's own, inside the session's tag (no trailing colon).

    Give it to stores (with a `:`), limiters and subprocesses alike, and delete
    `*<prefix>*` when done: that also takes the limiter's `LIMITS:<prefix>/…` counters.
    """
    return f"{REDIS_SESSION_TAG}-{label}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def redis_key_prefix() -> Iterator[str]:
    """A key prefix of the test's own, so Redis tests never see each other's keys.

    Whatever the test wrote under it (the store's keys, its 24-hour usage-batch markers, a
    limiter's counters) is deleted when the test ends, whether or not a store was closed.
    """
    prefix = redis_prefix()
    try:
        yield f"{prefix}:"
    finally:
        if services.reachable(services.REDIS_URL):
            delete_redis_keys_now(services.REDIS_URL, f"*{prefix}*")


@pytest.fixture(params=STORES)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def _make_sqlite_tables(path: Path) -> None:
    store = store_from_url(f"sqlite:///{path}")
    try:
        await store.setup()
    finally:
        await store.aclose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database with the store's tables and not a row in them, made once.

    Each test's SQLite store starts from a copy: making the tables, their indexes and the
    log's triggers costs about 40 ms, copying the file one. The store's `setup()` on the copy
    writes the log's row (with an identity of the copy's own), as on a new database.
    """
    path = tmp_path_factory.mktemp("sqlite-template") / "keys.db"
    # In a thread of its own: the test's event loop must stay the thread's current one.
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        thread.submit(asyncio.run, _make_sqlite_tables(path)).result()
    connection = sqlite3.connect(path)
    try:
        tables = [
            name
            for (name,) in connection.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            )
        ]
        with connection:
            for table in tables:
                connection.execute(f'DELETE FROM "{table}"')  # noqa: S608 - names from sqlite_master
            if connection.execute(
                "SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'"
            ).fetchone():
                connection.execute("DELETE FROM sqlite_sequence")
        for table in tables:  # a trigger that wrote a row while another table was emptied
            count = connection.execute(f'SELECT count(*) FROM "{table}"')  # noqa: S608 - as above
            assert count.fetchone() == (0,), table
    finally:
        connection.close()
    return path


@pytest.fixture
def store_url(store_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL for a fresh, empty store of each kind in the table."""
    if store_kind == "memory":
        return "memory://"
    if store_kind == "sqlite":
        # The store's tables are there already, as on PostgreSQL (`store_options`).
        template: Path = request.getfixturevalue("sqlite_template")
        shutil.copyfile(template, tmp_path / "keys.db")
        return f"sqlite:///{tmp_path / 'keys.db'}"
    if store_kind == "postgres":
        # Each test gets a set of tables of its own in the session's database (store_options).
        base: str = request.getfixturevalue("postgres_url")
        return base
    if store_kind == "redis":
        return str(request.getfixturevalue("redis_url"))
    if store_kind == "redis-cluster":
        return str(request.getfixturevalue("redis_cluster").url)
    if store_kind == "redis-sentinel":
        return str(request.getfixturevalue("redis_sentinel").url)
    raise AssertionError(store_kind)


@pytest.fixture(scope="session")
def postgres_tables(postgres_url: str) -> PostgresTables:
    """The store's table sets in the session's database, made once and emptied after each
    test that had one (`tests/pg_tables.py`)."""
    return PostgresTables(postgres_url)


@pytest.fixture
def store_options(store_kind: str, request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """Extra keyword arguments that isolate one test's data on a shared server.

    On PostgreSQL a set of tables of the test's own, empty when the test starts.
    """
    if store_kind.startswith("redis"):
        yield {"key_prefix": str(request.getfixturevalue("redis_key_prefix"))}
    elif store_kind == "postgres":
        tables: PostgresTables = request.getfixturevalue("postgres_tables")
        name = tables.take()
        yield {"table_name": name}
        tables.give_back(name)
    else:
        yield {}


async def redis_keys(url: str, pattern: str) -> list[str]:
    """The names of the Redis keys matching `pattern` (a SCAN glob)."""
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    try:
        return [name async for name in client.scan_iter(match=pattern, count=1000)]
    finally:
        await client.aclose()


async def delete_redis_keys(url: str, pattern: str) -> int:
    """Delete every Redis key matching `pattern`; how many there were."""
    import redis.asyncio

    names = await redis_keys(url, pattern)
    if names:
        client = redis.asyncio.Redis.from_url(url)
        try:
            await client.delete(*names)
        finally:
            await client.aclose()
    return len(names)


def delete_redis_keys_now(url: str, pattern: str) -> list[str]:
    """`delete_redis_keys` without an event loop (for fixture teardowns); the names deleted."""
    import redis

    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        names = list(client.scan_iter(match=pattern, count=1000))
        if names:
            client.delete(*names)
        return names
    finally:
        client.close()


async def delete_redis_prefix(url: str, prefix: str) -> None:
    """Delete every Redis key under `prefix` (what one test left behind): on a single node,
    a cluster (every master) or a Sentinel's master."""
    from apikeys.stores.redis.client import parse_redis_url, redis_client

    target = parse_redis_url(url)
    if target.kind == "single":
        await delete_redis_keys(url, f"{prefix}*")
        return
    client, sentinel = redis_client(target)
    try:
        if target.kind == "cluster":
            # A new cluster client knows no node until it has read the slot map.
            await client.initialize()  # type: ignore[union-attr]
            names = []
            for node in client.get_primaries():  # type: ignore[union-attr]
                async for name in client.scan_iter(
                    match=f"{prefix}*", count=500, target_nodes=node
                ):
                    names.append(name)
            for name in names:
                await client.delete(name)
        else:
            names = [name async for name in client.scan_iter(match=f"{prefix}*", count=500)]
            if names:
                await client.delete(*names)
    finally:
        await client.aclose()
        for one in sentinel.sentinels if sentinel is not None else []:
            await one.aclose()


@pytest.fixture(scope="session", autouse=True)
def redis_left_as_found() -> Iterator[None]:
    """Fail the session if any Redis key it made is still there at its end (and delete it)."""
    yield
    if not services.reachable(services.REDIS_URL):
        return
    left = delete_redis_keys_now(services.REDIS_URL, f"*{REDIS_SESSION_TAG}*")
    if left:
        shown = ", ".join(sorted(left)[:10])
        pytest.fail(
            f"the suite left {len(left)} Redis keys in {services.REDIS_URL} (deleted now): {shown}",
            pytrace=False,
        )


@pytest.fixture
async def store(store_url: str, store_options: dict[str, str]) -> AsyncIterator[KeyStore]:
    key_store = store_from_url(store_url, **store_options)
    await key_store.setup()
    try:
        yield key_store
    finally:
        await key_store.aclose()  # `redis_key_prefix` then deletes what it wrote on Redis
        if store_url.startswith(("redis+cluster", "redis+sentinel")):
            # The local cluster or Sentinel set: `redis_key_prefix` cleans the shared server.
            await delete_redis_prefix(store_url, store_options["key_prefix"])


TEST_PEPPER = "1awuN_rKweVSoRxFr2EKGuIxfESTX_x8eXJses89j20"


@pytest.fixture
def hasher() -> Hasher:
    return Hasher(pepper=TEST_PEPPER)


@pytest.fixture
async def manager(store: KeyStore, hasher: Hasher) -> AsyncIterator[KeyManager]:
    """A `KeyManager` on each store of the table."""
    key_manager = KeyManager(store, hasher=hasher, usage_flush_interval=0.05)
    yield key_manager
    await key_manager.aclose()


@pytest.fixture
async def memory_manager(hasher: Hasher) -> AsyncIterator[KeyManager]:
    """A `KeyManager` on a fresh memory store, for tests about the HTTP layer."""
    key_manager = KeyManager(MemoryStore(), hasher=hasher, usage_flush_interval=0.05)
    yield key_manager
    await key_manager.aclose()


@pytest.fixture(scope="session")
def pgbouncer() -> Iterator[PgBouncer]:
    """A PgBouncer of the session's own in transaction mode, in front of the test server.

    Started the first time a test asks for it; skipped (or failed, with
    `APIKEYS_REQUIRE_SERVICES=1`) when pgbouncer is not installed.
    """
    services.require(services.POSTGRES_URL, "PostgreSQL", "APIKEYS_TEST_POSTGRES_URL")
    with PgBouncer(pool_mode="transaction") as bouncer:
        yield bouncer


@pytest.fixture(scope="session")
def pgbouncer_session() -> Iterator[PgBouncer]:
    """As `pgbouncer`, in session mode: each client keeps one server connection."""
    services.require(services.POSTGRES_URL, "PostgreSQL", "APIKEYS_TEST_POSTGRES_URL")
    with PgBouncer(pool_mode="session") as bouncer:
        yield bouncer


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    """A webhook receiver listening on a free local port, stopped when the test ends."""
    started = Receiver(free_port())
    await started.start()
    try:
        yield started
    finally:
        await started.stop()
