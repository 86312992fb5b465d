"""SQL-specific behaviour of `SQLStore`, on real SQLite files and a real PostgreSQL server.

The behaviour every store shares is in `test_store_conformance.py`; here: URLs and drivers,
the table and its helpers, several engines and processes on one database, and what happens
when the database is locked, unreachable, slow or drops its connections.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from apikeys.errors import ConfigurationError, StoreUnavailable
from apikeys.keys import generate_id
from apikeys.stores import store_from_url
from apikeys.stores.sql.store import SQLStore, async_url, create_tables, keys_table, metadata
from apikeys.types import KeyRecord, StoredKey, UsageDelta
from tests.tcpproxy import TcpProxy

T0 = datetime(2026, 1, 31, 12, 0, 0, 123456, tzinfo=UTC)

StoreFactory = Callable[..., SQLStore]


def make_key(key_id: str | None = None, **fields: Any) -> StoredKey:
    key_id = key_id or generate_id()
    values: dict[str, Any] = {
        "id": key_id,
        "name": f"key {key_id}",
        "workspace": "acme",
        "prefix": f"ak_{key_id}_…",
        "access": "restricted",
        "scopes": ("contacts:read",),
        "state": "active",
        "rate_limit": None,
        "created_at": T0,
    }
    values.update(fields)
    return StoredKey(record=KeyRecord(**values), secret_hash="hash-1")


async def record_of(store: SQLStore, key_id: str) -> KeyRecord:
    stored = await store.get(key_id)
    assert stored is not None
    return stored.record


def unique_table() -> str:
    return f"apikeys_keys_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'keys.db'}"


@pytest.fixture
async def make_store() -> AsyncIterator[StoreFactory]:
    """Build `SQLStore`s that are closed after the test."""
    stores: list[SQLStore] = []

    def make(url: Any, **options: Any) -> SQLStore:
        store = SQLStore(url, **options)
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.aclose()


@pytest.fixture(
    params=[
        pytest.param("sqlite", marks=pytest.mark.sqlite),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
def database(request: pytest.FixtureRequest, sqlite_url: str) -> tuple[str, dict[str, Any]]:
    """A URL and options naming an empty keys table, on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        return sqlite_url, {}
    url: str = request.getfixturevalue("postgres_url")
    return url, {"table_name": unique_table()}


# --- URLs and drivers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("sqlite:///keys.db", "sqlite+aiosqlite:///keys.db"),
        ("sqlite:////var/lib/app/keys.db", "sqlite+aiosqlite:////var/lib/app/keys.db"),
        ("sqlite+aiosqlite:///keys.db", "sqlite+aiosqlite:///keys.db"),
        ("postgresql://app:pw@db:5432/app", "postgresql+asyncpg://app:pw@db:5432/app"),
        ("postgres://app@db/app", "postgresql+asyncpg://app@db/app"),
        ("postgresql+asyncpg://app@db/app", "postgresql+asyncpg://app@db/app"),
    ],
)
def test_plain_urls_run_on_the_async_drivers(url: str, expected: str) -> None:
    assert async_url(url).render_as_string(hide_password=False) == expected


def test_libpq_sslmode_becomes_asyncpg_ssl() -> None:
    url = async_url("postgresql://app@db/app?sslmode=require")

    assert dict(url.query) == {"ssl": "require"}


@pytest.mark.parametrize("url", ["mysql://app@db/app", "oracle://db", "not a url"])
def test_a_url_of_another_database_is_a_configuration_error(url: str) -> None:
    with pytest.raises(ConfigurationError):
        async_url(url)


@pytest.mark.parametrize(
    ("url", "driver"),
    [
        ("sqlite:///keys.db", "aiosqlite"),
        ("sqlite+aiosqlite:///keys.db", "aiosqlite"),
        ("postgresql://app@db/app", "asyncpg"),
        ("postgres://app@db/app", "asyncpg"),
        ("postgresql+asyncpg://app@db/app", "asyncpg"),
    ],
)
async def test_store_from_url_builds_a_sql_store_for_every_sql_scheme(
    url: str, driver: str
) -> None:
    store = store_from_url(url, table_name="my_keys", pool_size=3)
    try:
        assert isinstance(store, SQLStore)
        assert store.engine.url.get_driver_name() == driver
        assert store.table.name == "my_keys"
    finally:
        await store.aclose()


def test_repr_hides_the_password() -> None:
    store = SQLStore("postgresql://app:s3cr3t-pw@db.internal:5432/app")

    assert "s3cr3t-pw" not in repr(store)
    assert "db.internal" in repr(store)


# --- the table ----------------------------------------------------------------------------


def test_metadata_holds_the_default_table_for_alembic() -> None:
    table = metadata.tables["apikeys_keys"]

    assert keys_table() is table
    assert [column.name for column in table.primary_key] == ["id"]
    assert set(table.c.keys()) == {
        *KeyRecord.__dataclass_fields__,
        "secret_hash",
    }
    assert isinstance(table.c.request_count.type, sa.BigInteger)
    assert {
        str(index.name): [column.name for column in index.columns] for index in table.indexes
    } == {
        "ix_apikeys_keys_workspace_created": ["workspace", "created_at", "id"],
        "ix_apikeys_keys_expires_at": ["expires_at"],
        "ix_apikeys_keys_refilled": ["credit_refill"],
    }


@pytest.mark.sqlite
async def test_create_tables_on_a_url_creates_the_table_once(sqlite_url: str) -> None:
    await create_tables(sqlite_url)
    await create_tables(sqlite_url)

    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    assert {"apikeys_keys", "ix_apikeys_keys_workspace_created"} <= names


@pytest.mark.postgres
async def test_create_tables_on_an_engine_creates_the_named_table_once(
    postgres_url: str,
) -> None:
    engine = create_async_engine(async_url(postgres_url))
    name = unique_table()
    try:
        await create_tables(engine, table_name=name)
        await create_tables(engine, table_name=name)
        async with engine.connect() as conn:
            tables = await conn.run_sync(lambda sync: sa.inspect(sync).get_table_names())
            indexes = await conn.run_sync(lambda sync: sa.inspect(sync).get_indexes(name))
    finally:
        await engine.dispose()
    assert name in tables
    assert sorted(index["column_names"] for index in indexes) == [
        ["credit_refill"],
        ["expires_at"],
        ["workspace", "created_at", "id"],
    ]


@pytest.mark.postgres
async def test_if_many_stores_set_up_one_table_at_once_then_all_succeed(
    postgres_url: str, make_store: StoreFactory
) -> None:
    name = unique_table()
    stores = [make_store(postgres_url, table_name=name) for _ in range(5)]

    await asyncio.gather(*(store.setup() for store in stores))

    await stores[0].insert(make_key("k-one"))
    assert (await record_of(stores[4], "k-one")).id == "k-one"


@pytest.mark.postgres
async def test_list_orders_ids_by_code_point_whatever_the_database_collation(
    postgres_url: str, make_store: StoreFactory
) -> None:
    name = f"apikeys_test_icu_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(postgres_url)
    try:
        # An ICU English collation sorts "a" before "B"; code point order puts "B" first.
        try:
            await admin.execute(
                f'CREATE DATABASE "{name}" TEMPLATE template0 '
                "LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"
            )
        except asyncpg.PostgresError as exc:  # before PostgreSQL 15, or built without ICU
            pytest.skip(f"this PostgreSQL cannot create an ICU-collated database: {exc}")
        store = make_store(f"{postgres_url.rsplit('/', 1)[0]}/{name}")
        await store.setup()
        ids = ["aaaaaaaaaaaa", "BBBBBBBBBBBB", "bbbbbbbbbbbb", "AAAAAAAAAAAA"]
        for key_id in ids:
            await store.insert(make_key(key_id))

        listed = [record.id for record in await store.list("acme")]
        await store.aclose()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    assert listed == sorted(ids)


@pytest.mark.sqlite
async def test_table_name_option_keeps_keys_in_that_table(
    sqlite_url: str, make_store: StoreFactory
) -> None:
    default, custom = make_store(sqlite_url), make_store(sqlite_url, table_name="tenant_keys")
    await default.setup()
    await custom.setup()

    await custom.insert(make_key("k-custom"))

    assert await default.get("k-custom") is None
    assert (await record_of(custom, "k-custom")).id == "k-custom"
    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        assert conn.execute("SELECT id FROM tenant_keys").fetchall() == [("k-custom",)]


async def test_setup_is_idempotent_and_keeps_the_keys(
    database: tuple[str, dict[str, Any]], make_store: StoreFactory
) -> None:
    url, options = database
    store = make_store(url, **options)
    await store.setup()
    await store.insert(make_key("k-kept"))

    await store.setup()

    assert (await record_of(store, "k-kept")).id == "k-kept"


async def drop_change_log_triggers(conn: Any, table_name: str) -> None:
    """Drop the triggers that keep the change log of `table_name` (an older release's table)."""
    if conn.dialect.name == "sqlite":
        query = "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = :t"
        names = [row[0] for row in await conn.execute(sa.text(query), {"t": table_name})]
        for name in names:
            await conn.execute(sa.text(f'DROP TRIGGER "{name}"'))
    else:
        query = (
            "SELECT tgname FROM pg_trigger WHERE tgrelid = CAST(:t AS regclass) "
            "AND NOT tgisinternal"
        )
        names = [row[0] for row in await conn.execute(sa.text(query), {"t": f'"{table_name}"'})]
        for name in names:
            await conn.execute(sa.text(f'DROP TRIGGER "{name}" ON "{table_name}"'))


async def test_if_a_table_lacks_columns_of_this_format_then_setup_refuses_and_changes_nothing(
    database: tuple[str, dict[str, Any]], make_store: StoreFactory
) -> None:
    # 0.1.0 is the first format: a table pre-release code made is named, never altered.
    url, options = database
    store = make_store(url, **options)
    await store.setup()
    await store.insert(make_key("k-before"))
    table = store.table
    async with store.engine.begin() as conn:
        await drop_change_log_triggers(conn, table.name)
        for column in ("replaces", "replaced_by"):
            await conn.execute(sa.text(f'ALTER TABLE "{table.name}" DROP COLUMN {column}'))

    async def columns() -> set[str]:
        async with store.engine.connect() as conn:
            found = await conn.run_sync(lambda sync: sa.inspect(sync).get_columns(table.name))
        return {str(column["name"]) for column in found}

    before = await columns()
    with pytest.raises(ConfigurationError) as refused:
        await make_store(url, **options).setup()
    message = str(refused.value)
    assert table.name in message
    assert "replaced_by" in message
    assert "replaces" in message
    assert await columns() == before


async def test_if_setup_was_skipped_then_the_first_call_creates_the_table(
    database: tuple[str, dict[str, Any]], make_store: StoreFactory
) -> None:
    url, options = database
    reader, writer = make_store(url, **options), make_store(url, **options)  # no setup()

    assert await reader.get("k-first") is None
    await writer.insert(make_key("k-first"))
    assert (await record_of(reader, "k-first")).id == "k-first"


async def test_if_the_table_is_missing_and_auto_create_is_off_then_calls_raise_configuration_error(
    database: tuple[str, dict[str, Any]], make_store: StoreFactory
) -> None:
    url, options = database
    store = make_store(url, auto_create=False, **options)

    for call in every_call(store)[1:]:
        with pytest.raises(ConfigurationError, match=r"setup\(\)"):
            await call()


@pytest.mark.sqlite
async def test_sqlite_file_is_in_wal_mode_so_readers_never_wait_for_writers(
    sqlite_url: str, make_store: StoreFactory
) -> None:
    await make_store(sqlite_url).setup()

    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


@pytest.mark.sqlite
async def test_sqlite_keeps_timestamps_as_utc_text_in_time_order(
    sqlite_url: str, make_store: StoreFactory
) -> None:
    store = make_store(sqlite_url)
    await store.setup()
    plus_two = T0.astimezone(timezone(timedelta(hours=2)))
    await store.insert(make_key("k-time", created_at=plus_two))

    with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
        [(stored,)] = conn.execute("SELECT created_at FROM apikeys_keys").fetchall()
    assert stored == "2026-01-31 12:00:00.123456"
    assert (await record_of(store, "k-time")).created_at == T0


# --- several engines and processes on one database ----------------------------------------


async def test_if_state_changed_elsewhere_then_get_sees_it(
    database: tuple[str, dict[str, Any]], make_store: StoreFactory
) -> None:
    url, options = database
    here, elsewhere = make_store(url, **options), make_store(url, **options)
    await here.setup()
    await here.insert(make_key("k-shared"))
    assert (await record_of(here, "k-shared")).state == "active"  # warm its connections

    await elsewhere.set_state("k-shared", "revoked", allowed_from=("active",), at=T0)
    assert (await record_of(here, "k-shared")).state == "revoked"

    await elsewhere.shorten_expiry("k-shared", T0)  # revoked: left as it is
    await elsewhere.replace_hash("k-shared", "hash-1", "hash-2")
    stored = await here.get("k-shared")
    assert stored is not None
    assert (stored.secret_hash, stored.record.revoked_at) == ("hash-2", T0)


async def test_if_two_engines_add_usage_at_once_then_counts_are_exact(
    database: tuple[str, dict[str, Any]], make_store: StoreFactory
) -> None:
    url, options = database
    one, two = make_store(url, **options), make_store(url, **options)
    await one.setup()
    await one.insert(make_key("k-a"))
    await one.insert(make_key("k-b"))

    await asyncio.gather(
        *(
            store.add_usage(
                {
                    "k-a": UsageDelta(i, T0 + timedelta(seconds=i)),
                    "k-b": UsageDelta(1, T0 + timedelta(seconds=100 - i)),
                },
                batch_id=uuid.uuid4().hex,
            )
            for i in range(1, 31)
            for store in (one, two)
        )
    )

    a, b = await record_of(two, "k-a"), await record_of(one, "k-b")
    assert (a.request_count, a.last_used_at) == (2 * sum(range(1, 31)), T0 + timedelta(seconds=30))
    assert (b.request_count, b.last_used_at) == (60, T0 + timedelta(seconds=99))


CHILD = """
import asyncio, sys, uuid
from datetime import UTC, datetime
from apikeys.stores.sql.store import SQLStore
from apikeys.types import UsageDelta

async def main(url, action, key_id):
    store = SQLStore(url)
    try:
        if action == "revoke":
            await store.set_state(
                key_id, "revoked", allowed_from=("active", "disabled"), at=datetime.now(UTC)
            )
        else:
            for _ in range(100):
                await store.add_usage(
                    {key_id: UsageDelta(1, datetime.now(UTC))}, batch_id=uuid.uuid4().hex
                )
    finally:
        await store.aclose()

asyncio.run(main(*sys.argv[1:]))
"""


async def run_child(url: str, action: str, key_id: str) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, url, action, key_id, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()


@pytest.mark.sqlite
async def test_if_revoked_by_another_process_then_get_sees_it_at_once(
    sqlite_url: str, make_store: StoreFactory
) -> None:
    store = make_store(sqlite_url)
    await store.setup()
    await store.insert(make_key("k-proc"))
    assert (await record_of(store, "k-proc")).state == "active"

    await run_child(sqlite_url, "revoke", "k-proc")

    assert (await record_of(store, "k-proc")).state == "revoked"


@pytest.mark.sqlite
async def test_if_processes_add_usage_at_once_then_counts_are_exact(
    sqlite_url: str, make_store: StoreFactory
) -> None:
    store = make_store(sqlite_url)
    await store.setup()
    await store.insert(make_key("k-busy"))

    async def here() -> None:
        for _ in range(100):
            await store.add_usage({"k-busy": UsageDelta(1, T0)}, batch_id=uuid.uuid4().hex)

    await asyncio.gather(
        run_child(sqlite_url, "usage", "k-busy"), run_child(sqlite_url, "usage", "k-busy"), here()
    )

    assert (await record_of(store, "k-busy")).request_count == 300


@pytest.mark.sqlite
async def test_in_memory_sqlite_store_serves_concurrent_calls(make_store: StoreFactory) -> None:
    store = make_store("sqlite://")
    await store.setup()
    await store.insert(make_key("k-mem"))

    await asyncio.gather(
        *(
            store.add_usage({"k-mem": UsageDelta(1, T0)}, batch_id=uuid.uuid4().hex)
            for _ in range(20)
        ),
        *(store.get("k-mem") for _ in range(20)),
    )

    assert (await record_of(store, "k-mem")).request_count == 20


async def test_reads_through_sqlalchemy_give_the_same_records_as_direct_reads(
    database: tuple[str, dict[str, Any]], make_store: StoreFactory
) -> None:
    url, options = database
    direct, plain = make_store(url, **options), make_store(url, direct_reads=False, **options)
    await direct.setup()
    stored = make_key(
        scopes=("a:read", "b:*"),
        expires_at=T0 + timedelta(days=1),
        last_used_at=T0 + timedelta(microseconds=1),
        request_count=3,
        revoked_at=T0,
        state="revoked",
        rate_limit="5/second",
    )
    await direct.insert(stored)

    assert await direct.get(stored.record.id) == stored
    assert await plain.get(stored.record.id) == stored
    assert await plain.get("k-none") is None


@pytest.mark.sqlite
async def test_sqlite_reads_decode_a_row_once_and_see_every_change_to_it(
    sqlite_url: str, make_store: StoreFactory
) -> None:
    store = make_store(sqlite_url)
    await store.setup()
    stored = make_key(metadata={"team": "a"}, last_used_at=T0)
    await store.insert(stored)
    first = await store.get(stored.record.id)
    assert first == stored
    assert await store.get(stored.record.id) is first  # the same row: decoded once

    # Any writer, a plain UPDATE from another connection included: the next read sees it.
    path = sqlite_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as other:
        other.execute(
            "UPDATE apikeys_keys SET state = 'revoked', metadata = ?, last_used_at = ? "
            "WHERE id = ?",
            ('{"team": "b"}', "2026-02-01 08:00:00.000000", stored.record.id),
        )
    changed = await store.get(stored.record.id)
    assert changed is not None
    assert changed.record.state == "revoked"
    assert changed.record.metadata == {"team": "b"}
    assert changed.record.last_used_at == datetime(2026, 2, 1, 8, tzinfo=UTC)
    assert first.record.state == "active"  # what was handed out before is left as it was


@pytest.mark.sqlite
async def test_store_on_an_application_engine_leaves_it_open(sqlite_url: str) -> None:
    engine = create_async_engine(async_url(sqlite_url))
    try:
        store = SQLStore(engine)
        await store.setup()
        await store.insert(make_key("k-app"))
        await store.aclose()

        async with engine.connect() as conn:
            count = await conn.scalar(sa.text("SELECT count(*) FROM apikeys_keys"))
        assert count == 1
    finally:
        await engine.dispose()


@pytest.mark.postgres
async def test_postgres_reads_keep_their_connections_under_concurrent_load(
    postgres_url: str, make_store: StoreFactory
) -> None:
    # Reads go through a pool that keeps its connections: 64 concurrent gets, again and
    # again, open at most pool_size connections and cost one round trip each.
    with TcpProxy.to_url(postgres_url) as proxy:
        store = make_store(proxy.url(postgres_url), table_name=unique_table(), pool_size=4)
        await store.setup()
        await store.insert(make_key("k-load"))
        await asyncio.gather(*(store.get("k-load") for _ in range(64)))  # the pool fills
        proxy.reset_counts()

        for _ in range(5):
            found = await asyncio.gather(*(store.get("k-load") for _ in range(64)))
            assert all(stored is not None for stored in found)

        assert proxy.connections == 0
        assert proxy.round_trips == 5 * 64


@pytest.mark.postgres
async def test_store_on_an_application_postgres_engine_reads_and_leaves_it_open(
    postgres_url: str,
) -> None:
    engine = create_async_engine(async_url(postgres_url))
    try:
        store = SQLStore(engine, table_name=unique_table())
        await store.setup()
        await store.insert(make_key("k-app"))
        assert (await record_of(store, "k-app")).id == "k-app"
        assert await store.get("k-none") is None
        await store.aclose()

        async with engine.connect() as conn:
            assert await conn.scalar(sa.text("SELECT 1")) == 1
    finally:
        await engine.dispose()


# --- faults -------------------------------------------------------------------------------


@pytest.mark.sqlite
async def test_if_sqlite_stays_locked_past_busy_timeout_then_writes_are_unavailable(
    sqlite_url: str, make_store: StoreFactory
) -> None:
    store = make_store(sqlite_url, busy_timeout=0.2)
    await store.setup()
    await store.insert(make_key("k-lock"))
    holder = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another writer holds the write lock

        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.set_state("k-lock", "revoked", allowed_from=("active",), at=T0)
        assert time.monotonic() - started < 3
        # Readers do not wait for writers in WAL mode.
        assert (await record_of(store, "k-lock")).state == "active"
    finally:
        holder.rollback()
        holder.close()

    after = await store.set_state("k-lock", "revoked", allowed_from=("active",), at=T0)
    assert after.state == "revoked"


def every_call(store: SQLStore) -> list[Callable[[], Awaitable[Any]]]:
    """One call of each method."""
    return [
        store.setup,
        lambda: store.insert(make_key("k-x")),
        lambda: store.get("k-x"),
        lambda: store.list("acme"),
        lambda: store.set_state("k-x", "revoked", allowed_from=("active",), at=T0),
        lambda: store.shorten_expiry("k-x", T0),
        lambda: store.replace_hash("k-x", "a", "b"),
        lambda: store.add_usage({"k-x": UsageDelta(1, T0)}, batch_id=uuid.uuid4().hex),
    ]


@pytest.mark.postgres
async def test_if_postgres_is_unreachable_then_every_call_is_unavailable_at_once(
    make_store: StoreFactory,
) -> None:
    store = make_store("postgresql://postgres@127.0.0.1:1/apikeys")

    for call in every_call(store):
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await call()
        assert time.monotonic() - started < 2


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts TCP connections and then never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener.getsockname()[1]


@pytest.mark.postgres
async def test_if_postgres_never_answers_then_calls_time_out_instead_of_hanging(
    make_store: StoreFactory, silent_server: int
) -> None:
    store = make_store(
        f"postgresql://postgres@127.0.0.1:{silent_server}/apikeys", connect_timeout=0.3
    )

    for call in [
        store.get("k-x"),
        store.add_usage({"k-x": UsageDelta(1, T0)}, batch_id=uuid.uuid4().hex),
    ]:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(call, timeout=10)
        assert time.monotonic() - started < 2


@pytest.mark.postgres
async def test_if_a_statement_outlasts_command_timeout_then_it_is_unavailable_and_recovers(
    postgres_url: str, make_store: StoreFactory
) -> None:
    table = unique_table()
    store = make_store(postgres_url, table_name=table, command_timeout=0.3)
    await store.setup()
    await store.insert(make_key("k-slow"))
    blocker = await asyncpg.connect(postgres_url)
    try:
        async with blocker.transaction():
            await blocker.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')
            for call in [
                store.get("k-slow"),
                store.set_state("k-slow", "disabled", allowed_from=("active",), at=T0),
            ]:
                started = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    await call
                assert time.monotonic() - started < 2
    finally:
        await blocker.close()

    assert (await record_of(store, "k-slow")).state == "active"
    after = await store.set_state("k-slow", "disabled", allowed_from=("active",), at=T0)
    assert after.state == "disabled"


@pytest.mark.postgres
@pytest.mark.parametrize("pool_pre_ping", [False, True])
async def test_if_the_server_drops_pooled_connections_then_the_next_calls_succeed(
    postgres_url: str, make_store: StoreFactory, pool_pre_ping: bool
) -> None:
    name = f"apikeys-test-{uuid.uuid4().hex[:8]}"
    store = make_store(
        postgres_url,
        table_name=unique_table(),
        application_name=name,
        pool_pre_ping=pool_pre_ping,
    )
    await store.setup()
    await store.insert(make_key("k-drop"))
    admin = await asyncpg.connect(postgres_url)

    async def drop_connections() -> None:
        # Fill the pool with several connections, then have the server close them all,
        # as a restart or an idle timeout in a proxy would.
        await asyncio.gather(*(store.get("k-drop") for _ in range(5)))
        dropped = await admin.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = $1",
            name,
        )
        assert dropped >= 1
        await asyncio.sleep(0.05)

    try:
        await drop_connections()
        assert (await record_of(store, "k-drop")).state == "active"
        await drop_connections()
        await store.set_state("k-drop", "disabled", allowed_from=("active",), at=T0)
        await drop_connections()
        await store.add_usage({"k-drop": UsageDelta(2, T0)}, batch_id=uuid.uuid4().hex)
        await drop_connections()
        [listed] = await store.list("acme")
    finally:
        await admin.close()
    assert (listed.state, listed.request_count) == ("disabled", 2)


@pytest.mark.postgres
async def test_store_unavailable_never_shows_the_password(make_store: StoreFactory) -> None:
    store = make_store("postgresql://app:s3cr3t-pw@127.0.0.1:1/apikeys")

    for call in every_call(store):
        with pytest.raises(StoreUnavailable) as caught:
            await call()
        error = caught.value
        shown = [str(error), repr(error), str(error.original), *traceback.format_exception(error)]
        assert not any("s3cr3t-pw" in text for text in shown)


# --- the security review: concurrent startup, file modes ------------------------------------

RACE = """
import asyncio, sys
from apikeys.stores.sql.store import create_tables
asyncio.run(create_tables(sys.argv[1], table_name=sys.argv[2]))
"""

EXAMPLE_RACE = """
import asyncio, sys
from examples.contacts_service.db import Database

async def main():
    database = Database(sys.argv[1])
    try:
        await database.create_tables()
    finally:
        await database.aclose()

asyncio.run(main())
"""


def _race(script: str, url: str, *args: str, processes: int = 4) -> list[str]:
    """Start `processes` interpreters running `script` at once; the errors of those that failed."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    running = [
        subprocess.Popen(
            [sys.executable, "-c", script, url, *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
        for _ in range(processes)
    ]
    errors = []
    for process in running:
        _, err = process.communicate(timeout=60)
        if process.returncode != 0:
            errors.append(err.decode(errors="replace")[-800:])
    return errors


@pytest.mark.parametrize("round_", range(3))
def test_if_processes_create_the_tables_at_once_then_none_fails(
    database: tuple[str, dict[str, Any]], tmp_path: Path, round_: int
) -> None:
    # Finding 8: two workers on a fresh database failed to start about half the time.
    url, options = database
    if url.startswith("sqlite"):
        url = f"sqlite:///{tmp_path / f'race-{round_}.db'}"
    table = options.get("table_name", "apikeys_keys")
    assert _race(RACE, url, table) == []


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("sqlite", marks=pytest.mark.sqlite),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_if_example_workers_create_their_tables_at_once_then_none_fails(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'example.db'}"
    else:
        # A database of its own: the example's tables have fixed names.
        base: str = request.getfixturevalue("postgres_url")
        name = f"apikeys_example_{uuid.uuid4().hex[:8]}"

        async def create_database() -> None:
            admin = await asyncpg.connect(base)
            try:
                await admin.execute(f'CREATE DATABASE "{name}"')
            finally:
                await admin.close()

        asyncio.run(create_database())
        url = f"{base.rsplit('/', 1)[0]}/{name}"
        request.addfinalizer(lambda: asyncio.run(_drop(base, name)))
    assert _race(EXAMPLE_RACE, url) == []


async def _drop(base: str, name: str) -> None:
    admin = await asyncpg.connect(base)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.mark.sqlite
async def test_if_the_sqlite_file_is_new_then_only_its_owner_can_read_it(tmp_path: Path) -> None:
    path = tmp_path / "fresh.db"
    store = SQLStore(f"sqlite:///{path}")
    try:
        await store.setup()
        await store.get("nothing0000a")
    finally:
        await store.aclose()
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.sqlite
async def test_if_the_sqlite_file_exists_then_its_mode_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "existing.db"
    sqlite3.connect(path).close()
    path.chmod(0o640)
    store = SQLStore(f"sqlite:///{path}")
    try:
        await store.setup()
    finally:
        await store.aclose()
    assert path.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize(
    ("url", "driver", "extra"),
    [
        ("postgresql://app@127.0.0.1/app", "asyncpg", "postgres"),
        ("sqlite:///keys.db", "aiosqlite", "sql"),
    ],
)
def test_if_the_driver_is_missing_then_the_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, url: str, driver: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, driver, None)  # `import <driver>` now fails
    with pytest.raises(ConfigurationError, match=rf"pip install 'apikeys\[{extra}\]'"):
        store_from_url(url)
