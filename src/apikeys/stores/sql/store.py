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

The hot path, `get`, is one SELECT by primary key on the bare driver (`reads.py`); every
write goes through SQLAlchemy Core.

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
import logging
import os
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from datetime import date, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from apikeys.errors import DuplicateKeyId, KeyNotFound, StoreUnavailable
from apikeys.lifecycle import TRANSITIONS
from apikeys.listing import KeyFilter, Position
from apikeys.stores.contract import Channel, KeyStore
from apikeys.stores.sql import once as sql_once
from apikeys.stores.sql.changes import ChangeWriter, audit_statement, events_of
from apikeys.stores.sql.credits import spend_credits
from apikeys.stores.sql.engine import (
    MissingTable,
    async_url,
    is_duplicate,
    is_missing_table,
    is_sqlite_memory,
    is_unavailable,
    raise_translated,
    replication_risk,
    unavailable_hint,
)
from apikeys.stores.sql.identities import SQLIdentities
from apikeys.stores.sql.listing import page_statement
from apikeys.stores.sql.log import (
    install_change_log,
    notice_channel_name,
    table_schema,
    trigger_names,
)
from apikeys.stores.sql.postgres_channel import PostgresChannel
from apikeys.stores.sql.reads import DirectReads, direct_mode, open_engine
from apikeys.stores.sql.rows import FIELDS, SECRET_HASH, record_from_row, row_values
from apikeys.stores.sql.schema import (
    DEFAULT_TABLE_NAME,
    UTCDateTime,
    audit_table,
    changes_table,
    create_concurrently,
    create_private_file,
    create_tables_on,
    keys_table,
    metadata,
    readers_table,
    store_tables,
    usage_batches_table,
)
from apikeys.stores.sql.sqlite_channel import SQLiteChannel
from apikeys.stores.sql.usage import SQLUsage
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
        self._engine, pool_options = open_engine(
            url,
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_timeout=pool_timeout,
            pool_recycle=pool_recycle,
            pool_pre_ping=pool_pre_ping,
            prepared_statements=prepared_statements,
            connect_timeout=connect_timeout,
            command_timeout=command_timeout,
            busy_timeout=busy_timeout,
            application_name=application_name,
            echo=echo,
        )
        self._owns_engine = not isinstance(url, AsyncEngine)
        self._url = self._engine.url
        self._tables = store_tables(table_name)
        self._schema_name: str | None = None  # PostgreSQL's schema of the keys table
        self._table, self._batches, self._changes, self._log, self._readers = self._tables[:5]
        self._audit, self._daily, self._settings, self._once = self._tables[5:9]
        self._identities_table = self._tables[11]
        self._one_time = sql_once.OneTimeValues(self._run, self._once)
        table, batches = self._table, self._batches
        self._columns = tuple(table.c[name] for name in FIELDS)
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
        self._auto_create = auto_create
        self._setup_lock = asyncio.Lock()
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
        # The hot path: `get` straight on the driver (see the module doc and `reads.py`).
        self._reads = DirectReads(
            self._engine,
            mode=direct_mode(self._url, direct_reads, memory),
            sql=str(self._get_stmt.compile(dialect=dialect)),
            path=self._reader_path,
            busy_timeout=busy_timeout,
            pool_timeout=pool_timeout,
            pool_options=pool_options,
            check_folder=self._check_folder,
            translate=self._translate,
            fallback=self._sqlalchemy_read,
        )
        self._memory = memory
        self._notice_channel = notice_channel_name(table_name)
        self._writer = ChangeWriter(
            sqlite=self._sqlite,
            columns=self._columns,
            audit=self._audit,
            changes=self._changes,
            notice_channel=self._notice_channel,
        )
        self._usage = SQLUsage(self._run, dialect, table, batches, self._daily)
        self._identities = SQLIdentities(
            self._run, self._identities_table, self._writer, keys=self._table
        )

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

    def _sqlalchemy_get(
        self, key_id: str
    ) -> Callable[[AsyncConnection], Awaitable[StoredKey | None]]:
        async def work(conn: AsyncConnection) -> StoredKey | None:
            row = (await conn.execute(self._get_stmt, {"key_id": key_id})).first()
            if row is None:
                return None
            return StoredKey(record=record_from_row(row), secret_hash=row[SECRET_HASH])

        return work

    async def _require(self, conn: AsyncConnection, key_id: str) -> KeyRecord:
        row = (await conn.execute(self._get_stmt, {"key_id": key_id})).first()
        if row is None:
            raise KeyNotFound(key_id)
        return record_from_row(row)

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
                    statement = self._writer.in_one(update, notice, event)
                    row = (await conn.execute(statement)).first()
                    if row is not None:
                        record = record_from_row(row)
                        published = True
                elif self._returning:
                    row = (await conn.execute(update.returning(*self._columns))).first()
                    if row is not None:
                        record = record_from_row(row)
                        await self._writer.record(conn, event)
                else:  # pragma: no cover - SQLite < 3.35
                    if (await conn.execute(update)).rowcount:
                        await self._writer.record(conn, event)
            if record is None:
                record = await self._require(conn, key_id)
            if not published:
                await self._writer.publish(conn, notice)
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
                identity_triggers=trigger_names(self._identities_table, "sqlite"),
                readers_table=self._readers.name,
                busy_timeout=self._busy_timeout,
                prepare=self.setup,
            )
        args, kwargs = self._engine.dialect.create_connect_args(self._url)
        options = self._reads.pool_options or {}
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

    def identities(self) -> SQLIdentities:
        """The identities table (`apikeys.stores.sql.identities`)."""
        return self._identities

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
        install_change_log(
            connection, self._table, self._changes, self._log, self._identities_table
        )
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
        settings, dialect = self._settings, self._engine.dialect.name

        async def work(conn: AsyncConnection) -> str | None:
            return await sql_once.claim_setting(conn, settings, dialect, name, value, replacing)

        try:
            return await self._run(work)
        except MissingTable:
            return None  # migrations that predate the settings table: no check, as before

    async def put_once(self, token: str, value: str, ttl: timedelta) -> None:
        await self._one_time.put(token, value, ttl, only_new=False)

    async def take_once(self, token: str) -> str | None:
        return await self._one_time.take(token)

    async def peek_once(self, token: str) -> str | None:
        return await self._one_time.peek(token)

    async def put_once_if_absent(self, token: str, value: str, ttl: timedelta) -> bool:
        return await self._one_time.put(token, value, ttl, only_new=True)

    async def replace_once(self, token: str, old: str, new: str | None, ttl: timedelta) -> bool:
        return await self._one_time.replace(token, old, new, ttl)

    async def insert(self, stored: StoredKey, *, event: AuditEvent | None = None) -> None:
        record = stored.record
        values = row_values(stored)
        statement = sa.insert(self._table).values(values)

        async def work(conn: AsyncConnection) -> None:
            try:
                await conn.execute(statement)
            except sa_exc.IntegrityError as exc:
                if is_duplicate(exc):
                    raise DuplicateKeyId(record.id) from None
                raise
            await self._writer.record(conn, event)

        await self._run(work)

    async def get(self, key_id: str) -> StoredKey | None:
        if "\x00" in key_id:  # in no row: PostgreSQL refuses NUL in text (an error, not None)
            return None
        try:
            return await self._get(key_id)
        except MissingTable:
            if not self._auto_create:
                raise
        await self.setup()
        return await self._get(key_id)

    async def _get(self, key_id: str) -> StoredKey | None:
        if self._reads.mode:
            return await self._reads.get(key_id)
        return await self._sqlalchemy_read(key_id)

    async def _sqlalchemy_read(self, key_id: str) -> StoredKey | None:
        return await self._run(self._sqlalchemy_get(key_id), write=False)

    async def list(self, workspace: str | None = None) -> list[KeyRecord]:
        table = self._table
        statement = sa.select(*self._columns).order_by(table.c.created_at, table.c.id)
        if workspace is not None:
            statement = statement.where(table.c.workspace == workspace)

        async def work(conn: AsyncConnection) -> list[KeyRecord]:
            return [record_from_row(row) for row in await conn.execute(statement)]

        return await self._run(work, write=False)

    async def list_page(
        self, where: KeyFilter, *, start: Position | None, limit: int, now: datetime
    ) -> builtins.list[KeyRecord]:
        statement = page_statement(
            self._table, self._columns, where, start=start, limit=limit, now=now
        )

        async def work(conn: AsyncConnection) -> builtins.list[KeyRecord]:
            return [record_from_row(row) for row in await conn.execute(statement)]

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
        editable = table.c.state.in_(TRANSITIONS["update"].sources)
        later = sa.or_(table.c.expires_at.is_(None), table.c.expires_at > expires_at)
        if replaced_by is None:
            update = (
                sa.update(table)
                .where(table.c.id == key_id, editable, later)
                .values(expires_at=expires_at)
            )
        else:
            # Two rolls at once: the first to link the key wins, the other changes nothing.
            free = sa.or_(table.c.replaced_by.is_(None), table.c.replaced_by == replaced_by)
            update = (
                sa.update(table)
                .where(table.c.id == key_id, editable, free)
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
        editable = table.c.state.in_(TRANSITIONS["update"].sources)
        update = (
            sa.update(table).where(table.c.id == key_id, editable).values(dict(changes))
            if changes
            else None
        )
        return await self._update_or_current(key_id, update, notice, event)

    async def spend_credits(
        self, key_id: str, cost: int, *, refill: tuple[int, datetime] | None = None
    ) -> int | None:
        table = self._table

        async def work(conn: AsyncConnection) -> int | None:
            return await spend_credits(conn, table, key_id, cost, refill)

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
                await self._writer.record(conn, event)
                await self._writer.publish(conn, notice)
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
        statement = audit_statement(self._audit, workspace, key_id, since, limit)

        async def work(conn: AsyncConnection) -> builtins.list[AuditEvent]:
            return events_of((await conn.execute(statement)).all())

        return await self._run(work, write=False)

    async def add_usage(self, usage: Mapping[str, UsageDelta], *, batch_id: str) -> None:
        """One transaction: record `batch_id`, then add the increments (see `SQLUsage.add`)."""
        await self._usage.add(usage, batch_id=batch_id)

    async def usage_history(self, key_id: str, since: date) -> builtins.list[DailyUsage]:
        return await self._usage.history(key_id, since)

    async def aclose(self) -> None:
        await self._reads.aclose()
        if self._owns_engine:
            await self._engine.dispose()
