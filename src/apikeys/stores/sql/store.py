"""The SQL store: SQLite and PostgreSQL through SQLAlchemy 2's async Core (no ORM).

Its schema (tables, safe creation) is in `apikeys.stores.sql.schema`, its URLs, engines and
error classification in `apikeys.stores.sql.engine`; this module re-exports their public
names, so `from apikeys.stores.sql.store import metadata, keys_table, create_tables` keeps working.

One table holds the keys (`apikeys_keys` by default); a second one, named after it
(`apikeys_keys_usage_batches`), holds the ids of the usage batches applied in the last
`USAGE_BATCH_RETENTION` (24 hours), so that a batch sent again is not counted twice (see
`add_usage`). Both live on the module's `metadata` (`keys_table(name, meta)` puts both on
`meta`), so an application that manages its schema with Alembic adds it to its own target
metadata::

    from apikeys.stores.sql.store import metadata as apikeys_metadata

    target_metadata = [app_metadata, apikeys_metadata]

Without Alembic, `await SQLStore.setup()` (or `await create_tables(url)`) creates the tables
and their indexes if they are missing; it is idempotent. A store whose `setup` was skipped
creates the tables the first time a statement finds one missing (`auto_create=False` turns
that off: a missing table then raises `ConfigurationError`).

URLs and drivers:

- `sqlite:///path/keys.db` (or `sqlite+aiosqlite://`) runs on aiosqlite. Each connection
  turns on WAL journal mode and a busy timeout, so several processes can share the file:
  readers never wait for a writer, and writers wait (up to `busy_timeout`) for each other.
- `postgresql://`, `postgres://` (or `postgresql+asyncpg://`) run on asyncpg, the fastest
  async PostgreSQL driver: it speaks the binary protocol and keeps a per-connection cache
  of prepared statements, so the `get` SELECT is parsed and planned once per connection
  and then costs one round trip. Connecting times out after `connect_timeout` and every
  statement after `command_timeout`, so a dead or hung server fails fast instead of
  holding requests.

The hot path, `get`, is one SELECT by primary key, and by default (`direct_reads`) it runs
on the bare driver, past SQLAlchemy's execution and result layers, which cost more than the
query itself: on SQLite, with sqlite3 on the event loop's own thread (a point read costs
microseconds, less than a hop to a worker thread; a busy file falls back to a long-lived
aiosqlite connection); on PostgreSQL, with asyncpg's `fetchrow` on a connection
from a pool of asyncpg's own that keeps its connections (up to `pool_size`), outside any
transaction (no BEGIN/ROLLBACK round trips, no reset query on release). Neither
caches anything: each SELECT reads the latest committed state, so a write by any process is
visible to the next `get`. Every write goes through SQLAlchemy Core.

Failure handling: connection errors, timeouts, a locked SQLite file (after the busy timeout)
and a full pool raise `StoreUnavailable(original)`. Rather than a pre-ping on every checkout
(three round trips with asyncpg outside a transaction), the pool is invalidated when a
connection turns out dead and a statement that failed that way, before any commit, is
retried once on a fresh connection (the PostgreSQL read pool then replaces all its
connections). So after a database restart the next call succeeds without restarting the
application. Pass `pool_pre_ping=True` to ping the write pool's connections on checkout
instead; reads never ping (a ping would be a second round trip per request).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import os
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.util import greenlet_spawn

from apikeys.bounded import remember
from apikeys.errors import DuplicateKeyId, KeyNotFound, StoreUnavailable
from apikeys.listing import KeyFilter, Position
from apikeys.policies import load_metadata
from apikeys.stores.contract import MAX_ROLL_HOPS, USAGE_BATCH_RETENTION, Channel, KeyStore
from apikeys.stores.shared import days_of as _days
from apikeys.stores.sql import once as sql_once
from apikeys.stores.sql.engine import (
    MissingTable,
    PoolOptions,
    async_url,
    engine_or_hint,
    is_duplicate,
    is_missing_table,
    is_sqlite_memory,
    is_unavailable,
    raise_translated,
    replication_risk,
    split_url_options,
    unavailable_hint,
)
from apikeys.stores.sql.listing import page_statement
from apikeys.stores.sql.log import install_change_log, table_schema, trigger_names
from apikeys.stores.sql.postgres_channel import PostgresChannel, notice_channel_name
from apikeys.stores.sql.schema import (
    DEFAULT_TABLE_NAME,
    UTCDateTime,
    audit_table,
    changes_table,
    create_concurrently,
    create_private_file,
    create_tables_on,
    keys_table,
    load_scopes,
    metadata,
    readers_table,
    store_tables,
    usage_batches_table,
)
from apikeys.stores.sql.sqlite_channel import SQLiteChannel
from apikeys.types import (
    REVOKED,
    AuditEvent,
    DailyUsage,
    KeyRecord,
    StoredKey,
    StoredState,
    UsageDelta,
)

if TYPE_CHECKING:
    import aiosqlite
    import asyncpg

    from apikeys.stores.contract import WebhookStore

__all__ = [
    "DEFAULT_TABLE_NAME",
    "SQLStore",
    "UTCDateTime",
    "async_url",
    "audit_table",
    "changes_table",
    "create_concurrently",
    "create_private_file",
    "create_tables",
    "keys_table",
    "metadata",
    "readers_table",
    "usage_batches_table",
]

_T = TypeVar("_T")

logger = logging.getLogger("apikeys")

# How often a store deletes the ids of usage batches older than USAGE_BATCH_RETENTION.
_PRUNE_INTERVAL: Final = 60.0
# How many keys' last rows SQLite's direct reads keep decoded (see `_decode_sqlite`).
_DECODED_ROWS: Final = 10_000


# Column order of every SELECT and RETURNING: the fields of KeyRecord, then the hash.
_FIELDS: Final = (
    "id",
    "name",
    "workspace",
    "prefix",
    "access",
    "scopes",
    "state",
    "rate_limit",
    "created_at",
    "expires_at",
    "last_used_at",
    "request_count",
    "revoked_at",
    "secret_hash",
    "replaces",
    "replaced_by",
    "owner",
    "metadata",
    "allowed_ips",
    "credits",
    "credit_refill",
    "credits_refilled_at",
)


def _shared(text: Any) -> Any:
    """`text` interned: the values many keys hold alike (workspace, access, state, limits)
    are kept once, not once per cached key, as a driver returns them."""
    return text if text is None else sys.intern(text)


def _record(row: Sequence[Any]) -> KeyRecord:
    return KeyRecord(
        id=row[0],
        name=row[1],
        workspace=_shared(row[2]),
        prefix=row[3],
        access=_shared(row[4]),
        scopes=row[5],
        state=_shared(row[6]),
        rate_limit=_shared(row[7]),
        created_at=row[8],
        expires_at=row[9],
        last_used_at=row[10],
        request_count=row[11],
        revoked_at=row[12],
        replaces=row[14],
        replaced_by=row[15],
        owner=row[16],
        metadata=row[17],
        allowed_ips=row[18],
        credits=row[19],
        credit_refill=_shared(row[20]),
        credits_refilled_at=row[21],
    )


def _sqlite_time(value: Any) -> datetime | None:
    if value is None:
        return None
    return datetime.fromisoformat(value).replace(tzinfo=UTC)


def _raw_stored(row: Sequence[Any], *, sqlite: bool) -> StoredKey:
    """A `StoredKey` from a row read with the bare driver, without SQLAlchemy's types.

    asyncpg already returns `timestamptz` as aware UTC datetimes; sqlite3 returns the text
    `UTCDateTime` stored.
    """
    time = _sqlite_time if sqlite else _utc
    record = KeyRecord(
        id=row[0],
        name=row[1],
        workspace=_shared(row[2]),
        prefix=row[3],
        access=_shared(row[4]),
        scopes=load_scopes(row[5]),
        state=_shared(row[6]),
        rate_limit=_shared(row[7]),
        created_at=cast(datetime, time(row[8])),
        expires_at=time(row[9]),
        last_used_at=time(row[10]),
        request_count=row[11],
        revoked_at=time(row[12]),
        replaces=row[14],
        replaced_by=row[15],
        owner=row[16],
        metadata=load_metadata(row[17]),
        allowed_ips=load_scopes(row[18]),
        credits=row[19],
        credit_refill=_shared(row[20]),
        credits_refilled_at=time(row[21]),
    )
    return StoredKey(record=record, secret_hash=row[13])


def _utc(value: Any) -> datetime | None:
    if value is None or value.tzinfo is UTC:
        return cast(datetime | None, value)
    return cast(datetime, value.astimezone(UTC))


async def _keep_session(connection: Any) -> None:
    """The read pool's reset: its connections only ever run the `get` SELECT, outside any
    transaction, so there is no session state to reset (asyncpg's default reset would cost
    a round trip on every release)."""


def _release(connection: PoolProxiedConnection, error: BaseException | None) -> None:
    """Give a raw pooled connection back; with `error`, discard it instead."""
    if error is not None:
        connection.invalidate(error)
    connection.close()


async def create_tables(
    bind: AsyncEngine | AsyncConnection | str | URL, *, table_name: str = DEFAULT_TABLE_NAME
) -> None:
    """Create the keys table and its usage batches table (and indexes) if missing. Idempotent.

    `bind` is an engine, a connection, or a URL (a short-lived engine is made and disposed).
    Raises `StoreUnavailable` when the database cannot be reached.
    """
    if isinstance(bind, AsyncConnection):
        await bind.run_sync(create_tables_on, store_tables(table_name))
        return
    # A store on a URL brings the store's connection settings (timeouts, WAL).
    store = SQLStore(bind, table_name=table_name)
    try:
        await store.setup()
    finally:
        await store.aclose()


# --- the store ----------------------------------------------------------------------------


class SQLStore(KeyStore):
    """Keys in one SQL table, on SQLite (aiosqlite) or PostgreSQL (asyncpg).

    Every change is one atomic statement (a compare-and-set `UPDATE … WHERE`, or atomic
    increments for usage), so processes sharing the database never lose updates, and no
    read is cached: `get` always sees the last committed write of any process.

    Options (keyword arguments of `from_url` / `store_from_url`):

    - `table_name`: the table to use (default `apikeys_keys`);
    - `pool_size`, `max_overflow`, `pool_timeout`, `pool_recycle`, `pool_pre_ping`: the
      connection pool of writes (defaults 2, 0, 5 s, 1800 s, off). On PostgreSQL, `get`
      reads through a second pool of up to `pool_size` connections that it keeps open
      (closing one idle for `pool_recycle`), waiting up to `pool_timeout` for a free one:
      a process holds at most `2 * pool_size + max_overflow` connections, 4 by default;
    - `prepared_statements`: keep prepared statements on each connection (default on);
      off for a pooler in transaction mode such as PgBouncer's (see `make_engine`);
    - `connect_timeout`, `command_timeout`: PostgreSQL connect and statement timeouts in
      seconds (default 5 each; `command_timeout=None` disables it);
    - `busy_timeout`: how long a SQLite writer waits for a lock, in seconds (default 5);
    - `direct_reads`: run `get` on the bare driver, past SQLAlchemy's execution layer
      (default on; see the module doc);
    - `auto_create`: create the table on first use when it is missing, as `setup()` would
      (default on; off, a missing table raises `ConfigurationError`);
    - `application_name`: what PostgreSQL shows in `pg_stat_activity` (default `apikeys`);
    - `echo`: log every statement (SQLAlchemy's `echo`).

    A URL's query string may carry `pool_size`, `max_overflow`, `pool_timeout`,
    `pool_recycle` and `prepared_statements` too (`postgresql://…/app?pool_size=5`), and
    wins over the keyword argument: a URL is all the command line and `APIKEYS_STORE_URL`
    can give.

    Pass an `AsyncEngine` instead of a URL to share an application's engine; the store then
    leaves that engine open in `aclose`.
    """

    schemes = ("sqlite", "sqlite+aiosqlite", "postgresql", "postgres", "postgresql+asyncpg")

    def __init__(
        self,
        url: str | URL | AsyncEngine,
        *,
        table_name: str = DEFAULT_TABLE_NAME,
        pool_size: int = 2,
        max_overflow: int = 0,
        pool_timeout: float = 5.0,
        pool_recycle: float = 1800.0,
        pool_pre_ping: bool = False,
        prepared_statements: bool = True,
        connect_timeout: float = 5.0,
        command_timeout: float | None = 5.0,
        busy_timeout: float = 5.0,
        direct_reads: bool = True,
        auto_create: bool = True,
        application_name: str = "apikeys",
        echo: bool = False,
    ) -> None:
        if isinstance(url, AsyncEngine):
            self._engine = url
            self._owns_engine = False
        else:
            # The URL's own `?pool_size=…` and the like win over the keyword arguments.
            url, pooling = split_url_options(
                async_url(url),
                PoolOptions(
                    pool_size, max_overflow, pool_timeout, pool_recycle, prepared_statements
                ),
            )
            pool_size, max_overflow = pooling.pool_size, pooling.max_overflow
            pool_timeout, pool_recycle = pooling.pool_timeout, pooling.pool_recycle
            prepared_statements = pooling.prepared_statements
            self._engine = engine_or_hint(
                url,
                pool_size=pool_size,
                max_overflow=max_overflow,
                pool_timeout=pool_timeout,
                pool_recycle=pool_recycle,
                pool_pre_ping=pool_pre_ping,
                connect_timeout=connect_timeout,
                command_timeout=command_timeout,
                busy_timeout=busy_timeout,
                application_name=application_name,
                echo=echo,
                prepared_statements=prepared_statements,
            )
            self._owns_engine = True
        self._url = self._engine.url
        self._tables = store_tables(table_name)
        self._schema_name: str | None = None  # PostgreSQL's schema of the keys table
        (
            self._table,
            self._batches,
            self._changes,
            self._log,
            self._readers,
            self._audit,
            self._daily,
            self._settings,
            self._once,
            self._webhooks,
            self._deliveries,
        ) = self._tables
        table, batches = self._table, self._batches
        self._columns = tuple(table.c[name] for name in _FIELDS)
        dialect = self._engine.dialect
        self._returning = bool(dialect.update_returning)
        self._sqlite = dialect.name == "sqlite"
        memory = self._sqlite and is_sqlite_memory(self._url)
        # An in-memory SQLite database is one shared connection (StaticPool): take turns.
        self._serial: asyncio.Lock | None = asyncio.Lock() if memory else None
        # Reads run outside any transaction: one statement, one round trip, no BEGIN.
        # (SQLite's driver opens no transaction for a SELECT in the first place.)
        self._read_engine = (
            self._engine
            if self._sqlite
            else self._engine.execution_options(isolation_level="AUTOCOMMIT")
        )
        self._get_stmt = sa.select(*self._columns).where(table.c.id == sa.bindparam("key_id"))

        self._busy_timeout = busy_timeout
        self._pool_timeout = pool_timeout
        # PostgreSQL reads: a pool of asyncpg's own (see `_asyncpg_get`), made on first use
        # on each event loop, from the engine's connection arguments and these settings.
        self._read_pool: tuple[asyncio.AbstractEventLoop, asyncpg.Pool] | None = None
        self._read_pool_lock = asyncio.Lock()
        self._read_pool_options: dict[str, Any] | None = None
        if self._owns_engine and not self._sqlite:
            self._read_pool_options = {
                "min_size": 0,
                "max_size": pool_size,
                "max_inactive_connection_lifetime": pool_recycle,
                "timeout": connect_timeout,
                "command_timeout": command_timeout,
                "server_settings": {"application_name": application_name},
            }
            if not prepared_statements:  # see `make_engine`
                self._read_pool_options["statement_cache_size"] = 0
        self._auto_create = auto_create
        self._setup_lock = asyncio.Lock()
        self._reader: aiosqlite.Connection | None = None
        self._sync_reader: sqlite3.Connection | None = None
        self._reader_lock = asyncio.Lock()
        self._reader_path = self._url.database or ""
        # A file database whose folder is missing: refused before aiosqlite starts a thread
        # for it (a failed aiosqlite connect leaves its thread reporting to a closed loop).
        self._sqlite_folder = (
            os.path.dirname(os.path.abspath(self._reader_path))
            if self._sqlite and not memory and self._reader_path
            else ""
        )
        self._file_ready = False  # the database file made 0600 if it was missing
        self._engine_loop: asyncio.AbstractEventLoop | None = None
        # The hot path: `get` straight on the driver, with this SQL (see the module doc).
        self._direct = ""
        if direct_reads and (self._url.get_driver_name() in ("aiosqlite", "asyncpg")):
            if not self._sqlite:
                self._direct = "asyncpg"
            elif not memory and not self._url.query:
                self._direct = "aiosqlite"
        self._direct_sql = str(self._get_stmt.compile(dialect=dialect))
        # SQLite's direct reads: the last row read of each key, with what it decoded to.
        self._decoded: dict[str, tuple[Sequence[Any], StoredKey]] = {}
        self._memory = memory
        self._notice_channel = notice_channel_name(table_name)
        # `add_usage` records its batch id first; a conflict means "applied before".
        self._claim_batch: sa.Insert = sa.insert(batches)
        if dialect.name == "postgresql":
            self._claim_batch = postgresql.insert(batches).on_conflict_do_nothing(
                index_elements=[batches.c.batch_id]
            )
        elif dialect.name == "sqlite":
            self._claim_batch = sqlite.insert(batches).on_conflict_do_nothing(
                index_elements=[batches.c.batch_id]
            )
        # Daily usage: add to a (key, day, outcome) row, made on first use, for a key that
        # exists (as the counts above): one statement, so the batch's write transaction
        # stays short when the process is busy.
        self._add_daily: sa.TextClause | None = None
        if dialect.name in ("postgresql", "sqlite"):
            quote = dialect.identifier_preparer.format_table
            daily_name, keys_name = quote(self._daily), quote(table)
            # Table names quoted by the dialect; every value is a bound parameter.
            self._add_daily = sa.text(
                f"INSERT INTO {daily_name} (key_id, day, outcome, count) "  # noqa: S608
                "SELECT CAST(:key_id AS VARCHAR(12)), CAST(:day AS VARCHAR(10)), "
                "CAST(:outcome AS VARCHAR(32)), CAST(:count AS BIGINT) "
                f"WHERE EXISTS (SELECT 1 FROM {keys_name} WHERE id = CAST(:key_id AS VARCHAR(12))) "
                "ON CONFLICT (key_id, day, outcome) "
                f"DO UPDATE SET count = {daily_name}.count + excluded.count"
            )
        self._prune_batches = sa.delete(batches).where(
            batches.c.applied_at < sa.bindparam("cutoff", type_=UTCDateTime())
        )
        self._next_prune = 0.0  # time.monotonic() of the next prune; the first batch prunes

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SQLStore:
        return cls(url, **options)

    @property
    def engine(self) -> AsyncEngine:
        """The SQLAlchemy engine the store writes through."""
        return self._engine

    @property
    def table(self) -> sa.Table:
        """The keys table this store uses."""
        return self._table

    @property
    def usage_batches(self) -> sa.Table:
        """The table of applied usage batch ids that goes with `table`."""
        return self._batches

    def __repr__(self) -> str:
        url = self._url.render_as_string(hide_password=True)
        return f"SQLStore(url={url!r}, table={self._table.name!r})"

    # --- plumbing ---------------------------------------------------------------------------

    def _translate(self, exc: Exception) -> Exception:
        """The exception to raise for `exc`: `StoreUnavailable`, `MissingTable` or itself."""
        if is_missing_table(exc):
            return MissingTable(
                f"the table {self._table.name!r} or {self._batches.name!r} does not exist: "
                "run `await store.setup()`, `create_tables()` or your migrations first"
            )
        if is_unavailable(exc):
            return StoreUnavailable(exc, hint=unavailable_hint(exc))
        return exc

    @asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        if self._serial is None:
            yield
            return
        async with self._serial:
            yield

    async def _run(
        self, work: Callable[[AsyncConnection], Awaitable[_T]], *, write: bool = True
    ) -> _T:
        """Run `work` on a pooled connection, committing after it when `write`.

        A connection found dead before the commit (a server restart since it was pooled)
        has invalidated the pool and nothing was applied, so `work` runs once more on a
        fresh connection. Errors that mean "unavailable" become `StoreUnavailable`.
        """
        self._check_folder()
        self._adopt_loop()
        engine = self._engine if write else self._read_engine
        reconnected = created = False
        while True:
            committing = False
            try:
                async with self._turn(), engine.connect() as conn:
                    try:
                        result = await work(conn)
                        if write:
                            committing = True
                            await conn.commit()
                    except (OSError, sqlite3.Error) as exc:
                        # Timed out or failed mid-statement, outside SQLAlchemy's own error
                        # handling: the connection's state is unknown, so discard it.
                        await conn.invalidate(exc)
                        raise
                    return result
            except Exception as exc:
                if (
                    isinstance(exc, sa_exc.DBAPIError)
                    and exc.connection_invalidated
                    and not (reconnected or committing)
                ):
                    reconnected = True
                    continue
                error = self._translate(exc)
                if isinstance(error, MissingTable) and self._auto_create and not created:
                    created = True
                    await self.setup()
                    continue
                raise_translated(error, exc)

    def _adopt_loop(self) -> None:
        """Start a fresh write pool when the store is used on a new event loop.

        asyncpg's connections belong to the loop that opened them: a store first used under
        `asyncio.run` (a key issued at import time, say) and then served by uvicorn on
        another loop would fail every write. The old loop's connections can be neither used
        nor closed any more: they are let go, and the garbage collector closes their sockets.
        """
        loop = asyncio.get_running_loop()
        previous = self._engine_loop
        if previous is loop:
            return
        self._engine_loop = loop
        if previous is None or self._sqlite or not previous.is_closed() or not self._owns_engine:
            return
        self._engine.sync_engine.pool = self._engine.sync_engine.pool.recreate()

    def _check_folder(self) -> None:
        if not self._sqlite_folder:
            return
        if not os.path.isdir(self._sqlite_folder):
            raise StoreUnavailable(
                FileNotFoundError(f"no folder {self._sqlite_folder!r} for the SQLite database")
            )
        if not self._file_ready:
            try:
                create_private_file(self._reader_path)
            except OSError as exc:
                raise StoreUnavailable(exc) from exc
            self._file_ready = True

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
        stored = _raw_stored(row, sqlite=True)
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
        options = self._read_pool_options
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
            return None if row is None else _raw_stored(row, sqlite=False)
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
                return await self._run(self._sqlalchemy_get(key_id), write=False)
            raise_translated(self._translate(exc), exc)
        await greenlet_spawn(connection.close)
        return None if row is None else _raw_stored(row, sqlite=False)

    def _sqlalchemy_get(
        self, key_id: str
    ) -> Callable[[AsyncConnection], Awaitable[StoredKey | None]]:
        async def work(conn: AsyncConnection) -> StoredKey | None:
            row = (await conn.execute(self._get_stmt, {"key_id": key_id})).first()
            if row is None:
                return None
            return StoredKey(record=_record(row), secret_hash=row[13])

        return work

    async def _require(self, conn: AsyncConnection, key_id: str) -> KeyRecord:
        row = (await conn.execute(self._get_stmt, {"key_id": key_id})).first()
        if row is None:
            raise KeyNotFound(key_id)
        return _record(row)

    async def _publish(self, conn: AsyncConnection, notice: str | None) -> None:
        """Publish `notice` in the transaction of `conn`: it commits with the change."""
        if notice is None:
            return
        if self._sqlite:
            await conn.execute(sa.insert(self._changes).values(notice=notice))
        else:
            await conn.execute(sa.select(sa.func.pg_notify(self._notice_channel, notice)))

    def _change_in_one(
        self, update: sa.Update, notice: str | None, event: AuditEvent | None
    ) -> sa.Select[Any]:
        """`update`, the audit entry of `event` and the notice, as one PostgreSQL statement.

        A change holds its key's row lock from its UPDATE to its commit; every statement in
        between is a round trip, and on a loaded host each one waits for the client and the
        server to be scheduled, while usage flushes queue behind the lock. In one statement
        (data-modifying CTEs), the change costs the transaction's BEGIN, this, and COMMIT.
        The audit entry and the notice are made only when the UPDATE changed the row, as
        in the statements' usual order; when it did not, the caller reads the record and
        publishes the notice on its own. A notice is delivered at commit, whenever it is
        sent in the transaction.
        """
        changed = update.returning(*self._columns).cte("changed")
        selected: list[Any] = list(changed.c)
        if notice is not None:
            selected.append(sa.func.pg_notify(self._notice_channel, notice))
        statement = sa.select(*selected)
        if event is not None:
            audit = self._audit
            values = {
                "at": event.time,
                "key_id": event.key_id,
                "workspace": event.workspace,
                "action": event.action,
                "actor": event.actor,
                "changes": json.dumps(dict(event.changes), separators=(",", ":")),
            }
            logged = (
                sa.insert(audit)
                .from_select(
                    list(values),
                    sa.select(
                        *(
                            sa.literal(value, type_=audit.c[name].type).label(name)
                            for name, value in values.items()
                        )
                    ).select_from(changed),
                )
                .cte("logged")
            )
            statement = statement.add_cte(logged)
        return statement

    async def _record_event(self, conn: AsyncConnection, event: AuditEvent | None) -> None:
        """Append `event` to the audit trail in the transaction of `conn`."""
        if event is None:
            return
        await conn.execute(
            sa.insert(self._audit).values(
                at=event.time,
                key_id=event.key_id,
                workspace=event.workspace,
                action=event.action,
                actor=event.actor,
                changes=json.dumps(dict(event.changes), separators=(",", ":")),
            )
        )

    async def _update_or_current(
        self,
        key_id: str,
        update: sa.Update | None,
        notice: str | None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        """Run a conditional UPDATE of one key; return its record afterwards either way.

        `event` is appended to the audit trail in the same transaction if the UPDATE
        changed the row, and only then.
        """

        folded = update is not None and self._returning and not self._sqlite

        async def work(conn: AsyncConnection) -> KeyRecord:
            record: KeyRecord | None = None
            published = False
            if update is not None:
                if folded:
                    # One round trip: the change, its audit entry and its notice.
                    statement = self._change_in_one(update, notice, event)
                    row = (await conn.execute(statement)).first()
                    if row is not None:
                        record = _record(row)
                        published = True
                elif self._returning:
                    row = (await conn.execute(update.returning(*self._columns))).first()
                    if row is not None:
                        record = _record(row)
                        await self._record_event(conn, event)
                else:  # pragma: no cover - SQLite < 3.35
                    if (await conn.execute(update)).rowcount:
                        await self._record_event(conn, event)
            if record is None:
                record = await self._require(conn, key_id)
            if not published:
                await self._publish(conn, notice)
            return record

        return await self._run(work)

    # --- KeyStore ---------------------------------------------------------------------------

    def channel(self) -> Channel | None:
        """The change log on SQLite, LISTEN/NOTIFY on PostgreSQL (see `apikeys.stores.contract`).

        None for an in-memory SQLite database, which no other process can share.
        """
        if self._sqlite:
            if self._memory or not self._reader_path:
                return None
            return SQLiteChannel(
                self._reader_path,
                changes_table=self._changes.name,
                log_table=self._log.name,
                keys_table=self._table.name,
                triggers=trigger_names(self._table, "sqlite"),
                readers_table=self._readers.name,
                busy_timeout=self._busy_timeout,
                prepare=self.setup,
            )
        args, kwargs = self._engine.dialect.create_connect_args(self._url)
        options = self._read_pool_options or {}
        for name in ("timeout", "command_timeout", "server_settings", "statement_cache_size"):
            if name in options:
                kwargs[name] = options[name]
        return PostgresChannel(
            tuple(args),
            dict(kwargs),
            table_name=self._table.name,
            changes_table=self._changes.name,
            log_table=self._log.name,
            readers_table=self._readers.name,
            prepare=self.setup,
            locate=self._keys_schema,
            # Prepared statements off means a pooler in transaction mode: no LISTEN there.
            listen=options.get("statement_cache_size") != 0,
        )

    def webhooks(self) -> WebhookStore | None:
        """The webhook tables (`apikeys.stores.sql.webhooks`); None for an in-memory database."""
        if self._sqlite and self._memory:
            return None
        from apikeys.stores.sql.webhooks import SQLWebhooks

        return SQLWebhooks(self._run, self._engine.dialect.name, self._table.name)

    async def _keys_schema(self) -> str:
        """The PostgreSQL schema the keys table is in, as this store's connections see it
        (the tables are made first when they are missing)."""

        if self._schema_name is not None:
            return self._schema_name  # found when the tables were made

        async def work(conn: AsyncConnection) -> str:
            found = await conn.run_sync(lambda sync: table_schema(sync, self._table))
            return found

        try:
            self._schema_name = await self._run(work, write=False)
        except sa_exc.NoResultFound:
            await self.setup()
            if self._schema_name is None:  # pragma: no cover - setup finds it
                self._schema_name = await self._run(work, write=False)
        return self._schema_name

    def _create_schema(self, connection: sa.Connection) -> None:
        create_tables_on(connection, self._tables)
        install_change_log(connection, self._table, self._changes, self._log)
        if connection.dialect.name == "postgresql":
            self._schema_name = table_schema(connection, self._table)

    async def setup(self) -> None:
        self._check_folder()
        self._adopt_loop()
        try:
            async with self._setup_lock, self._turn():
                await create_concurrently(self._engine, self._create_schema)
                if self._engine.dialect.name == "postgresql":
                    await self._check_replication()
        except Exception as exc:
            raise_translated(self._translate(exc), exc)

    async def _check_replication(self) -> None:
        """Log a warning when a failover could lose a change (CONTRACT section 15)."""
        async with self._engine.connect() as conn:
            risk = await conn.run_sync(replication_risk)
        if risk is not None:
            logger.warning("apikeys: %s", risk)

    async def claim_setting(
        self, name: str, value: str, *, replacing: Collection[str] = ()
    ) -> str | None:
        settings = self._settings
        where = settings.c.name == name
        if self._sqlite:
            add: sa.Insert = sqlite.insert(settings).on_conflict_do_nothing()
        elif self._engine.dialect.name == "postgresql":
            add = postgresql.insert(settings).on_conflict_do_nothing()
        else:  # pragma: no cover - other dialects: a concurrent first claim may fail once
            add = sa.insert(settings)

        async def work(conn: AsyncConnection) -> str | None:
            # A value that stands is only read: every process start claims its setting, and
            # a write there would wait behind any lock on the table (CONTRACT section 15).
            found = (await conn.execute(sa.select(settings.c.value).where(where))).scalar()
            if found is not None and str(found) not in replacing:
                return str(found)
            # Replace a replaceable value, add one where none is, then read what is there:
            # one transaction, and a concurrent first claim loses to the one that committed.
            if replacing:
                await conn.execute(
                    sa.update(settings)
                    .where(where, settings.c.value.in_(list(replacing)))
                    .values(value=value)
                )
            await conn.execute(add.values(name=name, value=value))
            recorded = (await conn.execute(sa.select(settings.c.value).where(where))).scalar()
            return None if recorded is None else str(recorded)

        try:
            return await self._run(work)
        except MissingTable:
            return None  # migrations that predate the settings table: no check, as before

    async def put_once(self, token: str, value: str, ttl: timedelta) -> None:
        now = datetime.now(UTC)
        await self._run(
            lambda conn: sql_once.put_once(
                conn, self._once, token, value, now=now, expires_at=now + ttl
            )
        )

    async def take_once(self, token: str) -> str | None:
        now = datetime.now(UTC)
        return await self._run(lambda conn: sql_once.take_once(conn, self._once, token, now=now))

    async def insert(self, stored: StoredKey, *, event: AuditEvent | None = None) -> None:
        record = stored.record
        values = {
            "id": record.id,
            "name": record.name,
            "workspace": record.workspace,
            "prefix": record.prefix,
            "access": record.access,
            "scopes": record.scopes,
            "state": record.state,
            "rate_limit": record.rate_limit,
            "created_at": record.created_at,
            "expires_at": record.expires_at,
            "last_used_at": record.last_used_at,
            "request_count": record.request_count,
            "revoked_at": record.revoked_at,
            "secret_hash": stored.secret_hash,
            "replaces": record.replaces,
            "replaced_by": record.replaced_by,
            "owner": record.owner,
            "metadata": record.metadata,
            "allowed_ips": record.allowed_ips,
            "credits": record.credits,
            "credit_refill": record.credit_refill,
            "credits_refilled_at": record.credits_refilled_at,
        }
        statement = sa.insert(self._table).values(values)

        async def work(conn: AsyncConnection) -> None:
            try:
                await conn.execute(statement)
            except sa_exc.IntegrityError as exc:
                if is_duplicate(exc):
                    raise DuplicateKeyId(record.id) from None
                raise
            await self._record_event(conn, event)

        await self._run(work)

    async def get(self, key_id: str) -> StoredKey | None:
        try:
            return await self._get(key_id)
        except MissingTable:
            if not self._auto_create:
                raise
        await self.setup()
        return await self._get(key_id)

    async def _get(self, key_id: str) -> StoredKey | None:
        if self._direct == "aiosqlite":
            return await self._sqlite_get(key_id)
        if self._direct == "asyncpg":
            return await self._asyncpg_get(key_id)
        return await self._run(self._sqlalchemy_get(key_id), write=False)

    async def list(self, workspace: str | None = None) -> list[KeyRecord]:
        table = self._table
        statement = sa.select(*self._columns).order_by(table.c.created_at, table.c.id)
        if workspace is not None:
            statement = statement.where(table.c.workspace == workspace)

        async def work(conn: AsyncConnection) -> list[KeyRecord]:
            return [_record(row) for row in await conn.execute(statement)]

        return await self._run(work, write=False)

    async def list_page(
        self, where: KeyFilter, *, start: Position | None, limit: int, now: datetime
    ) -> builtins.list[KeyRecord]:
        statement = page_statement(
            self._table, self._columns, where, start=start, limit=limit, now=now
        )

        async def work(conn: AsyncConnection) -> builtins.list[KeyRecord]:
            return [_record(row) for row in await conn.execute(statement)]

        return await self._run(work, write=False)

    async def set_state(
        self,
        key_id: str,
        state: StoredState,
        *,
        allowed_from: Collection[StoredState],
        at: datetime,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        table = self._table
        sources = sorted(set(allowed_from) - {state})
        update: sa.Update | None = None
        if sources:
            values: dict[str, Any] = {"state": state}
            if state == REVOKED:
                values["revoked_at"] = at
            update = (
                sa.update(table)
                .where(table.c.id == key_id, table.c.state.in_(sources))
                .values(values)
            )
        return await self._update_or_current(key_id, update, notice, event)

    async def shorten_expiry(
        self,
        key_id: str,
        expires_at: datetime,
        *,
        replaced_by: str | None = None,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        table = self._table
        later = sa.or_(table.c.expires_at.is_(None), table.c.expires_at > expires_at)
        if replaced_by is None:
            update = (
                sa.update(table)
                .where(table.c.id == key_id, table.c.state != REVOKED, later)
                .values(expires_at=expires_at)
            )
        else:
            # Two rolls at once: the first to link the key wins, the other changes nothing.
            free = sa.or_(table.c.replaced_by.is_(None), table.c.replaced_by == replaced_by)
            update = (
                sa.update(table)
                .where(table.c.id == key_id, table.c.state != REVOKED, free)
                .values(
                    expires_at=sa.case((later, expires_at), else_=table.c.expires_at),
                    replaced_by=replaced_by,
                )
            )
        return await self._update_or_current(key_id, update, notice, event)

    async def update(
        self,
        key_id: str,
        changes: Mapping[str, Any],
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        table = self._table
        update = (
            sa.update(table)
            .where(table.c.id == key_id, table.c.state != REVOKED)
            .values(dict(changes))
            if changes
            else None
        )
        return await self._update_or_current(key_id, update, notice, event)

    async def spend_credits(
        self, key_id: str, cost: int, *, refill: tuple[int, datetime] | None = None
    ) -> int | None:
        table = self._table
        credits, refilled_at = table.c.credits, table.c.credits_refilled_at
        if refill is None:
            due: sa.ColumnElement[bool] = sa.false()
        else:
            due = sa.or_(refilled_at.is_(None), refilled_at < refill[1])
        amount = refill[0] if refill is not None else 0
        start = refill[1] if refill is not None else None

        def spend(target: str, followed: bool) -> sa.Update:
            # Only a key no roll has linked yet holds its balance (`replaced_by IS NULL`,
            # checked again after waiting for a roll that locked the row).
            conditions = [table.c.id == target, table.c.replaced_by.is_(None)]
            if not followed:
                conditions.append(table.c.state != REVOKED)
            return (
                sa.update(table)
                .where(
                    *conditions,
                    credits.is_not(None),
                    sa.or_(
                        sa.and_(due, sa.literal(amount) >= cost), sa.and_(~due, credits >= cost)
                    ),
                )
                .values(
                    credits=sa.case((due, amount - cost), else_=credits - cost),
                    credits_refilled_at=sa.case((due, start), else_=refilled_at),
                )
                .returning(credits)
            )

        async def work(conn: AsyncConnection) -> int | None:
            target, followed = key_id, False
            for _ in range(MAX_ROLL_HOPS):
                row = (await conn.execute(spend(target, followed))).first()
                if row is not None:
                    return int(row[0])
                link = (
                    await conn.execute(
                        sa.select(table.c.state, table.c.replaced_by).where(table.c.id == target)
                    )
                ).first()
                if link is None or (link[0] == REVOKED and not followed):
                    return None
                if link[1] is None:
                    if refill is not None:
                        # Too few left even after a refill: still start the new period.
                        await conn.execute(
                            sa.update(table)
                            .where(
                                table.c.id == target,
                                table.c.replaced_by.is_(None),
                                credits.is_not(None),
                                due,
                            )
                            .values(credits=amount, credits_refilled_at=start)
                        )
                    return None
                # Rolled: the pair's balance is the successor's.
                target, followed = link[1], True
            return None

        return await self._run(work)

    async def replace_hash(
        self,
        key_id: str,
        old_hash: str,
        new_hash: str,
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> bool:
        table = self._table
        update = (
            sa.update(table)
            .where(table.c.id == key_id, table.c.secret_hash == old_hash)
            .values(secret_hash=new_hash)
        )

        async def work(conn: AsyncConnection) -> bool:
            swapped = bool((await conn.execute(update)).rowcount == 1)
            if swapped:
                await self._record_event(conn, event)
                await self._publish(conn, notice)
            return swapped

        return await self._run(work)

    async def audit(
        self,
        *,
        workspace: str | None = None,
        key_id: str | None = None,
        since: datetime | None = None,
        limit: int = 1000,
    ) -> builtins.list[AuditEvent]:
        audit = self._audit
        statement = sa.select(
            audit.c.at,
            audit.c.key_id,
            audit.c.workspace,
            audit.c.action,
            audit.c.actor,
            audit.c.changes,
        )
        if workspace is not None:
            statement = statement.where(audit.c.workspace == workspace)
        if key_id is not None:
            statement = statement.where(audit.c.key_id == key_id)
        if since is not None:
            statement = statement.where(audit.c.at >= since)
        # The newest `limit`, given back oldest first.
        statement = statement.order_by(audit.c.seq.desc()).limit(limit)

        async def work(conn: AsyncConnection) -> builtins.list[AuditEvent]:
            rows = (await conn.execute(statement)).all()
            return [
                AuditEvent(
                    time=row[0],
                    key_id=row[1],
                    workspace=row[2],
                    action=row[3],
                    actor=row[4],
                    changes=json.loads(row[5]),
                )
                for row in reversed(rows)
            ]

        return await self._run(work, write=False)

    async def add_usage(self, usage: Mapping[str, UsageDelta], *, batch_id: str) -> None:
        """One transaction: record `batch_id`, then add the increments.

        The batch id goes in first. If it is there already (a row with that primary key,
        committed by an earlier send, or by a concurrent one that PostgreSQL makes this one
        wait for), the batch was applied: the transaction is rolled back and nothing else
        happens. Otherwise the increments follow in the same transaction, so the id is
        recorded if and only if the batch is applied.
        """
        # Sorted by id, so concurrent batches lock rows in one order and cannot deadlock.
        params = [
            {"b_id": key_id, "b_count": delta.count, "b_last": delta.last_used_at}
            for key_id, delta in sorted(usage.items())
            if delta.count
        ]
        daily_rows = [
            {"key_id": key_id, "day": day, "outcome": outcome, "count": count}
            for key_id, delta in sorted(usage.items())
            for (day, outcome), count in sorted(delta.daily.items())
            if count
        ]
        if not params and not daily_rows:
            return
        table = self._table
        last = sa.bindparam("b_last", type_=UTCDateTime())
        statement = (
            sa.update(table)
            .where(table.c.id == sa.bindparam("b_id"))
            .values(
                request_count=table.c.request_count
                + sa.bindparam("b_count", type_=sa.BigInteger()),
                last_used_at=sa.case(
                    (
                        sa.or_(table.c.last_used_at.is_(None), table.c.last_used_at < last),
                        last,
                    ),
                    else_=table.c.last_used_at,
                ),
            )
        )
        claim = {"batch_id": batch_id, "applied_at": datetime.now(UTC)}

        async def work(conn: AsyncConnection) -> None:
            try:
                claimed = (await conn.execute(self._claim_batch, claim)).rowcount != 0
            except sa_exc.IntegrityError as exc:  # a dialect without ON CONFLICT DO NOTHING
                if not is_duplicate(exc):
                    raise
                claimed = False
            if not claimed:
                await conn.rollback()  # applied before: nothing to do
                return
            if daily_rows:
                await self._add_daily_usage(conn, daily_rows)
            # The keys' rows last, right before the commit: a change to a key (a revoke)
            # waits for their locks, and every statement between the lock and the commit
            # would be one more round trip of this process (slow on a loaded host) for it
            # to wait through.
            if params:
                await conn.execute(statement, params)

        await self._run(work)
        await self._maybe_prune_batches()

    async def _add_daily_usage(
        self, conn: AsyncConnection, rows: builtins.list[dict[str, Any]]
    ) -> None:
        if self._add_daily is not None:
            await conn.execute(self._add_daily, rows)
            return
        daily, table = self._daily, self._table  # pragma: no cover - no ON CONFLICT
        for row in rows:  # pragma: no cover
            known = await conn.execute(sa.select(table.c.id).where(table.c.id == row["key_id"]))
            if known.first() is None:
                continue  # an unknown id adds nothing
            key = (daily.c.key_id == row["key_id"]) & (daily.c.day == row["day"])
            key &= daily.c.outcome == row["outcome"]
            updated = await conn.execute(
                sa.update(daily).where(key).values(count=daily.c.count + row["count"])
            )
            if not updated.rowcount:
                await conn.execute(sa.insert(daily).values(row))

    async def usage_history(self, key_id: str, since: date) -> builtins.list[DailyUsage]:
        daily = self._daily
        statement = (
            sa.select(daily.c.day, daily.c.outcome, daily.c.count)
            .where(daily.c.key_id == key_id, daily.c.day >= since.isoformat())
            .order_by(daily.c.day)
        )

        async def work(conn: AsyncConnection) -> builtins.list[DailyUsage]:
            return _days([(row[0], row[1], int(row[2])) for row in await conn.execute(statement)])

        return await self._run(work, write=False)

    async def _maybe_prune_batches(self) -> None:
        """Delete batch ids older than the retention window, at most once a minute.

        Its own short transaction after the batch's: housekeeping that may fail (it is
        tried again a minute later) without failing the batch, which is applied already.
        """
        now = time.monotonic()
        if now < self._next_prune:
            return
        self._next_prune = now + _PRUNE_INTERVAL
        cutoff = datetime.now(UTC) - USAGE_BATCH_RETENTION

        async def work(conn: AsyncConnection) -> None:
            await conn.execute(self._prune_batches, {"cutoff": cutoff})

        try:
            await self._run(work)
        except Exception as exc:
            logger.debug("apikeys: pruning old usage batch ids failed: %s", type(exc).__name__)

    async def aclose(self) -> None:
        await self._drop_reader()
        await self._close_read_pool()
        if self._owns_engine:
            await self._engine.dispose()
