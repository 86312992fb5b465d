"""`get` on the bare driver, past SQLAlchemy's execution and result layers.

The hot path, `get`, is one SELECT by primary key, and by default (`direct_reads`) it runs
on the bare driver, past SQLAlchemy's execution and result layers, which cost more than the
query itself: on SQLite, with sqlite3 on the event loop's own thread (a point read costs
microseconds, less than a hop to a worker thread; a busy file falls back to a long-lived
aiosqlite connection); on PostgreSQL, with asyncpg's `fetchrow` on a connection
from a pool of asyncpg's own that keeps its connections (up to `pool_size`), outside any
transaction (no BEGIN/ROLLBACK round trips, no reset query on release). Neither
caches anything: each SELECT reads the latest committed state, so a write by any process is
visible to the next `get`. Every write goes through SQLAlchemy Core.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.util import greenlet_spawn

from apikeys.bounded import remember
from apikeys.stores.sql.engine import (
    PoolOptions,
    async_url,
    engine_or_hint,
    is_unavailable,
    raise_translated,
    split_url_options,
)
from apikeys.stores.sql.rows import stored_from_raw
from apikeys.types import StoredKey

if TYPE_CHECKING:
    import aiosqlite
    import asyncpg

__all__ = ["DirectReads", "direct_mode", "open_engine", "read_pool_options"]

logger = logging.getLogger("apikeys")

# How many keys' last rows SQLite's direct reads keep decoded (see `_decode_sqlite`).
_DECODED_ROWS: Final = 10_000


async def _keep_session(connection: Any) -> None:
    """The read pool's reset: its connections only ever run the `get` SELECT, outside any
    transaction, so there is no session state to reset (asyncpg's default reset would cost
    a round trip on every release)."""


def _release(connection: PoolProxiedConnection, error: BaseException | None) -> None:
    """Give a raw pooled connection back; with `error`, discard it instead."""
    if error is not None:
        connection.invalidate(error)
    connection.close()


def direct_mode(url: URL, direct_reads: bool, memory: bool) -> str:
    """How `get` reads on the bare driver: "asyncpg", "aiosqlite", or "" (through SQLAlchemy)."""
    if not direct_reads or url.get_driver_name() not in ("aiosqlite", "asyncpg"):
        return ""
    if url.get_driver_name() == "asyncpg":
        return "asyncpg"
    return "" if memory or url.query else "aiosqlite"


def read_pool_options(
    pool_size: int,
    pool_recycle: float,
    connect_timeout: float,
    command_timeout: float | None,
    application_name: str,
    prepared_statements: bool,
) -> dict[str, Any]:
    """The settings of the PostgreSQL read pool of asyncpg's own (see `reads.py`)."""
    options: dict[str, Any] = {
        "min_size": 0,
        "max_size": pool_size,
        "max_inactive_connection_lifetime": pool_recycle,
        "timeout": connect_timeout,
        "command_timeout": command_timeout,
        "server_settings": {"application_name": application_name},
    }
    if not prepared_statements:  # see `make_engine`
        options["statement_cache_size"] = 0
    return options


def open_engine(
    url: str | URL | AsyncEngine,
    *,
    pool_size: int,
    max_overflow: int,
    pool_timeout: float,
    pool_recycle: float,
    pool_pre_ping: bool,
    prepared_statements: bool,
    connect_timeout: float,
    command_timeout: float | None,
    busy_timeout: float,
    application_name: str,
    echo: bool,
) -> tuple[AsyncEngine, dict[str, Any] | None]:
    """The store's engine, and the settings of its PostgreSQL read pool (None: no pool of
    its own, on SQLite or an application's engine). The URL's own `?pool_size=…` and the
    like win over the keyword arguments."""
    if isinstance(url, AsyncEngine):
        return url, None
    url, pooling = split_url_options(
        async_url(url),
        PoolOptions(pool_size, max_overflow, pool_timeout, pool_recycle, prepared_statements),
    )
    engine = engine_or_hint(
        url,
        pool_size=pooling.pool_size,
        max_overflow=pooling.max_overflow,
        pool_timeout=pooling.pool_timeout,
        pool_recycle=pooling.pool_recycle,
        pool_pre_ping=pool_pre_ping,
        connect_timeout=connect_timeout,
        command_timeout=command_timeout,
        busy_timeout=busy_timeout,
        application_name=application_name,
        echo=echo,
        prepared_statements=pooling.prepared_statements,
    )
    if engine.dialect.name == "sqlite":
        return engine, None
    return engine, read_pool_options(
        pooling.pool_size,
        pooling.pool_recycle,
        connect_timeout,
        command_timeout,
        application_name,
        pooling.prepared_statements,
    )


class DirectReads:
    """The store's `get` on the bare driver: `mode` is "aiosqlite" or "asyncpg".

    `check_folder` refuses a SQLite file whose folder is missing, `translate` turns a
    driver's error into the store's, and `fallback` reads through SQLAlchemy (after a dead
    connection of an application's engine).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        mode: str,
        sql: str,
        path: str,
        busy_timeout: float,
        pool_timeout: float,
        pool_options: dict[str, Any] | None,
        check_folder: Callable[[], None],
        translate: Callable[[Exception], Exception],
        fallback: Callable[[str], Awaitable[StoredKey | None]],
    ) -> None:
        self.mode = mode
        self.pool_options = pool_options
        self._engine = engine
        self._url: URL = engine.url
        self._direct_sql = sql
        self._reader_path = path
        self._busy_timeout = busy_timeout
        self._pool_timeout = pool_timeout
        self._check_folder = check_folder
        self._translate = translate
        self._fallback = fallback
        self._reader: aiosqlite.Connection | None = None
        self._sync_reader: sqlite3.Connection | None = None
        self._reader_lock = asyncio.Lock()
        # PostgreSQL reads: a pool of asyncpg's own (see `_asyncpg_get`), made on first use
        # on each event loop, from the engine's connection arguments and `pool_options`.
        self._read_pool: tuple[asyncio.AbstractEventLoop, asyncpg.Pool] | None = None
        self._read_pool_lock = asyncio.Lock()
        # SQLite's direct reads: the last row read of each key, with what it decoded to.
        self._decoded: dict[str, tuple[Sequence[Any], StoredKey]] = {}

    async def get(self, key_id: str) -> StoredKey | None:
        """The stored key `key_id` (None: no such key), read on the bare driver."""
        if self.mode == "aiosqlite":
            return await self._sqlite_get(key_id)
        return await self._asyncpg_get(key_id)

    async def aclose(self) -> None:
        """Close the readers and the read pool."""
        await self._drop_reader()
        await self._close_read_pool()

    async def _open_reader(self) -> aiosqlite.Connection:
        import aiosqlite

        self._check_folder()
        async with self._reader_lock:
            if self._reader is None:
                reader = await aiosqlite.connect(
                    self._reader_path, isolation_level=None, timeout=self._busy_timeout
                )
                try:
                    await reader.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
                except BaseException:
                    await reader.close()
                    raise
                self._reader = reader
            return self._reader

    async def _drop_reader(self) -> None:
        self._drop_sync_reader()
        reader, self._reader = self._reader, None
        if reader is not None:
            # It is being discarded, maybe after an error: closing it is all that matters.
            with contextlib.suppress(Exception):
                await reader.close()

    def _open_sync_reader(self) -> sqlite3.Connection:
        self._check_folder()
        # No busy wait here: this runs on the event loop's thread (see `_sqlite_get`).
        reader = sqlite3.connect(
            self._reader_path, isolation_level=None, timeout=0, check_same_thread=False
        )
        self._sync_reader = reader
        return reader

    async def _sqlite_get(self, key_id: str) -> StoredKey | None:
        """`get` with sqlite3 on the event loop's own thread: a point read by primary key.

        In WAL mode a reader never waits for writers, so the read costs microseconds, far
        less than a hop to a worker thread. Should the file be busy anyway (a checkpoint,
        recovery), the read is not waited for here: it goes to aiosqlite's thread instead.
        """
        try:
            reader = self._sync_reader or self._open_sync_reader()
            rows = reader.execute(self._direct_sql, (key_id,)).fetchall()
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                return await self._sqlite_get_threaded(key_id)
            self._drop_sync_reader()
            raise_translated(self._translate(exc), exc)
        except (sqlite3.Error, OSError) as exc:
            self._drop_sync_reader()
            raise_translated(self._translate(exc), exc)
        for row in rows:
            return self._decode_sqlite(row)
        return None

    def _decode_sqlite(self, row: Sequence[Any]) -> StoredKey:
        """The `StoredKey` of a row read with sqlite3, decoded once per version of the row.

        A key read again unchanged (every verification of a store without a key cache, or
        while the cache is not proven fresh) costs a comparison of the row with the one read
        last, instead of parsing its times and its JSON again. The row is still read
        every time: a change by any process is a different row, decoded afresh.
        """
        seen = self._decoded.get(row[0])
        if seen is not None and seen[0] == row:
            return seen[1]
        stored = stored_from_raw(row, sqlite=True)
        remember(self._decoded, row[0], (row, stored), _DECODED_ROWS)
        return stored

    def _drop_sync_reader(self) -> None:
        reader, self._sync_reader = self._sync_reader, None
        if reader is not None:
            with contextlib.suppress(Exception):
                reader.close()

    async def _sqlite_get_threaded(self, key_id: str) -> StoredKey | None:
        """`get` on the long-lived autocommit aiosqlite connection: one thread hop."""
        try:
            reader = self._reader or await self._open_reader()
            rows = await reader.execute_fetchall(self._direct_sql, (key_id,))
        except (sqlite3.Error, OSError) as exc:
            await self._drop_reader()  # start afresh on the next call
            raise_translated(self._translate(exc), exc)
        for row in rows:
            return self._decode_sqlite(row)
        return None

    async def _asyncpg_get(self, key_id: str) -> StoredKey | None:
        """`get` with asyncpg's own `fetchrow`, outside any transaction.

        This skips SQLAlchemy's execution and result layers (half the cost of a `get`).
        A store that made its engine reads on a pool of asyncpg's own, which keeps its
        connections (up to `pool_size`) instead of opening and closing overflow connections
        under load, and gives a connection back without a reset query: one round trip per
        `get`. A store given an application's engine borrows that engine's connections.
        """
        options = self.pool_options
        if options is None:
            return await self._engine_pool_get(key_id)
        pool = await self._pg_read_pool(options)
        for attempt in (1, 2):
            acquired = False
            try:
                async with pool.acquire(timeout=self._pool_timeout) as connection:
                    acquired = True
                    row = await connection.fetchrow(self._direct_sql, key_id)
            except Exception as exc:
                if (
                    acquired
                    and attempt == 1
                    and is_unavailable(exc)
                    and not isinstance(exc, TimeoutError)
                ):
                    # A pooled connection was dead, e.g. the server restarted: replace the
                    # pool's connections and try once more on a fresh one.
                    await pool.expire_connections()
                    continue
                raise_translated(self._translate(exc), exc)
            return None if row is None else stored_from_raw(row, sqlite=False)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _pg_read_pool(self, options: dict[str, Any]) -> asyncpg.Pool:
        loop = asyncio.get_running_loop()
        current = self._read_pool
        if current is not None and current[0] is loop:
            return current[1]
        import asyncpg

        async with self._read_pool_lock:
            current = self._read_pool
            if current is not None and current[0] is loop:
                return current[1]
            if current is not None:
                # Left on another event loop, which cannot run its connections any more.
                with contextlib.suppress(Exception):
                    current[1].terminate()
            args, connect = self._engine.dialect.create_connect_args(self._url)
            pool = asyncpg.create_pool(*args, **connect, **options, reset=_keep_session)
            # min_size=0: nothing connects here, so this cannot fail for a down server.
            await pool
            self._read_pool = (loop, pool)
            return pool

    async def _close_read_pool(self) -> None:
        current, self._read_pool = self._read_pool, None
        if current is None:
            return
        loop, pool = current
        if loop is asyncio.get_running_loop():
            try:
                await asyncio.wait_for(pool.close(), timeout=self._pool_timeout)
                return
            except Exception as exc:
                logger.warning(
                    "apikeys: could not close the PostgreSQL read pool: %s", type(exc).__name__
                )
        with contextlib.suppress(Exception):
            pool.terminate()

    async def _engine_pool_get(self, key_id: str) -> StoredKey | None:
        """`_asyncpg_get` on a connection from the engine's pool (an application's engine)."""
        try:
            connection = await self._engine.raw_connection()
        except Exception as exc:
            raise_translated(self._translate(exc), exc)
        try:
            driver_connection: Any = connection.driver_connection
            row = await driver_connection.fetchrow(self._direct_sql, key_id)
        except BaseException as exc:
            unavailable = is_unavailable(exc)
            # A dead, timed-out or interrupted connection is discarded, not pooled again.
            discard = unavailable or not isinstance(exc, Exception)
            await greenlet_spawn(_release, connection, exc if discard else None)
            if not isinstance(exc, Exception):
                raise
            if unavailable and not isinstance(exc, TimeoutError):
                # The pooled connection was dead, e.g. the server restarted. SQLAlchemy's
                # own path invalidates the whole pool when it meets a dead connection and
                # then retries once on a fresh one.
                return await self._fallback(key_id)
            raise_translated(self._translate(exc), exc)
        await greenlet_spawn(connection.close)
        return None if row is None else stored_from_raw(row, sqlite=False)
