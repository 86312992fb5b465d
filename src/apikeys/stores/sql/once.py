"""The SQL store's one-time values (`KeyStore.put_once` and its kin) on `<keys>_once`.

Taking is one `DELETE … RETURNING` statement: the database deletes a row once, so of any
number of concurrent takers in any process exactly one gets its value back (SQLite has had
`RETURNING` since 3.35, PostgreSQL for ever). An expired row is deleted just the same but
not returned. An SQLite older than 3.35 reads the row, then deletes it: only the taker whose
`DELETE` removed it gets the value.

Putting first deletes the expired rows, so the table holds only live values, then inserts
with `ON CONFLICT`: `DO UPDATE` for `put_once` (a token put again has its value replaced,
never a duplicate-key error), `DO NOTHING` for `put_once_if_absent`, whose row count says
whether this call's row went in: the database lets one of any number of concurrent inserts
of a token in, and the others find its row. Replacing is one `UPDATE` (or `DELETE`) whose
`WHERE` holds the old value: a concurrent change of the row makes it match nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from datetime import UTC, datetime, timedelta
from typing import Protocol, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

__all__ = ["OneTimeValues", "Runner", "claim_setting"]

_T = TypeVar("_T")


class Runner(Protocol):
    """How the store runs work in a transaction of its own (`SQLStore._run`)."""

    def __call__(
        self, work: Callable[[AsyncConnection], Awaitable[_T]], *, write: bool = True
    ) -> Awaitable[_T]: ...


class OneTimeValues:
    """`SQLStore`'s one-time values in `table`, each call one transaction run by `run`."""

    def __init__(self, run: Runner, table: sa.Table) -> None:
        self._run = run
        self._table = table

    async def put(self, token: str, value: str, ttl: timedelta, *, only_new: bool) -> bool:
        """`put_once`, or with `only_new` `put_once_if_absent`: whether `value` went in."""
        return await self._run(lambda conn: self._put(conn, token, value, ttl, only_new))

    async def take(self, token: str) -> str | None:
        return await self._run(lambda conn: self._take(conn, token))

    async def peek(self, token: str) -> str | None:
        table = self._table
        where = (table.c.token == token, table.c.expires_at > datetime.now(UTC))
        statement = sa.select(table.c.value).where(*where)

        async def work(conn: AsyncConnection) -> str | None:
            found = (await conn.execute(statement)).scalar()
            return None if found is None else str(found)

        return await self._run(work, write=False)

    async def replace(self, token: str, old: str, new: str | None, ttl: timedelta) -> bool:
        table, now = self._table, datetime.now(UTC)
        where = (table.c.token == token, table.c.value == old, table.c.expires_at > now)
        statement: sa.Delete | sa.Update = (
            sa.delete(table).where(*where)
            if new is None
            else sa.update(table).where(*where).values(value=new, expires_at=now + ttl)
        )

        async def work(conn: AsyncConnection) -> bool:
            return (await conn.execute(statement)).rowcount == 1

        return await self._run(work)

    async def _put(
        self, conn: AsyncConnection, token: str, value: str, ttl: timedelta, only_new: bool
    ) -> bool:
        table, now = self._table, datetime.now(UTC)
        expired = sa.select(table.c.token).where(table.c.expires_at <= now)
        # Rows another transaction has locked are left to it (SQLite has no row locks and
        # ignores this): concurrent puts never wait on each other's pruning, nor deadlock.
        expired = expired.with_for_update(skip_locked=True)
        await conn.execute(sa.delete(table).where(table.c.token.in_(expired)))
        mine = table.c.token == token
        if only_new:  # this token's expired row, if skipped above, blocks no new value
            await conn.execute(sa.delete(table).where(mine, table.c.expires_at <= now))
        elif ttl <= timedelta(0):  # replaced by a value expired already: nothing is kept
            await conn.execute(sa.delete(table).where(mine))
            return True
        row = {"token": token, "value": value, "expires_at": now + ttl}
        statement = _insert(conn.dialect.name, table, only_new=only_new).values(row)
        return (await conn.execute(statement)).rowcount == 1

    async def _take(self, conn: AsyncConnection, token: str) -> str | None:
        table, now = self._table, datetime.now(UTC)
        where = table.c.token == token
        if conn.dialect.delete_returning:
            taken = await conn.execute(
                sa.delete(table).where(where).returning(table.c.value, table.c.expires_at)
            )
            row = taken.first()
        else:  # SQLite before 3.35: the one whose DELETE removed the row has it
            found = await conn.execute(sa.select(table.c.value, table.c.expires_at).where(where))
            row = found.first()
            if (
                row is not None
                and (await conn.execute(sa.delete(table).where(where))).rowcount != 1
            ):
                row = None
        if row is None or row.expires_at <= now:
            return None
        return str(row.value)


def _insert(dialect: str, table: sa.Table, *, only_new: bool) -> sa.Insert:
    """An INSERT into the one-time values that keeps the row there (`only_new`) or
    replaces it, never a duplicate-key error."""
    insert: postgresql.Insert | sqlite.Insert
    if dialect == "postgresql":
        insert = postgresql.insert(table)
    elif dialect == "sqlite":
        insert = sqlite.insert(table)
    else:  # pragma: no cover - other dialects: a duplicate token fails
        return sa.insert(table)
    if only_new:
        return insert.on_conflict_do_nothing()
    replaced = {"value": insert.excluded.value, "expires_at": insert.excluded.expires_at}
    return insert.on_conflict_do_update(index_elements=[table.c.token], set_=replaced)


async def claim_setting(
    conn: AsyncConnection,
    settings: sa.Table,
    dialect: str,
    name: str,
    value: str,
    replacing: Collection[str],
) -> str | None:
    """`KeyStore.claim_setting` in the transaction of `conn`: the value that stands."""
    where = settings.c.name == name
    if dialect == "sqlite":
        add: sa.Insert = sqlite.insert(settings).on_conflict_do_nothing()
    elif dialect == "postgresql":
        add = postgresql.insert(settings).on_conflict_do_nothing()
    else:  # pragma: no cover - other dialects: a concurrent first claim may fail once
        add = sa.insert(settings)
    # A value that stands is only read: every process start claims its setting, and a write
    # there would wait behind any lock on the table (CONTRACT section 15).
    found = (await conn.execute(sa.select(settings.c.value).where(where))).scalar()
    if found is not None and str(found) not in replacing:
        return str(found)
    # Replace a replaceable value, add one where none is, then read what is there: one
    # transaction, and a concurrent first claim loses to the one that committed.
    if replacing:
        await conn.execute(
            sa.update(settings)
            .where(where, settings.c.value.in_(list(replacing)))
            .values(value=value)
        )
    await conn.execute(add.values(name=name, value=value))
    recorded = (await conn.execute(sa.select(settings.c.value).where(where))).scalar()
    return None if recorded is None else str(recorded)
