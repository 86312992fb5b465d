"""Sets of the PostgreSQL store's tables that the tests of a session take in turn.

Making a store's tables, their indexes and the log's triggers costs PostgreSQL about 0.4 s
(some sixty statements); a test that uses the store for a few milliseconds paid that each
time. Here a set is made once, and after each test emptied (every row deleted, every
sequence back at 1) and handed to the next one. A test then sees what a new
database shows once the store's `setup()` ran on it (setup writes the log's row again).

A set is given back to no one when the test changed its schema (a column, an index, a
constraint or a trigger differs from what the store made), or when it cannot be emptied
within a second because a connection the test left behind still holds a lock on it.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["PostgresTables"]

_T = TypeVar("_T")

# Everything of a set the store makes, as text: its tables' columns with their types,
# defaults and nullability, their indexes and constraints, and the triggers on them with the
# source of their functions. The set's tables are those whose names start with its name.
FINGERPRINT = """
WITH tables AS (
    SELECT c.oid, c.relname FROM pg_class c
    WHERE c.relnamespace = current_schema()::regnamespace
      AND c.relkind IN ('r', 'p') AND starts_with(c.relname, $1)
)
SELECT coalesce(string_agg(part, E'\\n' ORDER BY part), '') FROM (
    SELECT format('column %s.%s %s %s %s', t.relname, a.attname,
                  format_type(a.atttypid, a.atttypmod), a.attnotnull,
                  pg_get_expr(d.adbin, d.adrelid)) AS part
    FROM tables t
    JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum > 0 AND NOT a.attisdropped
    LEFT JOIN pg_attrdef d ON d.adrelid = t.oid AND d.adnum = a.attnum
    UNION ALL
    SELECT 'index ' || pg_get_indexdef(i.indexrelid)
    FROM pg_index i JOIN tables t ON t.oid = i.indrelid
    UNION ALL
    SELECT format('constraint %s %s', t.relname, pg_get_constraintdef(k.oid))
    FROM pg_constraint k JOIN tables t ON t.oid = k.conrelid
    UNION ALL
    SELECT format('trigger %s %s %s', pg_get_triggerdef(g.oid), g.tgenabled,
                  pg_get_functiondef(g.tgfoid))
    FROM pg_trigger g JOIN tables t ON t.oid = g.tgrelid
    WHERE NOT g.tgisinternal
) parts
"""

TABLES = """
SELECT c.relname FROM pg_class c
WHERE c.relnamespace = current_schema()::regnamespace
  AND c.relkind IN ('r', 'p') AND starts_with(c.relname, $1)
ORDER BY c.relname
"""

RESTART_SEQUENCES = """
SELECT setval(c.oid, 1, false) FROM pg_class c
WHERE c.relnamespace = current_schema()::regnamespace
  AND c.relkind = 'S' AND starts_with(c.relname, $1)
"""


def _run(make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """`asyncio.run(make())` in a thread of its own: fixtures call this between tests, and
    the test's event loop (pytest-asyncio's) must stay the thread's current one."""
    result: list[_T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(make()))
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


class PostgresTables:
    """A session's pool of the store's table sets in the database at `url`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.free: list[str] = []
        self.fingerprints: dict[str, str] = {}
        self.made = 0
        self.reused = 0

    def take(self) -> str:
        """The name (the store's `table_name`) of an empty set, made now if none is free."""
        if self.free:
            self.reused += 1
            return self.free.pop()
        name = f"apikeys_keys_{uuid.uuid4().hex[:10]}"
        _run(lambda: self._make(name))
        self.made += 1
        return name

    def give_back(self, name: str) -> None:
        """Empty the set `name` for the next test, unless its schema changed or it stays
        locked; then it is left as it is (dropped with the session's database)."""
        if _run(lambda: self._empty(name)):
            self.free.append(name)

    async def _make(self, name: str) -> None:
        from apikeys import store_from_url

        store = store_from_url(self.url, table_name=name)
        try:
            await store.setup()
        finally:
            await store.aclose()
        conn = await self._connect()
        try:
            self.fingerprints[name] = await conn.fetchval(FINGERPRINT, name)
            await self._empty_rows(conn, name)
        finally:
            await conn.close()

    async def _empty(self, name: str) -> bool:
        import asyncpg

        conn = await self._connect()
        try:
            if await conn.fetchval(FINGERPRINT, name) != self.fingerprints[name]:
                return False
            try:
                await self._empty_rows(conn, name)
            except asyncpg.exceptions.LockNotAvailableError:
                return False
            return True
        finally:
            await conn.close()

    async def _connect(self) -> Any:
        import asyncpg

        return await asyncpg.connect(self.url)

    @staticmethod
    async def _empty_rows(conn: Any, name: str) -> None:
        """Delete every row of the set and set its sequences back to 1.

        DELETE rather than TRUNCATE: the tables hold a few rows, and a TRUNCATE makes new
        files for every table and index, which the commit then syncs to disk (up to half a
        second on a busy machine).
        """
        tables = [str(row[0]) for row in await conn.fetch(TABLES, name)]
        async with conn.transaction():
            await conn.execute("SET LOCAL lock_timeout = '1s'")
            await conn.execute(f'DELETE FROM "{name}"')  # noqa: S608
        # The keys table's triggers logged those deletions at that commit: gone next.
        async with conn.transaction():
            await conn.execute("SET LOCAL lock_timeout = '1s'")
            for table in tables:
                if table != name:
                    await conn.execute(f'DELETE FROM "{table}"')  # noqa: S608
            await conn.execute(RESTART_SEQUENCES, name)
