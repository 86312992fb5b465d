"""The SQL backend, on SQLite or PostgreSQL (SQLAlchemy 2 async).

- `store`: `SQLStore`, the key store; `engine`: the engines and their connection settings;
  `schema`: the tables, indexes and triggers that `setup()` makes; `log`: the change log the
  triggers write and the cache reads; `listing`, `once`: keyset pages and one-time values.
- `webhooks`: `SQLWebhooks`, endpoints and deliveries in the same database.
- `postgres_channel`, `sqlite_channel`: the change channels (LISTEN/NOTIFY on PostgreSQL, the
  database file's own change log on SQLite).
"""

from __future__ import annotations

from apikeys.stores.sql.store import (
    DEFAULT_TABLE_NAME,
    SQLStore,
    UTCDateTime,
    async_url,
    audit_table,
    changes_table,
    create_concurrently,
    create_private_file,
    create_tables,
    keys_table,
    metadata,
    readers_table,
    usage_batches_table,
)

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
