"""`setup()` on a schema that is already right changes nothing and takes no lock stronger
than a read (CONTRACT section 15).

Every command of the command line and every process start runs `setup()`. On a database
whose schema is right it must neither drop nor make anything, nor wait behind a reader: a
`pg_dump`, a report, or a transaction left open on the keys table.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from apikeys.cli import main
from apikeys.stores.sql.schema import SCHEMA_LOCK, store_tables
from apikeys.stores.sql.store import SQLStore
from tests import services

PEPPER = "bw0Rec5PM6-_FWsqdJ2KioJA-RSJcPAjE_R1bBsvV8w"


@pytest.fixture
def impatient_database() -> Iterator[str]:
    """A PostgreSQL database of this test's own whose sessions wait at most 300 ms for a
    lock (`lock_timeout`): a statement that needs a lock a reader holds fails at once."""
    import psycopg

    services.require(services.POSTGRES_URL, "PostgreSQL", "APIKEYS_TEST_POSTGRES_URL")
    name = f"apikeys_setup_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(services.POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        admin.execute(f"ALTER DATABASE \"{name}\" SET lock_timeout = '300ms'")
    try:
        yield f"{services.POSTGRES_URL.rsplit('/', 1)[0]}/{name}"
    finally:
        with psycopg.connect(services.POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _tables(table: str) -> list[str]:
    return [made.name for made in store_tables(table)]


def _catalog(url: str, table: str) -> list[tuple[Any, ...]]:
    """Every object of the store's schema with its oid and row version (`xmin`): a drop and
    create, or any `ALTER`, changes them."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as connection:
        return connection.execute(
            "SELECT 'class', c.relname, c.oid::bigint, c.xmin::text FROM pg_class c "
            "WHERE c.relname LIKE %(like)s "
            "UNION ALL SELECT 'trigger', t.tgname, t.oid::bigint, t.xmin::text "
            "FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
            "WHERE c.relname = %(table)s AND NOT t.tgisinternal "
            "UNION ALL SELECT 'function', p.proname, p.oid::bigint, p.xmin::text "
            "FROM pg_proc p WHERE p.proname LIKE 'apikeys_log_%%' "
            "ORDER BY 1, 2",
            {"like": f"{table}%", "table": table},
        ).fetchall()


@pytest.mark.postgres
def test_a_second_setup_on_postgres_makes_nothing_again_and_waits_for_no_reader(
    impatient_database: str,
) -> None:
    import psycopg

    table = f"setup_keys_{uuid.uuid4().hex[:8]}"

    async def setup() -> None:
        store = SQLStore(impatient_database, table_name=table)
        try:
            await store.setup()
        finally:
            await store.aclose()

    asyncio.run(setup())
    before = _catalog(impatient_database, table)
    assert sum(row[0] == "trigger" for row in before) == 3
    with psycopg.connect(impatient_database) as reader:
        # EXCLUSIVE conflicts with every lock but ACCESS SHARE (a plain read): a setup that
        # wrote a row, or altered, dropped or created anything, would fail on lock_timeout.
        quoted = ", ".join(f'"{name}"' for name in _tables(table))
        reader.execute(f"LOCK TABLE {quoted} IN EXCLUSIVE MODE")
        asyncio.run(setup())
        asyncio.run(setup())
        reader.rollback()
    assert _catalog(impatient_database, table) == before


@pytest.mark.postgres
def test_a_second_manager_start_on_postgres_waits_for_no_reader(impatient_database: str) -> None:
    # A manager's start also claims its pepper fingerprint among the settings: once it is
    # recorded, a later start only reads it, as setup() only reads the schema.
    import psycopg

    from apikeys import Hasher, KeyManager

    table = f"start_keys_{uuid.uuid4().hex[:8]}"

    async def start() -> None:
        store = SQLStore(impatient_database, table_name=table)
        async with KeyManager(store, hasher=Hasher(PEPPER), cache=False, webhooks=False):
            pass

    asyncio.run(start())
    with psycopg.connect(impatient_database) as reader:
        quoted = ", ".join(f'"{name}"' for name in _tables(table))
        reader.execute(f"LOCK TABLE {quoted} IN EXCLUSIVE MODE")
        asyncio.run(start())
        reader.rollback()


@pytest.mark.postgres
def test_the_command_line_revokes_while_a_reader_holds_the_keys_table_open(
    impatient_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    monkeypatch.setenv("APIKEYS_PEPPER", PEPPER)
    monkeypatch.delenv("APIKEYS_STORE_URL", raising=False)
    url = impatient_database

    def cli(*args: str) -> str:
        result = CliRunner().invoke(main, ["--store", url, *args])
        assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
        return result.stdout

    created = json.loads(cli("create", "--name", "n", "--scope", "a:read", "--json"))
    with psycopg.connect(url) as reader:
        # A report (or pg_dump) reading the keys table, its transaction still open.
        reader.execute("SELECT count(*) FROM apikeys_keys").fetchone()
        cli("list")
        cli("revoke", created["id"], "--yes")
        reader.rollback()
    assert json.loads(cli("show", created["id"], "--json"))["status"] == "revoked"


def test_a_second_setup_on_sqlite_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"

    async def setup() -> None:
        store = SQLStore(f"sqlite:///{path}", busy_timeout=0.3)
        try:
            await store.setup()
        finally:
            await store.aclose()

    asyncio.run(setup())
    with sqlite3.connect(path) as db:
        schema = db.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall()
        version = db.execute("PRAGMA schema_version").fetchone()
    writer = sqlite3.connect(path, isolation_level=None)
    try:
        # Another process in the middle of a write: a setup that wrote would wait for it.
        writer.execute("BEGIN IMMEDIATE")
        asyncio.run(setup())
        writer.execute("ROLLBACK")
    finally:
        writer.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall() == (
            schema
        )
        assert db.execute("PRAGMA schema_version").fetchone() == version


@pytest.mark.postgres
def test_setup_widens_the_audit_and_change_log_columns_of_an_earlier_release(
    impatient_database: str,
) -> None:
    # Before identities, an audit event's key id was 12 characters and its action 16, a
    # notice 64: too short for `i:<identity id>`, `identity.disabled` and their notices.
    import psycopg

    table = f"t_{uuid.uuid4().hex[:8]}"

    async def set_up() -> None:
        store = SQLStore(impatient_database, table_name=table)
        try:
            await store.setup()
        finally:
            await store.aclose()

    def lengths() -> dict[str, int]:
        with psycopg.connect(impatient_database, autocommit=True) as connection:
            rows = connection.execute(
                "SELECT table_name || '.' || column_name, character_maximum_length "
                "FROM information_schema.columns WHERE table_name IN (%s, %s) "
                "AND column_name IN ('key_id', 'action', 'notice')",
                (f"{table}_audit", f"{table}_changes"),
            ).fetchall()
        return {name: length for name, length in rows}

    asyncio.run(set_up())
    with psycopg.connect(impatient_database, autocommit=True) as connection:
        connection.execute(f'ALTER TABLE "{table}_audit" ALTER COLUMN key_id TYPE varchar(12)')
        connection.execute(f'ALTER TABLE "{table}_audit" ALTER COLUMN action TYPE varchar(16)')
        connection.execute(f'ALTER TABLE "{table}_changes" ALTER COLUMN notice TYPE varchar(64)')
    assert lengths()[f"{table}_audit.key_id"] == 12

    asyncio.run(set_up())

    assert lengths() == {
        f"{table}_audit.key_id": 80,
        f"{table}_audit.action": 32,
        f"{table}_changes.notice": 128,
    }


async def test_setup_makes_the_identities_table_of_a_store_made_before_it(tmp_path: Path) -> None:
    # A new table, not a column change: a store whose tables an earlier release made gets
    # it (and its change log triggers) from `setup()`, and writes to it are logged.
    from apikeys.identities import IdentityRecord
    from apikeys.types import utcnow

    url = f"sqlite:///{tmp_path / 'keys.db'}"
    store = SQLStore(url)
    await store.setup()
    await store.aclose()
    with sqlite3.connect(tmp_path / "keys.db") as connection:
        connection.execute('DROP TABLE "apikeys_keys_identities"')

    store = SQLStore(url)
    try:
        await store.setup()
        record = IdentityRecord(id="acme", workspace="w", state="active", created_at=utcnow())
        await store.identities().insert(record)
        assert await store.identities().get("acme") == record
    finally:
        await store.aclose()
    with sqlite3.connect(tmp_path / "keys.db") as connection:
        notices = [
            row[0] for row in connection.execute('SELECT notice FROM "apikeys_keys_changes"')
        ]
    assert "store:0:i:acme" in notices


@pytest.mark.postgres
def test_a_setup_waits_its_turn_at_the_schema_longer_than_the_command_timeout(
    impatient_database: str,
) -> None:
    # Workers started together take turns at the schema: the last waits for all the others,
    # longer than one statement may last (`command_timeout`) or wait for a lock (this
    # database's `lock_timeout`). Here another process holds the turn for a second.
    import psycopg

    table = f"turn_keys_{uuid.uuid4().hex[:8]}"

    async def setup_while_held(holder: psycopg.Connection[Any]) -> None:
        store = SQLStore(impatient_database, table_name=table, command_timeout=0.3)
        setup = asyncio.create_task(store.setup())
        try:
            await asyncio.sleep(1.0)  # more than three command timeouts
            assert not setup.done()
            holder.commit()
            await setup
        finally:
            setup.cancel()
            await asyncio.gather(setup, return_exceptions=True)
            await store.aclose()

    with psycopg.connect(impatient_database) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(%s)", [SCHEMA_LOCK])
        asyncio.run(setup_while_held(holder))
    assert {row[1] for row in _catalog(impatient_database, table)} >= set(_tables(table))


@pytest.mark.postgres
def test_a_setup_whose_turn_never_comes_fails_as_unavailable(
    impatient_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    from apikeys.errors import StoreUnavailable
    from apikeys.stores.sql import schema

    monkeypatch.setattr(schema, "SCHEMA_TURN_WAIT", 0.5)

    async def setup() -> None:
        store = SQLStore(impatient_database, table_name=f"never_{uuid.uuid4().hex[:8]}")
        try:
            await store.setup()
        finally:
            await store.aclose()

    with psycopg.connect(impatient_database) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(%s)", [SCHEMA_LOCK])
        with pytest.raises(StoreUnavailable) as raised:
            asyncio.run(setup())
    assert "schema's lock" in str(raised.value)
