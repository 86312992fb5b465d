"""The SQL store's change log, kept by the database itself: whoever writes, it is logged.

Triggers on the keys table append a row to `<table>_changes` for every key inserted, deleted
or updated, in the writer's own transaction, whatever the writer is: this release, an older
one, a `cache=False` job, `psql` or `sqlite3` by hand. The cache's readers read that log at
every probe round (`apikeys.stores.contract`), so a change nobody announced is still seen.

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

- The PostgreSQL trigger runs as its owner (`SECURITY DEFINER`, with a fixed `search_path`
  and schema-qualified names), so a writer with only `UPDATE` on the keys table (a support
  tool, an older release's role) and a writer with another `search_path` are logged too. It
  is `ENABLE ALWAYS`: logical replication and `pg_restore` (`session_replication_role =
  replica`) fire it as well. It compares rows as JSON without the usage columns, so it
  watches every column of every release, and is never replaced.
- SQLite's triggers name the columns they watch; their names carry a digest of them, and a
  release adds its own beside an older one's, never removes one (an older release's
  `setup()` during a rolling upgrade then cannot narrow what is logged).
- **The webhooks' outbox.** Each entry also carries the event the change is (`key.created`
  for an insert; `key.disabled`, `key.enabled` or `key.revoked` for a change of state;
  `key.rolled` when `replaced_by` is set; `key.updated` for any other change a reader sees,
  not for a re-hash alone; none for a delete or a truncate) and the key's record after it
  as JSON, without its hash, with the time (`apikeys.stores.sql.webhooks`). The log is never
  pruned past the lowest mark of the webhooks' endpoints (`<table>_webhooks.taken`). The
  version-2 triggers replace PostgreSQL's version 1; on SQLite they join an older
  release's, whose entries carry no event.
- `check_change_log` tells whether the triggers are there and enabled; readers run it with
  every registration, and give no proof while they are not (a table rebuilt by a migration
  tool, triggers disabled by hand): a change nobody logs cannot be trusted to be heard.
  On PostgreSQL every probe also compares the triggers' seal (`trigger_seal_sql`), which
  a change made while they were disabled or replaced and put back in its own transaction
  alters; on SQLite, `PRAGMA schema_version` (`apikeys.stores.sql.sqlite_channel`).
- `setup()` reads the catalogs and changes only what differs from what this release makes
  (the function's source and settings, each trigger's shape and enabled state, the change
  log's storage parameters): on a schema that is right it writes nothing and takes no lock
  stronger than a read.
"""

# Every name in this SQL is a quoted identifier of the store's own tables; values are bound.
# ruff: noqa: S608

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections.abc import Sequence
from typing import Final

import sqlalchemy as sa

from apikeys.stores.contract import STORE_WRITER
from apikeys.types import identity_subject

__all__ = [
    "CHANGES_STORAGE",
    "IDENTITY_PREFIX",
    "KEEP_CHANGES",
    "POSTGRES_TRIGGERS",
    "SECRET_COLUMNS",
    "USAGE_COLUMNS",
    "channel_base_name",
    "check_change_log_sql",
    "combined_check_sql",
    "install_change_log",
    "notice_channel_name",
    "table_schema",
    "trigger_names",
    "trigger_seal_sql",
]

# The version of the PostgreSQL triggers: they watch every column but the usage ones, so a
# release that adds a column needs no new trigger. Version 2 also writes each change's
# event and record (the webhooks' outbox), and keeps what a webhook has not taken yet.
_PG_BASE: Final = "apikeys_log_v2"
POSTGRES_TRIGGERS: Final = (f"{_PG_BASE}_rows", f"{_PG_BASE}_updates", f"{_PG_BASE}_truncate")
"""The triggers that keep the change log on PostgreSQL (the same for every keys table)."""

_PG_OLDER: Final = ("apikeys_log_v1_rows", "apikeys_log_v1_updates", "apikeys_log_v1_truncate")
# The version in the names of SQLite's triggers (beside a digest of the columns they watch).
_SQLITE_VERSION: Final = "v2"

SECRET_COLUMNS: Final = frozenset({"secret_hash"})
"""Columns never written to the change log's records (nor to a webhook's body)."""

KEEP_CHANGES: Final = 10_000
"""Changes kept in the log; a reader that falls further behind starts afresh."""

USAGE_COLUMNS: Final = frozenset(
    {"request_count", "last_used_at", "credits", "credits_refilled_at"}
)
"""Columns whose updates alone are not logged (whether `credits` is NULL is)."""


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:8]


def _watched(keys: sa.Table) -> list[str]:
    return [column.name for column in keys.columns if column.name not in USAGE_COLUMNS]


def _table(connection: sa.Connection, table: sa.Table) -> str:
    return connection.dialect.identifier_preparer.format_table(table)


def install_change_log(
    connection: sa.Connection,
    keys: sa.Table,
    changes: sa.Table,
    log: sa.Table,
    identities: sa.Table | None = None,
) -> None:
    """Make the log's row and the triggers on `keys` (and on `identities`, whose changes
    are logged as `i:<id>`), unless they are there (idempotent).

    Run inside the store's schema creation (which takes turns between processes).
    """
    # The mark starts at the newest change already logged: a log made again (its row
    # deleted by hand) never hands out a sequence number twice. Written only when missing:
    # a setup on a schema that is right writes nothing (and takes no write lock).
    present = connection.execute(
        sa.text(f"SELECT 1 FROM {_table(connection, log)} WHERE id = 1")
    ).first()
    if present is None:
        connection.execute(
            sa.text(
                f"INSERT INTO {_table(connection, log)} (id, seq, identity) "
                f"SELECT 1, COALESCE(max(seq), 0), :identity FROM {_table(connection, changes)} "
                # (SQLite reads ON CONFLICT after a SELECT as a join's without a WHERE.)
                "WHERE true ON CONFLICT (id) DO NOTHING"
            ),
            {"identity": secrets.token_hex(16)},
        )
    if connection.dialect.name == "postgresql":
        _install_postgres(connection, keys, changes, log)
        if identities is not None:
            _install_postgres_identities(connection, keys, identities, changes, log)
    elif connection.dialect.name == "sqlite":
        _install_sqlite(connection, keys, changes)
        if identities is not None:
            _install_sqlite_identities(connection, identities, changes)


def trigger_names(keys: sa.Table, dialect: str) -> tuple[str, ...]:
    """The names of the triggers that log changes to `keys` (or to the identities table)
    on `dialect`."""
    if dialect == "postgresql":
        return POSTGRES_TRIGGERS
    base = f"{keys.name}_log_{_digest(_SQLITE_VERSION, *_watched(keys))}"
    return (f"{base}_insert", f"{base}_delete", f"{base}_update")


def combined_check_sql(
    tables: Sequence[tuple[str, Sequence[str]]], schema: str | None, dialect: str
) -> tuple[str, int]:
    """`check_change_log_sql` of several tables (name and trigger names) as one SELECT of
    the sum, and the count it has when every one's log is kept."""
    parts = [
        "(" + check_change_log_sql(name, schema, dialect, names) + ")" for name, names in tables
    ]
    return "SELECT " + " + ".join(parts), sum(len(names) for _, names in tables)


def _identity_notice(row: str) -> str:
    return f"'{STORE_WRITER}:0:{IDENTITY_PREFIX}' || {row}.id"


IDENTITY_PREFIX: Final = identity_subject("")
"""What an identity's id follows in the notices of its row's changes (`i:<id>`)."""


def _install_sqlite_identities(
    connection: sa.Connection, identities: sa.Table, changes: sa.Table
) -> None:
    """Triggers that log every insert, delete and update (but of the credit count alone)
    of an identity's row as the notice `store:0:i:<id>`, with its webhook event
    (`identity.created`, `identity.disabled`, `identity.enabled`, `identity.revoked` for a
    change of state, else `identity.updated`; none for a delete) and its record as JSON."""
    quote = connection.dialect.identifier_preparer
    inserted, deleted, updated = trigger_names(identities, "sqlite")
    table, changes_name = _table(connection, identities), _table(connection, changes)
    differ = " OR ".join(
        [f"OLD.{quote.quote(name)} IS NOT NEW.{quote.quote(name)}" for name in _watched(identities)]
        + ["(OLD.credits IS NULL) <> (NEW.credits IS NULL)"]
    )
    fields = ", ".join(
        f"'{column.name}', NEW.{quote.quote(column.name)}" for column in identities.columns
    )
    record = (
        f"json_object('at', strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), "
        f"'identity', json_object({fields}))"
    )
    # Only an update the WHEN lets through is logged: a change of state, or another field.
    event = (
        "CASE WHEN NEW.id IS NOT OLD.id THEN NULL WHEN OLD.state IS NOT NEW.state THEN "
        "CASE NEW.state WHEN 'revoked' THEN 'identity.revoked' "
        "WHEN 'disabled' THEN 'identity.disabled' ELSE 'identity.enabled' END "
        "ELSE 'identity.updated' END"
    )
    logged = f"INSERT INTO {changes_name} (notice) SELECT"
    with_event = f"INSERT INTO {changes_name} (notice, event, data) SELECT"
    for name, trigger, statements in (
        (
            inserted,
            "INSERT",
            f"{with_event} {_identity_notice('NEW')}, 'identity.created', {record};",
        ),
        (deleted, "DELETE", f"{logged} {_identity_notice('OLD')};"),
        (
            updated,
            f"UPDATE ON {table} WHEN {differ}",
            # An id changed by hand names both: the old id's readers and the new one's.
            f"{with_event} {_identity_notice('OLD')}, e, "
            f"CASE WHEN e IS NULL THEN NULL ELSE {record} END FROM (SELECT {event} AS e); "
            f"{logged} {_identity_notice('NEW')} WHERE NEW.id IS NOT OLD.id;",
        ),
    ):
        on = "" if trigger.startswith("UPDATE") else f" ON {table}"
        connection.execute(
            sa.text(
                f"CREATE TRIGGER IF NOT EXISTS {quote.quote(name)} AFTER {trigger}{on} "
                f"BEGIN {statements} END"
            )
        )


def _install_postgres_identities(
    connection: sa.Connection,
    keys: sa.Table,
    identities: sa.Table,
    changes: sa.Table,
    log: sa.Table,
) -> None:
    """The PostgreSQL log of the identities table: the keys' triggers (same names, shape
    and sequence), with a function that names the row `i:<id>` and writes its event."""
    quote = connection.dialect.identifier_preparer
    schema = table_schema(connection, identities)

    def qualified(name: str) -> str:
        return f"{quote.quote(schema)}.{quote.quote(name)}"

    name = f"{_PG_IDENTITIES}_{_digest(schema, identities.name)}"
    body = _postgres_log_body(
        _IDENTITY_ROWS,
        qualified(log.name),
        qualified(changes.name),
        qualified(f"{keys.name}_webhooks"),
        notice_channel_name(keys.name),
    )
    function = _ensure_function(connection, schema, name, qualified(name), body)
    _ensure_triggers(connection, qualified(identities.name), qualified(name), function)


_PG_IDENTITIES: Final = "apikeys_ilog_v1"


def check_change_log_sql(
    keys_name: str, schema: str | None, dialect: str, names: Sequence[str]
) -> str:
    """SQL that counts the triggers of `names` on the keys table that are there and enabled
    (as many as `names` when the log is kept)."""
    listed = ", ".join("'" + name.replace("'", "''") + "'" for name in names)
    if dialect == "postgresql":
        qualified = f'"{schema}"."{keys_name}"' if schema else f'"{keys_name}"'
        return (
            "SELECT count(*) FROM pg_trigger WHERE tgrelid = to_regclass("
            + "'"
            + qualified.replace("'", "''")
            + "'"
            + f") AND tgname IN ({listed}) AND tgenabled = 'A'"
        )
    return (
        "SELECT count(*) FROM sqlite_master WHERE type = 'trigger' AND tbl_name = "
        + "'"
        + keys_name.replace("'", "''")
        + "'"
        + f" AND name IN ({listed})"
    )


def trigger_seal_sql(keys_name: str, schema: str | None, names: Sequence[str]) -> str:
    """SQL (a scalar subquery) of the *seal* of the PostgreSQL triggers `names` on the keys
    table: how many are enabled `ALWAYS`, and each one's and its function's oid and row
    version (`xmin`). NULL when none is.

    Disabling a trigger and enabling it again, replacing its function and putting it back,
    or dropping and making it again, each inside the transaction of a change that so got
    past the log, leaves the catalogs as they were but for these row versions: a reader
    that finds another seal than the one it started with cannot know what it missed.
    """
    listed = ", ".join("'" + name.replace("'", "''") + "'" for name in names)
    qualified = f'"{schema}"."{keys_name}"' if schema else f'"{keys_name}"'
    return (
        "(SELECT count(*) || ':' || string_agg(t.oid::text || '.' || t.xmin::text || '.' "
        "|| p.oid::text || '.' || p.xmin::text, ',' ORDER BY t.oid) "
        "FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid "
        "WHERE t.tgrelid = to_regclass('" + qualified.replace("'", "''") + "') "
        f"AND t.tgname IN ({listed}) AND t.tgenabled = 'A')"
    )


def _install_sqlite(connection: sa.Connection, keys: sa.Table, changes: sa.Table) -> None:
    quote = connection.dialect.identifier_preparer
    inserted, deleted, updated = trigger_names(keys, "sqlite")
    existing = {
        row[0]
        for row in connection.execute(
            sa.text("SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = :t"),
            {"t": keys.name},
        )
    }
    if {inserted, deleted, updated} <= existing:
        return
    keys_name, changes_name = _table(connection, keys), _table(connection, changes)
    notice = f"'{STORE_WRITER}:0:' || "
    differ = " OR ".join(
        [f"OLD.{quote.quote(name)} IS NOT NEW.{quote.quote(name)}" for name in _watched(keys)]
        + (["(OLD.credits IS NULL) <> (NEW.credits IS NULL)"] if "credits" in keys.columns else [])
    )

    def record(row: str) -> str:
        fields = ", ".join(
            f"'{column.name}', {row}.{quote.quote(column.name)}"
            for column in keys.columns
            if column.name not in SECRET_COLUMNS
        )
        now = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
        return f"json_object('at', {now}, 'key', json_object({fields}))"

    connection.execute(
        sa.text(
            f"CREATE TRIGGER IF NOT EXISTS {quote.quote(inserted)} AFTER INSERT "
            f"ON {keys_name} BEGIN INSERT INTO {changes_name} (notice, event, data) "
            f"VALUES ({notice}NEW.id, 'key.created', {record('NEW')}); END"
        )
    )
    connection.execute(
        sa.text(
            f"CREATE TRIGGER IF NOT EXISTS {quote.quote(deleted)} AFTER DELETE "
            f"ON {keys_name} BEGIN INSERT INTO {changes_name} (notice) "
            f"VALUES ({notice}OLD.id); END"
        )
    )
    event = _sqlite_update_event(keys, quote)
    connection.execute(
        sa.text(
            f"CREATE TRIGGER IF NOT EXISTS {quote.quote(updated)} AFTER UPDATE "
            f"ON {keys_name} WHEN {differ} BEGIN "
            f"INSERT INTO {changes_name} (notice, event, data) SELECT {notice}OLD.id, e, "
            f"CASE WHEN e IS NULL THEN NULL ELSE {record('NEW')} END "
            f"FROM (SELECT CASE WHEN NEW.id IS OLD.id THEN {event} END AS e); "
            f"INSERT INTO {changes_name} (notice) SELECT {notice}NEW.id "
            "WHERE NEW.id IS NOT OLD.id; END"
        )
    )


def _sqlite_update_event(keys: sa.Table, quote: sa.sql.compiler.IdentifierPreparer) -> str:
    """The SQL of the event an update of a key is: its state, a roll, or any other change
    but of usage or of the hash alone (a re-hash is no event)."""
    visible = [
        f"OLD.{quote.quote(name)} IS NOT NEW.{quote.quote(name)}"
        for name in _watched(keys)
        if name not in SECRET_COLUMNS
    ]
    if "credits" in keys.columns:
        visible.append("(OLD.credits IS NULL) <> (NEW.credits IS NULL)")
    return (
        "CASE WHEN OLD.state IS NOT NEW.state THEN CASE NEW.state "
        "WHEN 'revoked' THEN 'key.revoked' WHEN 'disabled' THEN 'key.disabled' "
        "ELSE 'key.enabled' END "
        "WHEN OLD.replaced_by IS NULL AND NEW.replaced_by IS NOT NULL THEN 'key.rolled' "
        f"WHEN {' OR '.join(visible)} THEN 'key.updated' END"
    )


def table_schema(connection: sa.Connection, keys: sa.Table) -> str:
    """The schema the keys table lives in, as the store's own connection resolves it."""
    schema = connection.execute(
        sa.text(
            "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.oid = to_regclass(:t)"
        ),
        {"t": _table(connection, keys)},
    ).scalar_one()
    return str(schema)


def _install_postgres(
    connection: sa.Connection, keys: sa.Table, changes: sa.Table, log: sa.Table
) -> None:
    """Make, mend or leave the function and triggers of the log: read from the catalogs,
    and only what differs from what this release makes is changed (DDL takes a lock that
    waits for every reader of the keys table, and that every reader then waits for)."""
    quote = connection.dialect.identifier_preparer
    schema = table_schema(connection, keys)

    def qualified(name: str) -> str:
        return f"{quote.quote(schema)}.{quote.quote(name)}"

    # Changes (seq) are bigint: a table made by an earlier release had an int column.
    if _column_type(connection, schema, changes.name, "seq") == "integer":
        connection.execute(
            sa.text(f"ALTER TABLE {qualified(changes.name)} ALTER COLUMN seq TYPE bigint")
        )
    _ensure_storage(connection, qualified(changes.name))
    name = f"{_PG_BASE}_{_digest(schema, keys.name)}"
    body = _postgres_log_body(
        _KEY_ROWS,
        qualified(log.name),
        qualified(changes.name),
        qualified(f"{keys.name}_webhooks"),
        notice_channel_name(keys.name),
    )
    function = _ensure_function(connection, schema, name, qualified(name), body)
    _ensure_triggers(connection, qualified(keys.name), qualified(name), function)


CHANGES_STORAGE: Final = ("autovacuum_vacuum_scale_factor=0", "autovacuum_vacuum_threshold=1000")
"""The change log's table's storage parameters on PostgreSQL. The triggers delete the
oldest entries 128 at a time; vacuumed after every 1,000 dead rows (not the default 20 %
of the table), the space they leave is reused by the next entries, and the table stays
about the size of the entries it keeps."""


def _ensure_storage(connection: sa.Connection, changes_name: str) -> None:
    """Give the change log's table `CHANGES_STORAGE`, unless it has them (DDL only then)."""
    options = connection.execute(
        sa.text("SELECT reloptions FROM pg_class WHERE oid = to_regclass(:t)"),
        {"t": changes_name},
    ).scalar_one()
    if set(CHANGES_STORAGE) <= set(options or ()):
        return
    connection.execute(sa.text(f"ALTER TABLE {changes_name} SET ({', '.join(CHANGES_STORAGE)})"))


def channel_base_name(table_name: str) -> str:
    """The start of the PostgreSQL channel names of the keys table `table_name`: channel
    names are identifiers (at most 63 bytes), so a short digest of the table's name."""
    return "apikeys_" + hashlib.sha256(table_name.encode()).hexdigest()[:12]


def notice_channel_name(table_name: str) -> str:
    """The NOTIFY channel the notices of the keys table `table_name` travel on."""
    return channel_base_name(table_name) + "_n"


@dataclasses.dataclass(frozen=True, slots=True)
class _LoggedRows:
    """What differs between the log functions of the keys and of the identities: how a
    changed row is named, and which event and record its change writes."""

    subject: str
    """SQL naming a row's subject from `{row}.id` (`OLD` or `NEW`)."""
    created: str
    events: str
    """PL/pgSQL setting `ev` for an update that keeps the row's id."""
    record: str
    """SQL of the changed row as the event's record."""

    def name(self, row: str) -> str:
        return self.subject.format(row=row)


_HIDDEN: Final = " - ".join(f"'{name}'" for name in sorted(USAGE_COLUMNS | SECRET_COLUMNS))
_SECRET: Final = " - ".join(f"'{name}'" for name in sorted(SECRET_COLUMNS))

_KEY_ROWS: Final = _LoggedRows(
    subject="{row}.id::text",
    created="key.created",
    events=f"""    IF OLD.state IS DISTINCT FROM NEW.state THEN
      ev := CASE NEW.state WHEN 'revoked' THEN 'key.revoked'
        WHEN 'disabled' THEN 'key.disabled' ELSE 'key.enabled' END;
    ELSIF OLD.replaced_by IS NULL AND NEW.replaced_by IS NOT NULL THEN
      ev := 'key.rolled';
    ELSIF (to_jsonb(OLD) - {_HIDDEN}) IS DISTINCT FROM (to_jsonb(NEW) - {_HIDDEN})
        OR (OLD.credits IS NULL) <> (NEW.credits IS NULL) THEN
      ev := 'key.updated';
    END IF;""",
    record=f"'key', to_jsonb(NEW) - {_SECRET}",
)
# An identity's update reaches its function only when the trigger's WHEN saw more than
# usage change.
_IDENTITY_ROWS: Final = _LoggedRows(
    subject=f"'{IDENTITY_PREFIX}' || {{row}}.id::text",
    created="identity.created",
    events="""    ev := CASE WHEN OLD.state IS NOT DISTINCT FROM NEW.state THEN 'identity.updated'
      WHEN NEW.state = 'revoked' THEN 'identity.revoked'
      WHEN NEW.state = 'disabled' THEN 'identity.disabled' ELSE 'identity.enabled' END;""",
    record="'identity', to_jsonb(NEW)",
)


def _postgres_log_body(
    rows: _LoggedRows, log_name: str, changes_name: str, hooks_name: str, channel: str
) -> str:
    """The source of a log's trigger function (`pg_proc.prosrc` once it is made): each
    changed row of the keys (or identities) table gets a change, a notice, and its event."""
    old, new = rows.name("OLD"), rows.name("NEW")
    return f"""
DECLARE
  s bigint;
  k text;
  ids text[];
  ev text;
  evkey text;
  rec text;
BEGIN
  IF TG_OP = 'TRUNCATE' THEN
    ids := ARRAY['*'];
  ELSIF TG_OP = 'INSERT' THEN
    ids := ARRAY[{new}];
    ev := '{rows.created}';
  ELSIF TG_OP = 'DELETE' OR OLD.id = NEW.id THEN
    ids := ARRAY[{old}];
  ELSE
    ids := ARRAY[{old}, {new}];
  END IF;
  IF TG_OP = 'UPDATE' AND OLD.id = NEW.id THEN
{rows.events}
  END IF;
  IF ev IS NOT NULL THEN
    evkey := {new};
    rec := jsonb_build_object('at', clock_timestamp(), {rows.record})::text;
  END IF;
  FOREACH k IN ARRAY ids LOOP
    UPDATE {log_name} SET seq = seq + 1 WHERE id = 1 RETURNING seq INTO s;
    IF s IS NULL THEN
      -- The log's row was deleted by hand: a new identity makes every reader start afresh,
      -- and the mark goes on from the newest change logged.
      INSERT INTO {log_name} (id, seq, identity)
        SELECT 1, COALESCE(max(seq), 0) + 1, md5(random()::text || clock_timestamp()::text)
        FROM {changes_name}
        ON CONFLICT (id) DO UPDATE SET seq = {log_name}.seq + 1
        RETURNING seq INTO s;
    END IF;
    INSERT INTO {changes_name} (seq, notice, event, data) VALUES (
      s, '{STORE_WRITER}:' || s || ':' || k,
      CASE WHEN k = evkey THEN ev END, CASE WHEN k = evkey THEN rec END);
    IF s % 128 = 0 THEN
      -- The newest changes are kept, and every one a webhook has not taken yet; a reader
      -- further behind starts afresh.
      DELETE FROM {changes_name} WHERE seq <= LEAST(
        s - {KEEP_CHANGES}, (SELECT min(taken) FROM {hooks_name}));
    END IF;
    PERFORM pg_notify('{channel}', '{STORE_WRITER}:' || s || ':' || k);
  END LOOP;
  RETURN NULL;
END
"""


# `search_path` as the function is made with it, as `pg_proc.proconfig` keeps it.
_FUNCTION_CONFIG: Final = "search_path=pg_catalog, pg_temp"


def _ensure_function(
    connection: sa.Connection, schema: str, name: str, qualified: str, body: str
) -> int:
    """The oid of the log's function, made or replaced only when its source, its
    `SECURITY DEFINER` or its `search_path` differ from this release's."""
    read = sa.text(
        "SELECT p.oid::bigint, p.prosrc, p.prosecdef, array_to_string(p.proconfig, ';') "
        "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = :schema AND p.proname = :name AND p.pronargs = 0"
    )
    row = connection.execute(read, {"schema": schema, "name": name}).first()
    if row is not None and (row[1], row[2], row[3]) == (body, True, _FUNCTION_CONFIG):
        return int(row[0])
    connection.execute(
        sa.text(
            f"CREATE OR REPLACE FUNCTION {qualified}() RETURNS trigger LANGUAGE plpgsql "
            f"SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $log${body}$log$"
        )
    )
    return int(connection.execute(read, {"schema": schema, "name": name}).one()[0])


@dataclasses.dataclass(frozen=True, slots=True)
class _Trigger:
    """What `pg_trigger` says of a trigger: its function, `tgtype` bits, whether it is
    deferred to commit, whether it has a `WHEN`, and (apart) how it is enabled."""

    function: int
    kind: int
    deferrable: bool
    deferred: bool
    when: bool


def _ensure_triggers(connection: sa.Connection, keys_name: str, function: str, oid: int) -> None:
    """Make the triggers of the log on `keys_name` that are missing or differ, drop an older
    release's, and enable (`ALWAYS`) those that are not: nothing when all is right."""
    quote = connection.dialect.identifier_preparer
    rows, updates, truncate = POSTGRES_TRIGGERS
    usage = " - ".join(f"'{name}'" for name in sorted(USAGE_COLUMNS))
    # tgtype bits: 1 row, 4 insert, 8 delete, 16 update, 32 truncate (after, when not 2).
    wanted = {
        rows: (
            _Trigger(oid, 13, deferrable=True, deferred=True, when=False),
            # Deferred to commit: the log's row is locked last, after every key row the
            # transaction touches, so two transactions cannot wait for each other through it.
            f"CREATE CONSTRAINT TRIGGER {quote.quote(rows)} AFTER INSERT OR DELETE "
            f"ON {keys_name} DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
            f"EXECUTE FUNCTION {function}()",
        ),
        updates: (
            _Trigger(oid, 17, deferrable=True, deferred=True, when=True),
            f"CREATE CONSTRAINT TRIGGER {quote.quote(updates)} AFTER UPDATE "
            f"ON {keys_name} DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
            f"WHEN ((to_jsonb(OLD) - {usage}) IS DISTINCT FROM (to_jsonb(NEW) - {usage}) "
            "OR (OLD.credits IS NULL) <> (NEW.credits IS NULL)) "
            f"EXECUTE FUNCTION {function}()",
        ),
        truncate: (
            _Trigger(oid, 32, deferrable=False, deferred=False, when=False),
            f"CREATE TRIGGER {quote.quote(truncate)} AFTER TRUNCATE ON {keys_name} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()",
        ),
    }
    found = {
        str(row[0]): (_Trigger(int(row[2]), int(row[3]), row[4], row[5], row[6]), str(row[1]))
        for row in connection.execute(
            sa.text(
                # tgenabled is PostgreSQL's one-byte "char": as text, not bytes.
                "SELECT tgname, tgenabled::text, tgfoid::bigint, tgtype::int, tgdeferrable, "
                "tginitdeferred, tgqual IS NOT NULL FROM pg_trigger "
                "WHERE tgrelid = to_regclass(:t) AND NOT tgisinternal"
            ),
            {"t": keys_name},
        )
    }
    # Version 2 replaces version 1 (which an older release's `setup()` may make again: its
    # entries carry no event, and are no webhook's business).
    for name in _PG_OLDER:
        if name in found:
            connection.execute(sa.text(f"DROP TRIGGER {quote.quote(name)} ON {keys_name}"))
    for name, (shape, create) in wanted.items():
        there = found.get(name)
        if there is not None and there[0] == shape:
            if there[1] != "A":
                connection.execute(
                    sa.text(f"ALTER TABLE {keys_name} ENABLE ALWAYS TRIGGER {quote.quote(name)}")
                )
            continue
        if there is not None:
            connection.execute(sa.text(f"DROP TRIGGER {quote.quote(name)} ON {keys_name}"))
        connection.execute(sa.text(create))
        connection.execute(
            sa.text(f"ALTER TABLE {keys_name} ENABLE ALWAYS TRIGGER {quote.quote(name)}")
        )


def _column_type(connection: sa.Connection, schema: str, table: str, column: str) -> str:
    return str(
        connection.execute(
            sa.text(
                "SELECT data_type FROM information_schema.columns "
                "WHERE table_schema = :s AND table_name = :t AND column_name = :c"
            ),
            {"s": schema, "t": table, "c": column},
        ).scalar_one_or_none()
    )
