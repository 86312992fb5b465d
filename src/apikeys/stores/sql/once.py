"""The SQL store's one-time values (`KeyStore.put_once`, `take_once`) on `<keys>_once`.

Taking is one `DELETE … RETURNING` statement: the database deletes a row once, so of any
number of concurrent takers in any process exactly one gets its value back (SQLite has had
`RETURNING` since 3.35, PostgreSQL for ever). An expired row is deleted just the same but
not returned. Putting first deletes the expired rows, so the table holds only live values.
An SQLite older than 3.35 reads the row, then deletes it: only the taker whose `DELETE`
removed it gets the value.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

__all__ = ["claim_setting", "put_once", "take_once"]


async def put_once(
    conn: AsyncConnection,
    table: sa.Table,
    token: str,
    value: str,
    *,
    now: datetime,
    expires_at: datetime,
) -> None:
    await conn.execute(sa.delete(table).where(table.c.expires_at <= now))
    if expires_at > now:
        await conn.execute(sa.insert(table).values(token=token, value=value, expires_at=expires_at))


async def take_once(
    conn: AsyncConnection, table: sa.Table, token: str, *, now: datetime
) -> str | None:
    where = table.c.token == token
    if conn.dialect.delete_returning:
        taken = await conn.execute(
            sa.delete(table).where(where).returning(table.c.value, table.c.expires_at)
        )
        row = taken.first()
    else:  # SQLite before 3.35: the one whose DELETE removed the row has it
        found = await conn.execute(sa.select(table.c.value, table.c.expires_at).where(where))
        row = found.first()
        if row is not None and (await conn.execute(sa.delete(table).where(where))).rowcount != 1:
            row = None
    if row is None or row.expires_at <= now:
        return None
    return str(row.value)


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
