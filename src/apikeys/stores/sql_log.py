"""The SQL store's change log, kept by the database itself: whoever writes, it is logged.

Triggers on the keys table append a row to `<table>_changes` for every key inserted, deleted
or updated, in the writer's own transaction, whatever the writer is: this release, an older
one, a `cache=False` job, `psql` or `sqlite3` by hand. The cache's readers read that log at
every probe round (`apikeys.channels`), so a change nobody announced is still seen.

- Updates that only count usage (`request_count`, `last_used_at`, a spend of credits) are not
  logged: they change no decision a cache makes (credits are spent in the store itself; only
  whether a key has credits at all is decided from a cached record).
- **PostgreSQL.** The row's `seq` comes from the single row of `<table>_log`, raised by each
  change. Its row lock makes changes take turns at commit (the triggers are deferred to
  commit time, so no transaction waits for it while holding a key's row), so sequence order
  is commit order and the log has no holes: a reader that has applied every row up to the
  log's `seq` has seen every committed change. The trigger also sends the notice with
  `pg_notify`, which only wakes readers early. A `TRUNCATE` logs `*`: every key.
- **SQLite.** Writers already take turns; `seq` is the changes table's own AUTOINCREMENT,
  whose high-water mark `sqlite_sequence` keeps even after old rows are pruned.
- `<table>_log.identity` is a random token made with the log: a database restored from a
  backup or made again has another one (or a lower `seq`), and readers then start afresh.

The triggers' names carry a digest of the columns they watch, so a release that adds a
column replaces them at `setup()`.
"""

# Every name in this SQL is a quoted identifier of the store's own tables; values are bound.
# ruff: noqa: S608

from __future__ import annotations

import hashlib
import secrets
from typing import Final

import sqlalchemy as sa

__all__ = ["LOG_WRITER", "USAGE_COLUMNS", "install_change_log"]

LOG_WRITER: Final = "store"
"""The writer named in the notices the triggers write (see `apikeys.channels.base`)."""

USAGE_COLUMNS: Final = frozenset(
    {"request_count", "last_used_at", "credits", "credits_refilled_at"}
)
"""Columns whose updates alone are not logged (whether `credits` is NULL is)."""


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:8]


def _watched(keys: sa.Table) -> list[str]:
    return [column.name for column in keys.columns if column.name not in USAGE_COLUMNS]


def _condition(keys: sa.Table, quote: sa.sql.compiler.IdentifierPreparer, differ: str) -> str:
    """SQL true when an UPDATE changed a watched column (or whether credits are NULL)."""
    terms = [f"OLD.{quote.quote(name)} {differ} NEW.{quote.quote(name)}" for name in _watched(keys)]
    if "credits" in keys.columns:
        terms.append("(OLD.credits IS NULL) <> (NEW.credits IS NULL)")
    return " OR ".join(terms)


def install_change_log(
    connection: sa.Connection, keys: sa.Table, changes: sa.Table, log: sa.Table
) -> None:
    """Make the log's row and the triggers on `keys`, unless they are there (idempotent).

    Run inside the store's schema creation (which takes turns between processes).
    """
    connection.execute(
        sa.text(
            f"INSERT INTO {_table(connection, log)} (id, seq, identity) "
            "VALUES (1, 0, :identity) ON CONFLICT (id) DO NOTHING"
        ),
        {"identity": secrets.token_hex(16)},
    )
    if connection.dialect.name == "postgresql":
        _install_postgres(connection, keys, changes, log)
    elif connection.dialect.name == "sqlite":
        _install_sqlite(connection, keys, changes)


def _table(connection: sa.Connection, table: sa.Table) -> str:
    return connection.dialect.identifier_preparer.format_table(table)


def _install_sqlite(connection: sa.Connection, keys: sa.Table, changes: sa.Table) -> None:
    quote = connection.dialect.identifier_preparer
    watched = _watched(keys)
    base = f"{keys.name}_log_{_digest(*watched)}"
    existing = {
        row[0]
        for row in connection.execute(
            sa.text("SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = :t"),
            {"t": keys.name},
        )
    }
    ours = {f"{base}_insert", f"{base}_delete", f"{base}_update"}
    for name in existing:
        if name.startswith(f"{keys.name}_log_") and name not in ours:
            connection.execute(sa.text(f"DROP TRIGGER IF EXISTS {quote.quote(name)}"))
    if ours <= existing:
        return
    keys_name, changes_name = _table(connection, keys), _table(connection, changes)
    notice = f"'{LOG_WRITER}:0:' || "
    connection.execute(
        sa.text(
            f"CREATE TRIGGER IF NOT EXISTS {quote.quote(base + '_insert')} AFTER INSERT "
            f"ON {keys_name} BEGIN INSERT INTO {changes_name} (notice) "
            f"VALUES ({notice}NEW.id); END"
        )
    )
    connection.execute(
        sa.text(
            f"CREATE TRIGGER IF NOT EXISTS {quote.quote(base + '_delete')} AFTER DELETE "
            f"ON {keys_name} BEGIN INSERT INTO {changes_name} (notice) "
            f"VALUES ({notice}OLD.id); END"
        )
    )
    connection.execute(
        sa.text(
            f"CREATE TRIGGER IF NOT EXISTS {quote.quote(base + '_update')} AFTER UPDATE "
            f"ON {keys_name} WHEN {_condition(keys, quote, 'IS NOT')} BEGIN "
            f"INSERT INTO {changes_name} (notice) VALUES ({notice}OLD.id); "
            f"INSERT INTO {changes_name} (notice) SELECT {notice}NEW.id "
            "WHERE NEW.id IS NOT OLD.id; END"
        )
    )


def _install_postgres(
    connection: sa.Connection, keys: sa.Table, changes: sa.Table, log: sa.Table
) -> None:
    from apikeys.channels.postgres import notice_channel_name

    quote = connection.dialect.identifier_preparer
    watched = _watched(keys)
    version = _digest(keys.name, *watched)
    base = f"apikeys_log_{version}"
    existing = {
        row[0]
        for row in connection.execute(
            sa.text(
                "SELECT tgname FROM pg_trigger WHERE tgrelid = CAST(:t AS regclass) "
                "AND NOT tgisinternal"
            ),
            {"t": _table(connection, keys)},
        )
    }
    keys_name = _table(connection, keys)
    for name in existing:
        if name.startswith("apikeys_log_") and not name.startswith(base):
            connection.execute(
                sa.text(f"DROP TRIGGER IF EXISTS {quote.quote(name)} ON {keys_name}")
            )
    ours = {f"{base}_rows", f"{base}_updates", f"{base}_truncate"}
    if ours <= existing:
        return
    function = quote.quote(f"apikeys_log_{_digest(keys.name)}")
    schema = keys.schema
    if schema:
        function = f"{quote.quote(schema)}.{function}"
    channel = notice_channel_name(keys.name)
    connection.execute(
        sa.text(
            f"""
CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $log$
DECLARE
  s bigint;
  k text;
  ids text[];
BEGIN
  IF TG_OP = 'TRUNCATE' THEN
    ids := ARRAY['*'];
  ELSIF TG_OP = 'INSERT' THEN
    ids := ARRAY[NEW.id::text];
  ELSIF TG_OP = 'DELETE' OR OLD.id = NEW.id THEN
    ids := ARRAY[OLD.id::text];
  ELSE
    ids := ARRAY[OLD.id::text, NEW.id::text];
  END IF;
  FOREACH k IN ARRAY ids LOOP
    UPDATE {_table(connection, log)} SET seq = seq + 1 WHERE id = 1 RETURNING seq INTO s;
    IF s IS NULL THEN
      -- The log's row was deleted by hand: a new identity makes every reader start afresh.
      INSERT INTO {_table(connection, log)} (id, seq, identity)
        VALUES (1, 1, md5(random()::text || clock_timestamp()::text))
        ON CONFLICT (id) DO UPDATE SET seq = {_table(connection, log)}.seq + 1
        RETURNING seq INTO s;
    END IF;
    INSERT INTO {_table(connection, changes)} (seq, notice)
      VALUES (s, '{LOG_WRITER}:' || s || ':' || k);
    PERFORM pg_notify('{channel}', '{LOG_WRITER}:' || s || ':' || k);
  END LOOP;
  RETURN NULL;
END
$log$
"""
        )
    )
    for name in ours:
        connection.execute(sa.text(f"DROP TRIGGER IF EXISTS {quote.quote(name)} ON {keys_name}"))
    # Deferred to commit: the log's row is locked last, after every key row the
    # transaction touches, so two transactions cannot wait for each other through it.
    connection.execute(
        sa.text(
            f"CREATE CONSTRAINT TRIGGER {quote.quote(base + '_rows')} AFTER INSERT OR DELETE "
            f"ON {keys_name} DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
            f"EXECUTE FUNCTION {function}()"
        )
    )
    connection.execute(
        sa.text(
            f"CREATE CONSTRAINT TRIGGER {quote.quote(base + '_updates')} AFTER UPDATE "
            f"ON {keys_name} DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
            f"WHEN ({_condition(keys, quote, 'IS DISTINCT FROM')}) "
            f"EXECUTE FUNCTION {function}()"
        )
    )
    connection.execute(
        sa.text(
            f"CREATE TRIGGER {quote.quote(base + '_truncate')} AFTER TRUNCATE ON {keys_name} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
        )
    )
