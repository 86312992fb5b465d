"""The SQL store's one-time values (`KeyStore.put_once`, `take_once`) on `<keys>_once`.

Taking is one `DELETE … RETURNING` statement: the database deletes a row once, so of any
number of concurrent takers in any process exactly one gets its value back (SQLite has had
`RETURNING` since 3.35, PostgreSQL for ever). An expired row is deleted just the same but
not returned. Putting first deletes the expired rows, so the table holds only live values.
An SQLite older than 3.35 reads the row, then deletes it: only the taker whose `DELETE`
removed it gets the value.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

__all__ = ["put_once", "take_once"]


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
