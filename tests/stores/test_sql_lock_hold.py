"""How long PostgreSQL transactions hold what a `revoke` waits for.

On a loaded host every round trip of a transaction waits for the client and the server to
be scheduled, so what a transaction holds (a key's row lock, the server's lock on
notifications) is held for as many of those waits as it makes round trips. These tests pin
the shape that keeps a revoke's wait short (benchmarks/HISTORY.md, "Revoke on PostgreSQL
under load: where the tail came from"):

- a change to a key is one statement between BEGIN and COMMIT (the UPDATE, its audit entry
  and its notice);
- a usage flush updates the keys' rows last, right before its commit;
- an acknowledgement commits without waiting for the disk (it takes the server's lock on
  notifications, as every notifying transaction does, and keeps it through that wait).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa

from apikeys import Hasher, KeyManager, store_from_url
from apikeys.stores.sql.log import notice_channel_name
from apikeys.stores.sql.postgres_channel import PostgresChannel
from apikeys.stores.sql.store import SQLStore
from apikeys.types import UsageDelta
from tests.conftest import TEST_PEPPER


@pytest.fixture
async def pg_store(postgres_url: str) -> AsyncIterator[SQLStore]:
    table = f"apikeys_hold_{uuid.uuid4().hex[:10]}"
    store = store_from_url(postgres_url, table_name=table)
    assert isinstance(store, SQLStore)
    await store.setup()
    try:
        yield store
    finally:
        async with store._engine.begin() as conn:
            names = await conn.execute(
                sa.text("SELECT tablename FROM pg_tables WHERE tablename LIKE :prefix"),
                {"prefix": table + "%"},
            )
            for (name,) in names.all():
                await conn.execute(sa.text(f'DROP TABLE IF EXISTS "{name}" CASCADE'))
        await store.aclose()


def statements_of(store: SQLStore) -> list[str]:
    """Every statement the store's write engine sends from now on (BEGIN and COMMIT too)."""
    seen: list[str] = []
    engine = store._engine.sync_engine

    def cursor(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(" ".join(statement.split()))

    sa.event.listen(engine, "before_cursor_execute", cursor)
    sa.event.listen(engine, "begin", lambda conn: seen.append("BEGIN"))
    sa.event.listen(engine, "commit", lambda conn: seen.append("COMMIT"))
    return seen


async def test_a_change_is_one_statement_with_its_audit_entry_and_its_notice(
    pg_store: SQLStore, postgres_url: str
) -> None:
    manager = KeyManager(pg_store, hasher=Hasher(pepper=TEST_PEPPER), cache=False)
    created = await manager.create(name="hold", full_access=True)
    heard: list[str] = []
    listener = await asyncpg.connect(postgres_url)
    await listener.add_listener(
        notice_channel_name(pg_store._table.name), lambda *args: heard.append(args[3])
    )
    try:
        seen = statements_of(pg_store)
        record = await manager.revoke(created.record.id, actor="ops")
        assert record.state == "revoked"
        assert seen[0] == "BEGIN"
        assert seen[-1] == "COMMIT"
        assert len(seen) == 3, seen  # the UPDATE, its audit entry and its notice in one
        # Both happened: the audit entry, and the notice (the store's own and the writer's).
        actions = [event.action for event in await manager.audit(key_id=created.record.id)]
        assert actions[-1] == "revoked"
        for _ in range(100):
            if len(heard) >= 2:
                break
            await asyncio.sleep(0.02)
        assert any(created.record.id in notice for notice in heard)

        # A change that changes nothing (revoked again) records no audit entry, as before.
        seen.clear()
        again = await manager.revoke(created.record.id, actor="ops")
        assert again.state == "revoked"
        actions_after = [event.action for event in await manager.audit(key_id=created.record.id)]
        assert actions_after == actions
    finally:
        await listener.close()
        await manager.aclose()


async def test_a_usage_flush_updates_the_keys_rows_right_before_its_commit(
    pg_store: SQLStore,
) -> None:
    manager = KeyManager(pg_store, hasher=Hasher(pepper=TEST_PEPPER), cache=False)
    try:
        first = await manager.create(name="a", full_access=True)
        second = await manager.create(name="b", full_access=True)
        now = datetime.now(UTC)
        day = now.date().isoformat()
        usage = {
            key.record.id: UsageDelta(3, now, {(day, "admitted"): 3}) for key in (first, second)
        }
        seen = statements_of(pg_store)
        await pg_store.add_usage(usage, batch_id=uuid.uuid4().hex)
        flush = seen[: seen.index("COMMIT") + 1]  # (old batch ids are pruned after it)
        assert flush[0] == "BEGIN"
        assert flush[-2].startswith(f"UPDATE {pg_store._table.name} SET"), flush
        for key in (first, second):
            assert (await pg_store.get(key.record.id)) is not None
            assert (await manager.get(key.record.id)).request_count == 3
            assert (await pg_store.usage_history(key.record.id, now.date()))[0].admitted == 3
    finally:
        await manager.aclose()


class Recording:
    """The channel's connection, recording the statements it is given."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.sql: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.connection, name)

    async def execute(self, sql: str, *args: Any) -> Any:
        self.sql.append(sql)
        return await self.connection.execute(sql, *args)


async def test_an_acknowledgement_commits_without_waiting_for_the_disk(
    pg_store: SQLStore,
) -> None:
    writer, reader = pg_store.channel(), pg_store.channel()
    assert isinstance(writer, PostgresChannel)
    assert isinstance(reader, PostgresChannel)
    writer.bind()
    reader.bind()
    await writer.connect("writer0001", lambda notice: None)
    await reader.connect("reader0001", lambda notice: None)
    try:
        recording = Recording(reader._connection)
        reader._connection = recording
        notice = "writer0001:1:somekey"
        writer.expect(notice)
        await reader.ack(notice)
        for _ in range(100):
            if writer._acks[notice]:
                break
            await asyncio.sleep(0.02)
        assert writer._acks[notice] == {"reader0001"}  # it arrived
        (sql,) = recording.sql
        assert "set_config('synchronous_commit', 'off', true)" in sql
        # For that transaction only: the session keeps the server's setting.
        assert await recording.connection.fetchval("SHOW synchronous_commit") == "on"
    finally:
        await writer.disconnect()
        await reader.disconnect()
