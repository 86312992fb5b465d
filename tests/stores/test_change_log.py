"""The SQL store's change log, kept by the database itself, against what people do to it.

Whoever writes to the keys table, its triggers log the change; a reader's probe reads that
log. These tests damage, bypass or move it the ways a database's users do (deleting the
log's row, a schema and search_path of their own, a role with only UPDATE, a table rebuilt by
a migration tool, triggers disabled, replication's `session_replication_role`) and check
that writes keep working and that a reader either sees every change or gives no proof.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from apikeys.stores.contract import Channel, ChannelError
from apikeys.stores.sql.log import POSTGRES_TRIGGERS
from apikeys.stores.sql.store import SQLStore
from apikeys.types import ACTIVE, REVOKED, utcnow
from tests.stores.test_store_conformance import make_key


class Reader:
    """A store's channel, connected, with the key ids delivered to it since the last probe
    (each once: on PostgreSQL a change also arrives early, by notification)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.keys: list[str] = []

    async def connect(self) -> None:
        await self.channel.connect("reader", lambda notice: self.keys.append(notice.split(":")[2]))

    async def probe(self) -> list[str]:
        await self.channel.probe()
        delivered = list(dict.fromkeys(self.keys))
        self.keys.clear()
        return delivered


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str]]:
    # A plain fixture: `postgres_url` may only be set up outside the test's event loop.
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'keys.db'}", {}
    url = str(request.getfixturevalue("postgres_url"))
    return url, {"table_name": f"log_keys_{uuid.uuid4().hex[:10]}"}


@pytest.fixture
async def store(database: tuple[str, dict[str, str]]) -> AsyncIterator[SQLStore]:
    url, options = database
    made = SQLStore(url, **options)
    await made.setup()
    try:
        yield made
    finally:
        await made.aclose()


@pytest.fixture
async def reader(store: SQLStore) -> AsyncIterator[Reader]:
    channel = store.channel()
    assert channel is not None
    made = Reader(channel)
    await made.connect()
    try:
        yield made
    finally:
        await channel.disconnect()


async def run_sql(store: SQLStore, sql: str, *params: Any) -> None:
    """SQL as `psql` or `sqlite3` would run it: a connection of its own, no apikeys."""
    if store.engine.dialect.name == "sqlite":
        path = store.engine.url.database
        assert path is not None
        with sqlite3.connect(path) as connection:
            connection.execute(sql.replace("$1", "?").replace("$2", "?"), params)
        return
    import asyncpg

    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    connection = await asyncpg.connect(url)
    try:
        await connection.execute(sql, *params)
    finally:
        await connection.close()


async def test_if_the_logs_row_is_deleted_by_hand_then_writes_go_on_and_readers_start_afresh(
    store: SQLStore, reader: Reader
) -> None:
    await store.insert(make_key("k-deleted-1"))
    assert await reader.probe() == ["k-deleted-1"]
    await run_sql(store, f'DELETE FROM "{store.table.name}_log"')  # noqa: S608
    # Writes still work: the log goes on from its newest change, never reusing a number.
    await store.insert(make_key("k-deleted-2"))
    await store.set_state("k-deleted-1", REVOKED, allowed_from=(ACTIVE,), at=utcnow())
    with pytest.raises(ChannelError):
        await reader.probe()  # another history: the reader starts afresh
    await store.setup()
    await store.set_state("k-deleted-2", REVOKED, allowed_from=(ACTIVE,), at=utcnow())
    fresh = Reader(reader.channel)
    await reader.channel.disconnect()
    await fresh.connect()
    await store.insert(make_key("k-deleted-3"))
    assert await fresh.probe() == ["k-deleted-3"]


async def test_if_the_keys_table_is_rebuilt_without_its_triggers_then_no_proof_until_remade(
    store: SQLStore, reader: Reader
) -> None:
    table = store.table.name
    await store.insert(make_key("k-rebuilt"))
    await reader.probe()
    # What a migration tool does: copy, drop, rename (the triggers go with the old table).
    await run_sql(store, f'CREATE TABLE "{table}_new" AS SELECT * FROM "{table}"')  # noqa: S608
    await run_sql(store, f'DROP TABLE "{table}"')
    await run_sql(store, f'ALTER TABLE "{table}_new" RENAME TO "{table}"')
    with pytest.raises(ChannelError, match="trigger"):
        await reader.channel.register(3.0)
    await reader.channel.disconnect()
    await reader.connect()  # made again when the reader reconnects
    await run_sql(store, f"UPDATE \"{table}\" SET state = 'revoked' WHERE id = $1", "k-rebuilt")  # noqa: S608  # noqa: S608
    assert await reader.probe() == ["k-rebuilt"]


@pytest.mark.postgres
async def test_if_triggers_are_disabled_then_no_proof_and_replication_still_logs(
    postgres_url: str,
) -> None:
    store = SQLStore(postgres_url, table_name=f"log_keys_{uuid.uuid4().hex[:10]}")
    await store.setup()
    table = store.table.name
    reader = Reader(store.channel())  # type: ignore[arg-type]
    await reader.connect()
    try:
        await store.insert(make_key("k-replica"))
        await reader.probe()
        import asyncpg

        connection = await asyncpg.connect(postgres_url)
        try:
            # Logical replication's apply worker and pg_restore run with this setting.
            async with connection.transaction():
                await connection.execute("SET LOCAL session_replication_role = replica")
                await connection.execute(
                    f"UPDATE \"{table}\" SET state = 'disabled' WHERE id = 'k-replica'"  # noqa: S608
                )
            assert await reader.probe() == ["k-replica"]
            await connection.execute(f'ALTER TABLE "{table}" DISABLE TRIGGER USER')
        finally:
            await connection.close()
        with pytest.raises(ChannelError, match="trigger"):
            await reader.channel.register(3.0)
        await store.setup()  # enables them again
        await reader.channel.register(3.0)
    finally:
        await reader.channel.disconnect()
        await store.aclose()


@pytest.mark.postgres
async def test_a_role_with_only_update_on_the_keys_table_is_logged(postgres_url: str) -> None:
    import asyncpg

    store = SQLStore(postgres_url, table_name=f"log_keys_{uuid.uuid4().hex[:10]}")
    await store.setup()
    table = store.table.name
    role = f"support_{uuid.uuid4().hex[:8]}"
    reader = Reader(store.channel())  # type: ignore[arg-type]
    await reader.connect()
    connection = await asyncpg.connect(postgres_url)
    try:
        await store.insert(make_key("k-support"))
        await reader.probe()
        await connection.execute(f'CREATE ROLE "{role}"')
        await connection.execute(f'GRANT UPDATE, SELECT ON "{table}" TO "{role}"')
        async with connection.transaction():
            await connection.execute(f'SET LOCAL ROLE "{role}"')
            update = f"UPDATE \"{table}\" SET state = 'revoked' WHERE id = 'k-support'"  # noqa: S608
            await connection.execute(update)
        assert await reader.probe() == ["k-support"]
    finally:
        await connection.execute(f'DROP OWNED BY "{role}"')
        await connection.execute(f'DROP ROLE IF EXISTS "{role}"')
        await connection.close()
        await reader.channel.disconnect()
        await store.aclose()


@pytest.mark.postgres
async def test_if_the_keys_table_is_in_a_schema_of_its_own_then_every_writer_is_logged_there(
    postgres_url: str,
) -> None:
    import asyncpg
    from sqlalchemy.ext.asyncio import create_async_engine

    schema = f"app_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(postgres_url)
    await admin.execute(f'CREATE SCHEMA "{schema}"')
    public = SQLStore(postgres_url, table_name="schema_keys")  # the same name in public
    engine = create_async_engine(
        postgres_url.replace("postgresql://", "postgresql+asyncpg://"),
        connect_args={"server_settings": {"search_path": schema}},
    )
    store = SQLStore(engine, table_name="schema_keys")
    try:
        await public.setup()
        await store.setup()
        reader = Reader(store.channel())  # type: ignore[arg-type]
        await reader.connect()
        try:
            await store.insert(make_key("k-schema"))
            assert await reader.probe() == ["k-schema"]
            # A DBA with the default search_path, naming the table by its schema.
            await admin.execute(
                f"UPDATE \"{schema}\".schema_keys SET state = 'revoked' WHERE id = 'k-schema'"  # noqa: S608
            )
            assert await reader.probe() == ["k-schema"]
            # The table of the same name in public keeps a log of its own.
            mark = f'SELECT seq FROM "{schema}".schema_keys_log'  # noqa: S608
            before = await admin.fetchval(mark)
            await public.insert(make_key("k-public"))
            assert await admin.fetchval(mark) == before
            assert await admin.fetchval("SELECT seq FROM public.schema_keys_log") == 1
        finally:
            await reader.channel.disconnect()
    finally:
        await store.aclose()
        await engine.dispose()
        await public.aclose()
        await admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
        await admin.execute("DROP TABLE IF EXISTS schema_keys CASCADE")
        await admin.close()


async def test_a_delete_by_hand_is_logged(store: SQLStore, reader: Reader) -> None:
    await store.insert(make_key("k-delete"))
    await reader.probe()
    await run_sql(store, f'DELETE FROM "{store.table.name}" WHERE id = $1', "k-delete")  # noqa: S608
    assert await reader.probe() == ["k-delete"]


@pytest.mark.postgres
async def test_a_truncate_by_hand_is_logged_as_every_key(postgres_url: str) -> None:
    store = SQLStore(postgres_url, table_name=f"log_keys_{uuid.uuid4().hex[:10]}")
    await store.setup()
    reader = Reader(store.channel())  # type: ignore[arg-type]
    await reader.connect()
    try:
        await store.insert(make_key("k-truncate"))
        await reader.probe()
        await run_sql(store, f'TRUNCATE "{store.table.name}"')
        assert await reader.probe() == ["*"]  # every key: the cache is cleared
    finally:
        await reader.channel.disconnect()
        await store.aclose()


async def test_a_sqlite_reader_prunes_a_long_log_a_batch_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After a bulk load, one DELETE of the whole backlog would hold SQLite's write lock past
    # the other writers' busy timeout: each registration prunes one batch of the oldest.
    import apikeys.stores.sql.sqlite_channel as sqlite_channel

    monkeypatch.setattr(sqlite_channel, "KEEP_CHANGES", 1)
    monkeypatch.setattr(sqlite_channel, "_PRUNE_BATCH", 5)
    path = tmp_path / "keys.db"
    store = SQLStore(f"sqlite:///{path}")
    channel = store.channel()
    assert channel is not None
    try:
        await store.setup()
        for _ in range(12):
            await store.insert(make_key())
        await channel.connect("pruner", lambda notice: None)
        left = []
        for _ in range(4):
            await channel.register(1.0)
            with sqlite3.connect(path) as db:
                left.append(db.execute("SELECT count(*) FROM apikeys_keys_changes").fetchone()[0])
    finally:
        await channel.disconnect()
        await store.aclose()
    assert left == [7, 2, 1, 1]


# Changes that do not pass the triggers: the triggers disabled, or their function replaced,
# and put back, in the transaction of the change itself. The catalogs show the triggers in
# force before it and after it; the reader must still notice that something got by them.
_ALWAYS = tuple(
    f'ALTER TABLE "{{table}}" ENABLE ALWAYS TRIGGER "{name}"' for name in POSTGRES_TRIGGERS
)
BYPASSES = {
    "disabled and enabled always": ('ALTER TABLE "{table}" DISABLE TRIGGER USER', *_ALWAYS),
    "disabled and enabled": (
        'ALTER TABLE "{table}" DISABLE TRIGGER USER',
        'ALTER TABLE "{table}" ENABLE TRIGGER USER',
    ),
    "disabled all": (
        'ALTER TABLE "{table}" DISABLE TRIGGER ALL',
        'ALTER TABLE "{table}" ENABLE TRIGGER ALL',
        *_ALWAYS,
    ),
}


@pytest.mark.postgres
@pytest.mark.parametrize("bypass", sorted(BYPASSES))
@pytest.mark.parametrize("change", ["update", "delete"])
async def test_a_change_that_got_past_the_triggers_inside_its_transaction_ends_the_proof(
    postgres_url: str, bypass: str, change: str
) -> None:
    import asyncpg

    store = SQLStore(postgres_url, table_name=f"log_keys_{uuid.uuid4().hex[:10]}")
    await store.setup()
    table = store.table.name
    reader = Reader(store.channel())  # type: ignore[arg-type]
    await reader.connect()
    connection = await asyncpg.connect(postgres_url)
    try:
        await store.insert(make_key("k-bypass"))
        assert await reader.probe() == ["k-bypass"]
        before, *after = BYPASSES[bypass]
        async with connection.transaction():
            await connection.execute(before.format(table=table))
            if change == "update":
                await connection.execute(
                    f"UPDATE \"{table}\" SET state = 'revoked' WHERE id = 'k-bypass'"  # noqa: S608
                )
            else:
                await connection.execute(f"DELETE FROM \"{table}\" WHERE id = 'k-bypass'")  # noqa: S608
            for statement in after:
                await connection.execute(statement.format(table=table))
        with pytest.raises(ChannelError, match="trigger"):
            await reader.probe()
        # A reader that starts again (its cache dropped) trusts the log from then on.
        await reader.channel.disconnect()
        await reader.connect()
        await store.insert(make_key("k-after"))
        assert await reader.probe() == ["k-after"]
    finally:
        await connection.close()
        await reader.channel.disconnect()
        await store.aclose()


@pytest.mark.postgres
async def test_a_change_made_while_the_log_function_was_replaced_ends_the_proof(
    postgres_url: str,
) -> None:
    import asyncpg

    store = SQLStore(postgres_url, table_name=f"log_keys_{uuid.uuid4().hex[:10]}")
    await store.setup()
    table = store.table.name
    reader = Reader(store.channel())  # type: ignore[arg-type]
    await reader.connect()
    connection = await asyncpg.connect(postgres_url)
    try:
        await store.insert(make_key("k-replaced"))
        assert await reader.probe() == ["k-replaced"]
        function, definition = await connection.fetchrow(
            "SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid) FROM pg_trigger t "
            "JOIN pg_proc p ON p.oid = t.tgfoid WHERE t.tgrelid = $1::regclass LIMIT 1",
            table,
        )
        async with connection.transaction():
            await connection.execute(
                f"CREATE OR REPLACE FUNCTION {function} RETURNS trigger LANGUAGE plpgsql "
                "AS $$ BEGIN RETURN NULL; END $$"
            )
            await connection.execute(
                f"UPDATE \"{table}\" SET state = 'revoked' WHERE id = 'k-replaced'"  # noqa: S608
            )
            await connection.execute(definition)  # the function as it was
        with pytest.raises(ChannelError, match="trigger"):
            await reader.probe()
    finally:
        await connection.close()
        await reader.channel.disconnect()
        await store.aclose()


@pytest.mark.postgres
async def test_the_postgres_change_log_stays_about_the_size_of_what_it_keeps(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The log keeps its newest entries (KEEP_CHANGES; fewer here, so the test is light) and
    # deletes the oldest 128 at a time. Vacuumed whenever its storage parameters tell
    # autovacuum to (after every so many dead rows), it reuses what it freed and never
    # grows past a small multiple of a table holding the entries it keeps.
    import asyncpg

    import apikeys.stores.sql.log as sql_log

    keep = 1_000
    monkeypatch.setattr(sql_log, "KEEP_CHANGES", keep)
    store = SQLStore(postgres_url, table_name=f"log_keys_{uuid.uuid4().hex[:10]}")
    await store.setup()
    table = store.table.name
    changes = f"{table}_changes"
    connection = await asyncpg.connect(postgres_url)
    try:
        options = await connection.fetchval(
            "SELECT reloptions FROM pg_class WHERE oid = $1::regclass", changes
        )
        assert set(sql_log.CHANGES_STORAGE) <= set(options or ())
        threshold = next(
            int(option.split("=")[1])
            for option in options
            if option.startswith("autovacuum_vacuum_threshold=")
        )
        assert "autovacuum_vacuum_scale_factor=0" in options  # not a share of the table
        for number in range(10):
            await store.insert(make_key(f"k-size-{number}"))

        async def change(count: int) -> None:
            # One transaction per change, as the store's writers make them.
            for number in range(count):
                await connection.execute(
                    f'UPDATE "{table}" SET name = $1 WHERE id = $2',  # noqa: S608
                    f"name {number} {uuid.uuid4().hex}",
                    f"k-size-{number % 10}",
                )

        async def size() -> int:
            return int(await connection.fetchval("SELECT pg_total_relation_size($1)", changes))

        await change(keep)
        await connection.execute(f'VACUUM "{changes}"')
        full = await size()  # the entries kept, and their indexes
        sizes = []
        for _ in range(6):
            await change(threshold)  # as many dead rows as start an autovacuum
            await connection.execute(f'VACUUM "{changes}"')
            sizes.append(await size())
        kept = await connection.fetchval(f'SELECT count(*) FROM "{changes}"')  # noqa: S608
        assert keep <= kept < keep + 128
        print(f"kept {kept} entries: {full} bytes, then {sizes}")
        # Up to `threshold` dead entries beside the ones kept (here as many again), and
        # then no growth: the space freed is used again.
        assert max(sizes) <= 3 * full, (full, sizes)
        assert sizes[-1] <= sizes[1] * 1.25, (full, sizes)
    finally:
        await connection.close()
        await store.aclose()


@pytest.mark.parametrize("change", ["update", "delete"])
async def test_a_sqlite_change_made_while_the_triggers_were_dropped_ends_the_proof(
    tmp_path: Path, change: str
) -> None:
    # SQLite cannot disable a trigger: dropping it and making it again around the change,
    # in one transaction, is the same bypass.
    path = tmp_path / "keys.db"
    store = SQLStore(f"sqlite:///{path}")
    await store.setup()
    reader = Reader(store.channel())  # type: ignore[arg-type]
    await reader.connect()
    try:
        await store.insert(make_key("k-dropped"))
        assert await reader.probe() == ["k-dropped"]
        connection = sqlite3.connect(path, isolation_level=None)
        try:
            triggers = connection.execute(
                "SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"
            ).fetchall()
            connection.execute("BEGIN IMMEDIATE")
            for name, _ in triggers:
                connection.execute(f'DROP TRIGGER "{name}"')
            if change == "update":
                connection.execute(
                    "UPDATE apikeys_keys SET state = 'revoked' WHERE id = 'k-dropped'"
                )
            else:
                connection.execute("DELETE FROM apikeys_keys WHERE id = 'k-dropped'")
            for _, sql in triggers:
                connection.execute(sql)
            connection.execute("COMMIT")
        finally:
            connection.close()
        with pytest.raises(ChannelError, match="trigger"):
            await reader.probe()
        await reader.channel.disconnect()
        await reader.connect()
        await store.insert(make_key("k-after"))
        assert await reader.probe() == ["k-after"]
    finally:
        await reader.channel.disconnect()
        await store.aclose()
