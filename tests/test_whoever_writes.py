"""Whoever writes, the caches hear of it: every kind of writer against caching processes.

The contract (section 3) promises that a change holds for every process that shares the
store, whoever made it. Each test here starts uvicorn processes that cache keys (the
default), warms their caches, then changes a key by a writer that is not a caching apikeys
process, and checks that no process keeps admitting the key:

- a `KeyManager(store, cache=False)` (a job, a back office): it waits for the caching
  processes as any manager does, so the very next request is refused;
- a plain SQL `UPDATE` (psql, sqlite3) or `HSET` from redis-cli, and `FLUSHALL`;
- the previous release's command line, during a rolling upgrade.

A writer that is not apikeys cannot wait for anyone: its change is seen within the
notification's delay, and at the latest once a lease has passed since it committed (every
proof older than the change has run out by then, and every newer one has read it). These
tests count what was admitted in between (printed, never asserted: it depends on the
machine's speed) and then require 401 from every process.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from io import BytesIO
from pathlib import Path

import httpx
import pytest

from apikeys import Hasher, KeyManager, store_from_url
from apikeys.cache import DEFAULT_LEASE
from apikeys.stores.contract import ChannelError
from apikeys.stores.sql.sqlite_channel import SQLiteChannel
from apikeys.stores.sql.store import SQLStore
from tests import test_cache_servers
from tests.test_cache_servers import (
    KINDS,
    LEASE_WAIT,
    ROOT,
    Config,
    Server,
    each,
    health,
    make_config,
    start,
    wait_until_fresh,
)
from tests.test_middleware import assert_problem
from tests.test_multiprocess import TEST_PEPPER, free_port, start_servers

pytestmark = pytest.mark.slow

servers_of = test_cache_servers.servers_of  # the processes a test starts, stopped after it

# The last commit of the release before the store kept its own change log.
PREVIOUS_RELEASE = "e04ef50"


@pytest.fixture
def config(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Config]:
    # A plain fixture: `postgres_url` may only be set up outside the test's event loop.
    made = make_config(kind, request, tmp_path)
    try:
        yield made
    finally:
        asyncio.run(made.cleanup())


async def warm(
    config: Config, tmp_path: Path, started: list[list[Server]], *tokens: str
) -> list[str]:
    """Two caching processes that have served every token from their caches."""
    servers = await start(config, tmp_path, started, count=2)
    urls = [server.url for server in servers]
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
        for token in tokens:
            for _ in range(2):
                assert [a.status_code for a in await each(client, urls, token)] == [200, 200]
    await wait_until_fresh(urls)
    # The requests above may have come before the first proof (read from the store, not
    # kept): ask again until every process has served every token from its cache.
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
        for _ in range(100):
            for token in tokens:
                assert [a.status_code for a in await each(client, urls, token)] == [200, 200]
            states = [await health(client, url) for url in urls]
            if all(state["cache"]["hits"] >= len(tokens) for state in states):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"the caches did not serve the keys: {states}")
    return urls


async def admitted_until_refused(urls: list[str], token: str) -> int:
    """Requests admitted from now until one lease has passed (then every one must be 401)."""
    admitted = 0
    deadline = time.monotonic() + LEASE_WAIT
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
        while time.monotonic() < deadline:
            admitted += sum(a.status_code == 200 for a in await each(client, urls, token))
        # The lease has passed since the change committed: nothing may be admitted now.
        for _ in range(3):
            for answer in await each(client, urls, token):
                assert answer.status_code == 401, answer.text
    return admitted


# --- a manager that does not cache keys -------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_if_a_cache_false_job_revokes_or_disables_then_every_process_refuses_at_once(
    config: Config, tmp_path: Path, servers_of: list[list[Server]]
) -> None:
    async with config.manager() as manager:
        doomed = await manager.create(name="doomed", workspace="mp", scopes=["contacts:read"])
        paid = await manager.create(
            name="paid", workspace="mp", scopes=["contacts:read"], credits=1000
        )
    urls = await warm(config, tmp_path, servers_of, doomed.key, paid.key)
    store = store_from_url(config.store_url, **config.store_options)
    async with KeyManager(store, hasher=Hasher(pepper=TEST_PEPPER), cache=False) as job:
        await job.revoke(doomed.record.id)
        async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
            for answer in await each(client, urls, doomed.key):
                assert_problem(answer, 401, "key_revoked")
            await job.disable(paid.record.id)
            for answer in await each(client, urls, paid.key):
                assert_problem(answer, 401, "key_disabled")


# --- writers that are not apikeys --------------------------------------------------------------


async def revoke_by_hand(config: Config, key_id: str) -> None:
    """`UPDATE … SET state = 'revoked'` in psql or sqlite3, or `HSET` from redis-cli."""
    now = datetime.now(UTC)
    if config.kind == "sqlite":
        path = config.store_url.removeprefix("sqlite:///")
        with sqlite3.connect(path) as connection:
            connection.execute(
                "UPDATE apikeys_keys SET state = 'revoked', revoked_at = ? WHERE id = ?",
                (now.strftime("%Y-%m-%d %H:%M:%S.%f"), key_id),
            )
    elif config.kind == "postgres":
        import asyncpg

        table = config.store_options["table_name"]
        connection = await asyncpg.connect(config.store_url)
        try:
            await connection.execute(
                f"UPDATE \"{table}\" SET state = 'revoked', revoked_at = $1 WHERE id = $2",  # noqa: S608
                now,
                key_id,
            )
        finally:
            await connection.close()
    else:
        redis_cli(
            config.store_url,
            "HSET",
            f"{config.store_options['key_prefix']}key:{{{key_id}}}",
            "state",
            "revoked",
        )


def redis_cli(url: str, *args: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    database = parts.path.strip("/") or "0"
    command = ["redis-cli", "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379)]
    done = subprocess.run(
        [*command, "-n", database, *args], capture_output=True, text=True, timeout=30, check=True
    )
    return done.stdout


@pytest.mark.parametrize("kind", KINDS)
async def test_if_revoked_by_hand_then_no_process_admits_the_key_once_a_lease_has_passed(
    config: Config, tmp_path: Path, servers_of: list[list[Server]]
) -> None:
    async with config.manager() as manager:
        created = await manager.create(name="by-hand", workspace="mp", scopes=["contacts:read"])
        kept = await manager.create(name="kept", workspace="mp", scopes=["contacts:read"])
    urls = await warm(config, tmp_path, servers_of, created.key, kept.key)
    await revoke_by_hand(config, created.record.id)
    admitted = await admitted_until_refused(urls, created.key)
    print(f"{config.kind}: {admitted} requests admitted in the lease after a revoke by hand")
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
        assert [a.status_code for a in await each(client, urls, kept.key)] == [200, 200]


POSTGRES_KIND = [param for param in KINDS if param.id == "postgres"]


@pytest.mark.parametrize("kind", POSTGRES_KIND)
@pytest.mark.parametrize(
    "change",
    [
        "UPDATE \"{table}\" SET state = 'revoked' WHERE id = $1",
        'DELETE FROM "{table}" WHERE id = $1',
    ],
    ids=["update", "delete"],
)
async def test_if_revoked_past_triggers_disabled_in_its_transaction_then_refused_after_a_lease(
    config: Config, tmp_path: Path, servers_of: list[list[Server]], change: str
) -> None:
    """`BEGIN; ALTER TABLE … DISABLE TRIGGER …; UPDATE (or DELETE) …; ALTER TABLE … ENABLE
    ALWAYS TRIGGER …; COMMIT`: the change is in no log, and the catalogs look as before."""
    import asyncpg

    from apikeys.stores.sql.log import POSTGRES_TRIGGERS

    async with config.manager() as manager:
        created = await manager.create(name="bypass", workspace="mp", scopes=["contacts:read"])
        kept = await manager.create(name="kept", workspace="mp", scopes=["contacts:read"])
    urls = await warm(config, tmp_path, servers_of, created.key, kept.key)
    table = config.store_options["table_name"]
    connection = await asyncpg.connect(config.store_url)
    try:
        async with connection.transaction():
            await connection.execute(f'ALTER TABLE "{table}" DISABLE TRIGGER USER')
            await connection.execute(change.format(table=table), created.record.id)
            for name in POSTGRES_TRIGGERS:
                await connection.execute(f'ALTER TABLE "{table}" ENABLE ALWAYS TRIGGER "{name}"')
    finally:
        await connection.close()
    admitted = await admitted_until_refused(urls, created.key)
    print(f"{admitted} requests admitted in the lease after a revoke past the triggers")
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
        assert [a.status_code for a in await each(client, urls, kept.key)] == [200, 200]


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[str]:
    """A Redis server of this test's own (FLUSHALL must not touch anybody else's data)."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    process = subprocess.Popen(
        [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 20
        while True:
            try:
                redis_cli(url, "PING")
                break
            except subprocess.CalledProcessError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.redis
async def test_if_redis_is_flushed_then_no_process_admits_a_cached_key(
    private_redis: str, tmp_path: Path, servers_of: list[list[Server]]
) -> None:
    config = Config("redis", private_redis, {"key_prefix": "apikeys-flush:"}, private_redis)
    async with config.manager() as manager:
        created = await manager.create(name="flushed", workspace="mp", scopes=["contacts:read"])
    urls = await warm(config, tmp_path, servers_of, created.key)
    redis_cli(private_redis, "FLUSHALL")
    admitted = await admitted_until_refused(urls, created.key)
    print(f"redis: {admitted} requests admitted in the lease after FLUSHALL")


@pytest.mark.redis
async def test_if_a_redis_record_is_given_a_ttl_by_hand_then_no_process_admits_it_once_expired(
    private_redis: str, tmp_path: Path, servers_of: list[list[Server]]
) -> None:
    # Redis tells a tracking connection of an expiry only when it deletes the key: when a
    # client touches it, or when its active expiry comes to it, which among many keys with a
    # TTL can take hours. A cached record of a key given a TTL (`PEXPIRE` from redis-cli)
    # would outlive the key. Usage is flushed once an hour here, so nothing touches it.
    config = Config("redis", private_redis, {"key_prefix": "apikeys-ttl:"}, private_redis)
    async with config.manager() as manager:
        created = await manager.create(name="ttl", workspace="mp", scopes=["contacts:read"])
    redis_cli(
        private_redis,
        "EVAL",
        "for i = 1, 200000 do redis.call('SET', 'other:' .. i, 'x', 'EX', 3600) end",
        "0",
    )
    servers = await asyncio.to_thread(start_servers, config, tmp_path, count=2, flush_interval=3600)
    servers_of.append(servers)
    urls = [server.url for server in servers]
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
        for _ in range(2):
            assert [a.status_code for a in await each(client, urls, created.key)] == [200, 200]
        await wait_until_fresh(urls)
        redis_cli(private_redis, "PEXPIRE", f"apikeys-ttl:key:{{{created.record.id}}}", "3000")
        expires = time.monotonic() + 3.0
        # Once the processes have heard of the PEXPIRE (a probe round), they read the key
        # again while it lives ...
        await asyncio.sleep(DEFAULT_LEASE / 2)
        for _ in range(2):
            assert [a.status_code for a in await each(client, urls, created.key)] == [200, 200]
    # ... and then it expires.
    await asyncio.sleep(max(0.0, expires - time.monotonic()))
    admitted = await admitted_until_refused(urls, created.key)
    print(f"redis: {admitted} requests admitted in the lease after the record's TTL ran out")


# --- an older release, during a rolling upgrade -----------------------------------------------


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's source tree (`src/`), taken from this repository's history."""
    try:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", PREVIOUS_RELEASE, "src"],
            cwd=ROOT,
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"the previous release is not in this checkout's history: {exc}")
    target = tmp_path_factory.mktemp("previous-release")
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    return target / "src"


@pytest.mark.parametrize("kind", KINDS)
async def test_if_the_previous_release_revokes_then_no_process_admits_the_key_after_a_lease(
    config: Config,
    tmp_path: Path,
    servers_of: list[list[Server]],
    previous_release: Path,
) -> None:
    async with config.manager() as manager:
        created = await manager.create(name="old-cli", workspace="mp", scopes=["contacts:read"])
    urls = await warm(config, tmp_path, servers_of, created.key)
    env = config.env(1.0)
    env["PYTHONPATH"] = f"{previous_release}:{env['PYTHONPATH']}"
    command = [
        sys.executable,
        "-c",
        "import apikeys, sys; assert apikeys.__file__.startswith(sys.argv[1]); "
        "sys.argv = sys.argv[1:]; import runpy; runpy.run_module('tests.cli_with_options', "
        "run_name='__main__')",
        str(previous_release),
        "--store",
        config.store_url,
        "revoke",
        created.record.id,
        "--yes",
    ]
    done = await asyncio.to_thread(
        subprocess.run, command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    admitted = await admitted_until_refused(urls, created.key)
    print(f"{config.kind}: {admitted} requests admitted in the lease after the old CLI's revoke")


# --- the SQLite change log's own checks --------------------------------------------------------


async def sqlite_channel(path: Path) -> SQLiteChannel:
    """The channel of a new SQLite store at `path` (its tables made, the store closed)."""
    store = SQLStore(f"sqlite+aiosqlite:///{path}")
    await store.setup()
    await store.aclose()
    channel = store.channel()
    assert isinstance(channel, SQLiteChannel)
    return channel


async def test_if_a_reader_connected_to_an_empty_log_falls_behind_the_pruning_it_starts_afresh(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.db"
    channel = await sqlite_channel(path)
    notices: list[str] = []
    await channel.connect("reader", notices.append)
    try:
        with sqlite3.connect(path) as connection:
            connection.execute(
                "INSERT INTO apikeys_keys_changes (notice) "
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 10050) "
                "SELECT 'store:0:k' || i FROM n"
            )
            connection.execute(
                "DELETE FROM apikeys_keys_changes WHERE seq <= "
                "(SELECT max(seq) FROM apikeys_keys_changes) - 10000"
            )
        with pytest.raises(ChannelError, match="fell behind"):
            await channel.probe()
        assert notices == []
    finally:
        await channel.disconnect()


async def test_if_the_sqlite_file_is_replaced_by_a_backup_then_readers_start_afresh(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.db"
    channel = await sqlite_channel(path)
    shutil.copy(path, tmp_path / "backup.db")
    await channel.connect("reader", lambda notice: None)
    try:
        await channel.probe()
        shutil.copy(tmp_path / "backup.db", tmp_path / "restored.db")
        (tmp_path / "restored.db").replace(path)
        with pytest.raises(ChannelError, match="replaced"):
            await channel.probe()
    finally:
        await channel.disconnect()


async def test_if_a_frozen_sqlite_reader_misses_a_revoke_pruned_from_the_log_then_it_starts_afresh(
    tmp_path: Path, servers_of: list[list[Server]], request: pytest.FixtureRequest
) -> None:
    # A process that connected to an empty log is frozen across a revoke and 10,050 later
    # changes; by the time it runs again, the revoke's entry has been pruned from the log.
    config = make_config("sqlite", request, tmp_path)
    servers = await start(config, tmp_path, servers_of, count=2)
    urls = [server.url for server in servers]
    async with config.manager() as manager:
        created = await manager.create(name="frozen", workspace="mp", scopes=["contacts:read"])
    async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
        for _ in range(2):
            assert [a.status_code for a in await each(client, urls, created.key)] == [200, 200]
        await wait_until_fresh(urls)
        frozen = (await client.get(urls[1] + "/health")).json()["pid"]
        os.kill(frozen, signal.SIGSTOP)
        try:
            async with config.manager() as manager:
                await manager.revoke(created.record.id)
            path = config.store_url.removeprefix("sqlite:///")
            with sqlite3.connect(path) as connection:
                connection.execute(
                    "INSERT INTO apikeys_keys_changes (notice) "
                    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n "
                    "WHERE i < 10050) SELECT 'store:0:other' || i FROM n"
                )
                connection.execute(
                    "DELETE FROM apikeys_keys_changes WHERE seq <= "
                    "(SELECT max(seq) FROM apikeys_keys_changes) - 10000"
                )
        finally:
            os.kill(frozen, signal.SIGCONT)
        # Once it has proven its cache fresh again, it must not have kept the key.
        await wait_until_fresh(urls)
        for _ in range(5):
            for answer in await each(client, urls, created.key):
                assert_problem(answer, 401, "key_revoked")
