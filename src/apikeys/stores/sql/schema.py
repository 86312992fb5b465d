"""The SQL store's schema: its tables on `metadata`, and creating them safely.

`keys_table(name)` puts the keys table and the tables that go with it on `metadata` (or a
`MetaData` of yours): the applied usage batches, the change log (the key cache's and the
webhooks' outbox), the registry of processes that cache keys, the audit trail, daily usage,
settings, and the webhooks' endpoints and deliveries. Add `metadata` to your Alembic
`target_metadata`, or let `SQLStore.setup()` / `create_tables()` create what is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from apikeys.errors import ConfigurationError, StoreUnavailable
from apikeys.identities import IDENTITY_FIELDS
from apikeys.policies import dump_metadata, load_metadata
from apikeys.types import RECORD_FIELDS, KeyField, Kind

__all__ = [
    "DEFAULT_TABLE_NAME",
    "SCHEMA_LOCK",
    "SCHEMA_TURN_WAIT",
    "UTCDateTime",
    "changes_table",
    "create_concurrently",
    "create_private_file",
    "create_tables_on",
    "create_tables_with",
    "identities_table",
    "keys_table",
    "load_scopes",
    "log_table",
    "metadata",
    "one_time_table",
    "readers_table",
    "record_columns",
    "settings_table",
    "store_tables",
    "usage_batches_table",
    "webhook_deliveries_table",
    "webhooks_table",
]

DEFAULT_TABLE_NAME: Final = "apikeys_keys"

metadata = sa.MetaData()
"""The metadata apikeys' tables live on: add it to your Alembic `target_metadata`."""


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend.

    PostgreSQL stores `timestamptz`. SQLite has no timezone support, so the value is stored
    as naive UTC text (`YYYY-MM-DD HH:MM:SS.ffffff`, which sorts in time order) and comes
    back with `tzinfo=UTC`. A naive datetime given to the store is taken to be in UTC.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        value = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        if value.tzinfo is UTC:
            return value
        return value.astimezone(UTC)


class _Scopes(sa.types.TypeDecorator[tuple[str, ...]]):
    """A tuple of scope names, stored as a JSON array in a text column."""

    impl = sa.Text()
    cache_ok = True

    def process_bind_param(self, value: Sequence[str] | None, dialect: sa.Dialect) -> str | None:
        if value is None:
            return None
        return json.dumps(list(value), separators=(",", ":"))

    def process_result_value(self, value: str | None, dialect: sa.Dialect) -> tuple[str, ...]:
        return load_scopes(value)


class _Metadata(sa.types.TypeDecorator[dict[str, Any]]):
    """A key's metadata, a JSON object kept as text (None when empty)."""

    impl = sa.Text()
    cache_ok = True

    def process_bind_param(
        self, value: Mapping[str, Any] | None, dialect: sa.Dialect
    ) -> str | None:
        return dump_metadata(value) if value else None

    def process_result_value(self, value: str | None, dialect: sa.Dialect) -> dict[str, Any]:
        return load_metadata(value)


@functools.lru_cache(maxsize=4096)
def load_scopes(value: str | None) -> tuple[str, ...]:
    """The scopes (or addresses) a store kept as JSON text, as a tuple.

    Kept for the 4,096 texts read last: many keys share their scopes, and a key read from
    the store again (a miss of the key cache, or a store without one) costs no parse.
    """
    if not value:
        return ()
    return tuple(json.loads(value))


def _column_type(field: KeyField) -> sa.types.TypeEngine[Any]:
    if field.kind is Kind.TEXT:
        return sa.String(field.size)
    return _COLUMN_TYPES[field.kind]()


_COLUMN_TYPES: Final[Mapping[Kind, Callable[[], sa.types.TypeEngine[Any]]]] = {
    Kind.NAMES: _Scopes,
    Kind.TIME: UTCDateTime,
    Kind.COUNT: sa.BigInteger,
    Kind.OBJECT: _Metadata,
}


def _column(field: KeyField) -> sa.Column[Any]:
    if field.name == "id":
        # Ids sort by code point everywhere (as in the memory store), whatever the
        # database's default collation: PostgreSQL's "C"; SQLite's BINARY already is.
        return sa.Column(
            "id",
            sa.String(field.size).with_variant(sa.String(field.size, collation="C"), "postgresql"),
            primary_key=True,
        )
    # A field always stored that has a default (a count) has it in the database too.
    server_default = str(field.default) if field.required and field.has_default else None
    return sa.Column(
        field.name,
        _column_type(field),
        nullable=not field.required,
        server_default=server_default,
    )


def record_columns() -> list[sa.Column[Any]]:
    """The keys table's columns, one per field of `RECORD_FIELDS` in its order, and the
    secret's hash after `revoked_at`, where it has always been (a field added later is a
    column added at the end, as `ALTER TABLE … ADD COLUMN` puts it)."""
    columns = [_column(field) for field in RECORD_FIELDS]
    at = next(i for i, column in enumerate(columns) if column.name == "revoked_at") + 1
    columns.insert(at, sa.Column("secret_hash", sa.Text(), nullable=False))
    return columns


def keys_table(name: str = DEFAULT_TABLE_NAME, meta: sa.MetaData | None = None) -> sa.Table:
    """The keys table called `name` on `meta` (the module's `metadata` by default).

    It also puts the store's other tables, `usage_batches_table(name)`,
    `changes_table(name)` and `readers_table(name)`, on `meta`, so that migrations generated
    from `meta` create them all. Calling it again with the same name returns the same `Table`.
    """
    meta = metadata if meta is None else meta
    usage_batches_table(name, meta)
    changes_table(name, meta)
    log_table(name, meta)
    readers_table(name, meta)
    audit_table(name, meta)
    usage_daily_table(name, meta)
    settings_table(name, meta)
    one_time_table(name, meta)
    webhooks_table(name, meta)
    webhook_deliveries_table(name, meta)
    identities_table(name, meta)
    existing = meta.tables.get(name)
    if existing is not None:
        return existing
    return sa.Table(
        name,
        meta,
        *record_columns(),
        # Listing a workspace, oldest first, reads this index in order.
        sa.Index(f"ix_{name}_workspace_created", "workspace", "created_at", "id"),
        # The webhooks' minute look: keys expiring within a week, and keys with a refill.
        sa.Index(f"ix_{name}_expires_at", "expires_at"),
        sa.Index(
            f"ix_{name}_refilled",
            "credit_refill",
            sqlite_where=sa.text("credit_refill IS NOT NULL"),
            postgresql_where=sa.text("credit_refill IS NOT NULL"),
        ),
    )


def _companion(
    keys_table_name: str,
    suffix: str,
    meta: sa.MetaData | None,
    items: Callable[[str], tuple[sa.schema.SchemaItem, ...]],
    **options: Any,
) -> sa.Table:
    """The table `<keys_table_name>_<suffix>` on `meta`: made once, the same `Table` after."""
    meta = metadata if meta is None else meta
    name = f"{keys_table_name}_{suffix}"
    existing = meta.tables.get(name)
    if existing is not None:
        return existing
    return sa.Table(name, meta, *items(name), **options)


def identities_table(
    keys_table_name: str = DEFAULT_TABLE_NAME, meta: sa.MetaData | None = None
) -> sa.Table:
    """`<keys table>_identities`: one row per identity (`apikeys.identities`), a column per
    field of `IDENTITY_FIELDS` as the keys table has one per field of a key. Triggers log
    its changes in the keys' change log, named `i:<id>` (`apikeys.stores.sql.log`)."""
    return _companion(
        keys_table_name,
        "identities",
        meta,
        lambda name: (
            *(_column(field) for field in IDENTITY_FIELDS),
            # Listing a workspace's identities, oldest first, reads this index in order.
            sa.Index(f"ix_{name}_workspace_created", "workspace", "created_at", "id"),
        ),
    )


def usage_batches_table(
    keys_table_name: str = DEFAULT_TABLE_NAME, meta: sa.MetaData | None = None
) -> sa.Table:
    """The table of applied usage batch ids that goes with the keys table `keys_table_name`.

    It is called `<keys_table_name>_usage_batches`: one row per batch `add_usage` applied
    (its id, at most 64 characters, and when), written in the same transaction as the
    batch's increments, so a batch sent again is recognised and skipped. Rows older than
    `USAGE_BATCH_RETENTION` (24 hours) are deleted now and then. Calling it again with the
    same name returns the same `Table`.
    """
    return _companion(
        keys_table_name,
        "usage_batches",
        meta,
        lambda name: (
            sa.Column("batch_id", sa.String(64), primary_key=True),
            sa.Column("applied_at", UTCDateTime(), nullable=False),
            # Pruning deletes the oldest rows: it reads this index, not the whole table.
            sa.Index(f"ix_{name}_applied_at", "applied_at"),
        ),
    )


def changes_table(
    keys_table_name: str = DEFAULT_TABLE_NAME, meta: sa.MetaData | None = None
) -> sa.Table:
    """The change log of the keys table `keys_table_name`: `<name>_changes`.

    Triggers on the keys table append a row for every change to a key, in the change's own
    transaction, whoever makes it (`apikeys.stores.sql.log`); on SQLite the store also
    appends the notice of the apikeys process that made it. Processes that cache keys read
    it at every probe to drop what changed (`apikeys.stores.contract`). The newest 10,000 rows are
    kept.
    """
    return _companion(
        keys_table_name,
        "changes",
        meta,
        lambda name: (
            sa.Column(
                "seq",
                sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                primary_key=True,
                autoincrement=True,
            ),
            # `<writer>:<sequence>:<key id>`, or `…:i:<identity id>` (up to 64 characters).
            sa.Column("notice", sa.String(128), nullable=False),
            # Added with webhooks: the event the change is (`key.created`, …), and the key's
            # record after it as JSON without its hash (the outbox of `apikeys.webhooks`).
            sa.Column("event", sa.String(32), nullable=True),
            sa.Column("data", sa.Text(), nullable=True),
            sa.Index(f"ix_{name}_notice", "notice"),
        ),
        sqlite_autoincrement=True,
    )


def log_table(
    keys_table_name: str = DEFAULT_TABLE_NAME, meta: sa.MetaData | None = None
) -> sa.Table:
    """`<name>_log`: one row, the change log's high-water mark (`seq`, PostgreSQL) and the
    random `identity` it was made with (a restored or remade database has another)."""
    return _companion(
        keys_table_name,
        "log",
        meta,
        lambda name: (
            sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
            sa.Column("seq", sa.BigInteger(), nullable=False, server_default="0"),
            sa.Column("identity", sa.String(32), nullable=False),
        ),
    )


def readers_table(
    keys_table_name: str = DEFAULT_TABLE_NAME, meta: sa.MetaData | None = None
) -> sa.Table:
    """The registry of processes caching keys of `keys_table_name`: `<name>_readers`.

    One row per process that serves keys from its cache: its id, the last change it applied
    (SQLite) and when its registration runs out (seconds; PostgreSQL's clock, or the host's
    boot clock on SQLite). A change waits for the acknowledgement of each registered reader
    (see docs/consistency.md).
    """
    return _companion(
        keys_table_name,
        "readers",
        meta,
        lambda name: (
            sa.Column("reader_id", sa.String(32), primary_key=True),
            sa.Column("seen", sa.BigInteger(), nullable=False, server_default="0"),
            sa.Column("expires_at", sa.Float(), nullable=False),
        ),
    )


def audit_table(
    keys_table_name: str = DEFAULT_TABLE_NAME, meta: sa.MetaData | None = None
) -> sa.Table:
    """`<keys table>_audit`: the audit trail, one row per change, appended in the change's
    own transaction and never updated."""
    return _companion(
        keys_table_name,
        "audit",
        meta,
        lambda name: (
            sa.Column(
                "seq",
                sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                primary_key=True,
                autoincrement=True,
            ),
            sa.Column("at", UTCDateTime(), nullable=False),
            # A key's id, or `i:<identity id>` for an identity's event (`identity.created`…).
            sa.Column("key_id", sa.String(80), nullable=False),
            sa.Column("workspace", sa.String(), nullable=False),
            sa.Column("action", sa.String(32), nullable=False),
            sa.Column("actor", sa.String(), nullable=True),
            sa.Column("changes", sa.Text(), nullable=False),
            sa.Index(f"ix_{name}_workspace_at", "workspace", "at"),
            sa.Index(f"ix_{name}_key_at", "key_id", "at"),
        ),
    )


def usage_daily_table(
    keys_table_name: str = DEFAULT_TABLE_NAME, meta: sa.MetaData | None = None
) -> sa.Table:
    """`<keys table>_usage_daily`: requests per key, UTC day and outcome (`admitted` or a
    refusal code), added to by the usage batches, in their transaction."""
    return _companion(
        keys_table_name,
        "usage_daily",
        meta,
        lambda name: (
            sa.Column("key_id", sa.String(12), primary_key=True),
            sa.Column("day", sa.String(10), primary_key=True),
            sa.Column("outcome", sa.String(32), primary_key=True),
            sa.Column("count", sa.BigInteger(), nullable=False),
        ),
    )


def settings_table(
    keys_table_name: str = DEFAULT_TABLE_NAME, meta: sa.MetaData | None = None
) -> sa.Table:
    """`<keys table>_settings`: a value per name for the store as a whole, such as the
    fingerprint of the pepper its keys are hashed with (`SQLStore.claim_setting`)."""
    return _companion(
        keys_table_name,
        "settings",
        meta,
        lambda name: (
            sa.Column("name", sa.String(64), primary_key=True),
            sa.Column("value", sa.String(200), nullable=False),
        ),
    )


def one_time_table(
    keys_table_name: str = DEFAULT_TABLE_NAME, meta: sa.MetaData | None = None
) -> sa.Table:
    """`<keys table>_once`: short-lived single-use values (`SQLStore.put_once`), each
    deleted when taken; expired rows are deleted by the next `put_once`."""
    return _companion(
        keys_table_name,
        "once",
        meta,
        lambda name: (
            sa.Column("token", sa.String(64), primary_key=True),
            sa.Column("value", sa.Text(), nullable=False),
            sa.Column("expires_at", UTCDateTime(), nullable=False),
            sa.Index(f"ix_{name}_expires_at", "expires_at"),
        ),
    )


def webhooks_table(
    keys_table_name: str = DEFAULT_TABLE_NAME, meta: sa.MetaData | None = None
) -> sa.Table:
    """`<keys table>_webhooks`: the endpoints events are sent to (`apikeys.webhooks`).

    One row per endpoint: its URL, the events and workspace it wants, its signing secret
    (and the previous one while a roll's overlap lasts), and `taken`, the last entry of the
    change log handed to its deliveries. The change log keeps every entry after the lowest
    `taken`.
    """
    return _companion(
        keys_table_name,
        "webhooks",
        meta,
        lambda name: (
            sa.Column("id", sa.String(32), primary_key=True),
            sa.Column("url", sa.Text(), nullable=False),
            sa.Column("events", sa.Text(), nullable=False),
            sa.Column("workspace", sa.String(), nullable=True),
            sa.Column("secret", sa.String(128), nullable=False),
            sa.Column("previous_secret", sa.String(128), nullable=True),
            sa.Column("previous_until", UTCDateTime(), nullable=True),
            sa.Column("taken", sa.BigInteger(), nullable=False),
            sa.Column("created_at", UTCDateTime(), nullable=False),
        ),
    )


def webhook_deliveries_table(
    keys_table_name: str = DEFAULT_TABLE_NAME, meta: sa.MetaData | None = None
) -> sa.Table:
    """`<keys table>_deliveries`: one row per event and endpoint, with its signed body,
    status (`pending`, `delivered`, `failed`), attempts and last response, and the
    workspace of the key it is about."""
    return _companion(
        keys_table_name,
        "deliveries",
        meta,
        lambda name: (
            sa.Column("id", sa.String(40), primary_key=True),
            sa.Column("webhook_id", sa.String(32), nullable=False),
            # A key's id, or `i:<identity id>` for an identity's event.
            sa.Column("key_id", sa.String(80), nullable=False),
            sa.Column("seq", sa.BigInteger(), nullable=False),
            sa.Column("event", sa.String(32), nullable=False),
            sa.Column("body", sa.Text(), nullable=False),
            sa.Column("status", sa.String(16), nullable=False),
            sa.Column("attempts", sa.Integer(), nullable=False),
            sa.Column("created_at", UTCDateTime(), nullable=False),
            sa.Column("next_attempt_at", UTCDateTime(), nullable=False),
            sa.Column("last_attempt_at", UTCDateTime(), nullable=True),
            sa.Column("last_status", sa.Integer(), nullable=True),
            sa.Column("last_error", sa.String(200), nullable=True),
            sa.Column("lease_until", UTCDateTime(), nullable=True),
            sa.Column("leased_by", sa.String(32), nullable=True),
            sa.Column("workspace", sa.String(), nullable=True),
            sa.Index(f"ix_{name}_due", "status", "next_attempt_at"),
            sa.Index(f"ix_{name}_hook_key", "webhook_id", "key_id", "seq"),
            # A workspace's deliveries, newest first (the settings page, `--workspace`).
            sa.Index(f"ix_{name}_workspace", "workspace", "seq"),
            # Pruning: the deliveries delivered or failed before a time.
            sa.Index(f"ix_{name}_finished", "status", "last_attempt_at"),
        ),
    )


keys = keys_table()
"""The default keys table, `apikeys_keys`."""


def store_tables(table_name: str) -> tuple[sa.Table, ...]:
    """The keys table called `table_name` and the tables that go with it, on `metadata`."""
    return (
        keys_table(table_name),
        usage_batches_table(table_name),
        changes_table(table_name),
        log_table(table_name),
        readers_table(table_name),
        audit_table(table_name),
        usage_daily_table(table_name),
        settings_table(table_name),
        one_time_table(table_name),
        webhooks_table(table_name),
        webhook_deliveries_table(table_name),
        identities_table(table_name),
    )


def create_tables_on(connection: sa.Connection, tables: Sequence[sa.Table]) -> None:
    """Create each of `tables` that is missing, with its indexes; one that exists must have
    every column of this format (`ConfigurationError` otherwise, and nothing is changed)."""
    for table in tables:
        table.create(connection, checkfirst=True)
        _check_columns(connection, table)
        if connection.dialect.name == "postgresql":
            _widen_columns(connection, table)


def _widen_columns(connection: sa.Connection, table: sa.Table) -> None:
    """Give each text column of `table` that PostgreSQL keeps narrower than this release
    declares it the declared length (an earlier release's audit `key_id` and `action`, and
    the change log's `notice`, before identities needed more room). Only what differs is
    altered: on a schema that is right this reads the catalog and writes nothing."""
    declared = {
        column.name: column.type.length
        for column in table.columns
        if isinstance(column.type, sa.String) and column.type.length is not None
    }
    if not declared:
        return
    rows = connection.execute(
        sa.text(
            "SELECT column_name, character_maximum_length FROM information_schema.columns "
            "WHERE table_name = :t AND table_schema = current_schema() "
            "AND character_maximum_length IS NOT NULL"
        ),
        {"t": table.name},
    )
    quote = connection.dialect.identifier_preparer
    for name, length in rows:
        wanted = declared.get(name)
        if wanted is not None and length < wanted:
            connection.execute(
                sa.text(
                    f"ALTER TABLE {quote.format_table(table)} ALTER COLUMN "
                    f"{quote.quote(name)} TYPE varchar({int(wanted)})"
                )
            )


def _check_columns(connection: sa.Connection, table: sa.Table) -> None:
    """Raise `ConfigurationError` naming the columns of `table` its database table lacks.

    0.1.0 is the first format: a table made by pre-release code is not migrated.
    """
    present = {column["name"] for column in sa.inspect(connection).get_columns(table.name)}
    missing = [column.name for column in table.columns if column.name not in present]
    if missing:
        raise ConfigurationError(
            f"the table {table.name!r} lacks the columns {', '.join(missing)}: it was not made "
            "by apikeys 0.1.0 or later (there is no upgrade from pre-release tables); make it "
            "again, or add them with your migrations"
        )


SCHEMA_LOCK: Final = 0x61706B6579
"""The PostgreSQL advisory lock (transaction-scoped) that `setup()` holds while it makes or
checks the schema: processes take turns. Take it around your own changes to these tables
to keep a starting process from running into them."""
SCHEMA_TURN_WAIT: Final = 60.0
"""Seconds `setup()` waits for its turn at `SCHEMA_LOCK`, looking again and again: each
look is one quick statement, so neither a short `command_timeout` nor the database's
`lock_timeout` ends the wait of the last of many workers started together."""


def _already_exists(exc: BaseException) -> bool:
    """Whether `exc` says another process created the object first, or (SQLite) holds the
    file's lock while it does: either way, running the creation again settles it."""
    orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    # duplicate_table, duplicate_object, and unique_violation (of pg_type's index)
    if sqlstate in ("42P07", "42710", "23505") or "already exists" in str(orig):
        return True
    # A reader upgrading to a writer while another process writes gets SQLITE_BUSY at once,
    # without waiting out the busy timeout.
    return "database is locked" in str(orig)


async def create_concurrently(engine: AsyncEngine, create: Callable[[sa.Connection], None]) -> None:
    """Run `create` (idempotent `CREATE … IF NOT EXISTS` work) safely at concurrent startup.

    Several processes starting on a fresh database race to create the same tables:
    PostgreSQL then answers one of them with a unique violation, SQLite with "table already
    exists". On PostgreSQL the creators take turns (a transaction-scoped advisory lock); on
    both, a creation that lost the race is run again, and finds everything there.
    """
    attempts = 10
    for attempt in range(attempts):
        try:
            async with engine.begin() as conn:
                if conn.dialect.name == "postgresql":
                    await _take_schema_turn(conn)
                await conn.run_sync(create)
            return
        except sa_exc.DBAPIError as exc:
            if attempt == attempts - 1 or not _already_exists(exc):
                raise
            await asyncio.sleep(0.02 * (attempt + 1))


async def _take_schema_turn(conn: AsyncConnection) -> None:
    """Take the schema's advisory lock for `conn`'s transaction, looking again until the
    process that holds it commits (`pg_advisory_xact_lock` would wait in one statement,
    which `command_timeout` or `lock_timeout` cuts short); `StoreUnavailable` after
    `SCHEMA_TURN_WAIT` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SCHEMA_TURN_WAIT
    pause = 0.01
    take = sa.text("SELECT pg_try_advisory_xact_lock(:id)")
    while not (await conn.execute(take, {"id": SCHEMA_LOCK})).scalar():
        if loop.time() >= deadline:
            raise StoreUnavailable(
                TimeoutError(),
                hint=f"another session held the schema's lock (SCHEMA_LOCK, an advisory lock) "
                f"for {SCHEMA_TURN_WAIT:.0f} s: look for it in pg_locks",
            )
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.2)


async def create_tables_with(engine: AsyncEngine, tables: Sequence[sa.Table]) -> None:
    await create_concurrently(engine, lambda connection: create_tables_on(connection, tables))


def create_private_file(path: str) -> None:
    """Create the file at `path` readable by its owner only (0600), unless it exists.

    SQLite creates a database with the process's umask (often world-readable); key hashes
    and password hashes deserve better. An existing file's mode is left alone.
    """
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
