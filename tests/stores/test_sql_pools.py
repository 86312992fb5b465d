"""How many connections a SQL store holds, and how its URL sizes them.

A process holds at most `2 * pool_size + max_overflow` connections for the store (the write
pool and the read pool), plus one for the key cache's channel: 5 with the defaults, so 4
workers on each of 4 hosts fit in PostgreSQL's default `max_connections = 100`
(docs/deploying.md). The connections are counted in `pg_stat_activity`, by an
`application_name` of the test's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import exc as sa_exc

from apikeys import Hasher, KeyManager, store_from_url
from apikeys.errors import ConfigurationError
from apikeys.stores.sql.store import SQLStore
from tests import services
from tests.conftest import TEST_PEPPER
from tests.stores import test_store_conformance as conformance


def unique_name() -> str:
    return f"apikeys-pools-{uuid.uuid4().hex[:10]}"


def unique_table() -> str:
    return f"apikeys_pools_{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def admin() -> AsyncIterator[asyncpg.Connection]:
    services.require(services.POSTGRES_URL, "PostgreSQL", "APIKEYS_TEST_POSTGRES_URL")
    connection = await asyncpg.connect(services.POSTGRES_URL)
    try:
        yield connection
    finally:
        await connection.close()


async def connections_of(admin: asyncpg.Connection, application_name: str) -> int:
    count = await admin.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", application_name
    )
    return int(count)


@contextlib.asynccontextmanager
async def most_connections(
    admin: asyncpg.Connection, application_name: str
) -> AsyncIterator[list[int]]:
    """Counts the connections named `application_name` until the block ends; the list
    holds the most seen (one count at the end, after the block's work, at least)."""
    most = [0]
    done = asyncio.Event()

    async def watch() -> None:
        while True:
            most[0] = max(most[0], await connections_of(admin, application_name))
            if done.is_set():
                return
            await asyncio.sleep(0.005)

    watcher = asyncio.ensure_future(watch())
    try:
        yield most
    finally:
        done.set()
        await watcher


async def busy(store: SQLStore, rounds: int = 3) -> None:
    """Many reads and writes at once: far more than the store's pools hold."""
    for _ in range(rounds):
        keys = [conformance.make_key() for _ in range(20)]
        await asyncio.gather(*(store.insert(key) for key in keys))
        reads: list[Awaitable[object]] = [store.get(key.record.id) for key in keys * 3]
        writes: list[Awaitable[object]] = [
            store.set_state(key.record.id, "disabled", allowed_from={"active"}, at=conformance.T0)
            for key in keys
        ]
        await asyncio.gather(*reads, *writes, store.list())


# --- the URL's query string -----------------------------------------------------------------


@pytest.mark.postgres
async def test_if_the_url_gives_pool_sizes_then_the_pools_hold_no_more(
    postgres_url: str, admin: asyncpg.Connection
) -> None:
    name = unique_name()
    url = f"{postgres_url}?pool_size=3&max_overflow=1&pool_timeout=0.5"
    store = store_from_url(url, table_name=unique_table(), application_name=name)
    assert isinstance(store, SQLStore)
    try:
        await store.setup()
        async with contextlib.AsyncExitStack() as stack:
            # The write pool: pool_size + max_overflow connections, and not one more.
            for _ in range(4):
                await stack.enter_async_context(store.engine.connect())
            assert await connections_of(admin, name) == 4
            with pytest.raises(sa_exc.TimeoutError):  # pool_timeout=0.5, from the URL
                await stack.enter_async_context(store.engine.connect())
            # The read pool: up to pool_size more, however many reads wait.
            keys = [conformance.make_key() for _ in range(3)]
            async with most_connections(admin, name) as most:
                await asyncio.gather(*(store.get(key.record.id) for key in keys * 20))
            assert 4 < most[0] <= 4 + 3
    finally:
        await store.aclose()
    assert await connections_of(admin, name) == 0
    # Under load, the same sizes with the default pool_timeout (0.5 s is for the refusal
    # above: on a busy machine a write could wait that long for its turn, and be refused).
    store = store_from_url(
        f"{postgres_url}?pool_size=3&max_overflow=1",
        table_name=unique_table(),
        application_name=name,
    )
    try:
        await store.setup()
        async with most_connections(admin, name) as most:
            await busy(store)
        assert most[0] <= 2 * 3 + 1
    finally:
        await store.aclose()
    assert await connections_of(admin, name) == 0


@pytest.mark.postgres
async def test_if_the_url_and_a_keyword_both_give_a_size_then_the_url_wins(
    postgres_url: str, admin: asyncpg.Connection
) -> None:
    name = unique_name()
    url = f"{postgres_url}?max_overflow=0&pool_size=1"
    store = store_from_url(url, table_name=unique_table(), application_name=name, pool_size=10)
    try:
        await store.setup()
        async with most_connections(admin, name) as most:
            await busy(store)
        assert 1 <= most[0] <= 2 * 1 + 0
    finally:
        await store.aclose()


@pytest.mark.postgres
async def test_with_the_defaults_a_process_holds_at_most_five_connections_with_the_cache(
    postgres_url: str, admin: asyncpg.Connection
) -> None:
    # docs/deploying.md's budget: 2 * pool_size + max_overflow + 1 = 2 * 2 + 0 + 1.
    name = unique_name()
    store = store_from_url(postgres_url, table_name=unique_table(), application_name=name)
    assert isinstance(store, SQLStore)
    manager = KeyManager(store, hasher=Hasher(pepper=TEST_PEPPER))
    try:
        created = await manager.create(name="footprint", full_access=True)
        async with most_connections(admin, name) as most:

            async def verify() -> None:
                for _ in range(5):
                    await manager.verify(created.key)

            await asyncio.gather(busy(store), *(verify() for _ in range(20)))
        assert most[0] <= 5
    finally:
        await manager.aclose()
    assert await connections_of(admin, name) == 0


@pytest.mark.sqlite
async def test_a_sqlite_url_takes_pool_options_and_keeps_its_own_query(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'keys.db'}?pool_size=1&max_overflow=0&pool_timeout=1"
    store = store_from_url(url)
    try:
        assert "pool_size" not in repr(store)
        await store.setup()
        key = await conformance.inserted(store)
        assert await conformance.record_of(store, key.id) == key
    finally:
        await store.aclose()


def test_the_store_options_leave_the_url_and_the_rest_stays() -> None:
    store = store_from_url(
        "postgresql://app@db.internal/app?sslmode=require&pool_size=5&max_overflow=0"
        "&prepared_statements=false"
    )
    try:
        assert repr(store) == (
            "SQLStore(url='postgresql+asyncpg://app@db.internal/app?ssl=require', "
            "table='apikeys_keys')"
        )
    finally:
        asyncio.run(store.aclose())


@pytest.mark.parametrize(
    "query",
    [
        "pool_size=many",
        "pool_size=-1",
        "max_overflow=1.5",
        "pool_timeout=soon",
        "pool_timeout=nan",
        "prepared_statements=maybe",
        "pool_size=1&pool_size=2",
        "statement_cache_size=off",
    ],
)
def test_if_a_store_option_in_the_url_is_not_valid_then_configuration_error(query: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        store_from_url(f"postgresql://app@db.internal/app?{query}")
    assert query.split("=")[0] in str(caught.value)


@pytest.mark.parametrize(
    "query",
    ["prepared_statements=false", "statement_cache_size=0", "prepared_statement_cache_size=0"],
)
@pytest.mark.postgres
async def test_each_way_of_turning_prepared_statements_off_reaches_every_connection(
    postgres_url: str, query: str
) -> None:
    # With prepared statements off, asyncpg prepares nothing under a name: the server's
    # pg_prepared_statements of each of the store's connections stays empty.
    name = unique_name()
    store = store_from_url(
        f"{postgres_url}?{query}", table_name=unique_table(), application_name=name
    )
    assert isinstance(store, SQLStore)
    named: list[int] = []
    try:
        await store.setup()
        await busy(store, rounds=1)
        async with store.engine.connect() as connection:
            raw = await connection.get_raw_connection()
            driver: asyncpg.Connection = raw.driver_connection  # type: ignore[assignment]
            named.append(await driver.fetchval("SELECT count(*) FROM pg_prepared_statements"))
        channel = store.channel()
        assert channel is not None
        kwargs: dict[str, object] = channel._kwargs  # type: ignore[attr-defined]
        assert kwargs["statement_cache_size"] == 0
        reader = await asyncpg.connect(*channel._args, **kwargs)  # type: ignore[attr-defined]
        try:
            await reader.fetchrow("SELECT $1::int", 1)
            named.append(await reader.fetchval("SELECT count(*) FROM pg_prepared_statements"))
        finally:
            await reader.close()
    finally:
        await store.aclose()
    assert named == [0, 0]
