"""How a row of the keys table becomes a `KeyRecord` and back: the column order of every
SELECT and RETURNING, the row decoders (through SQLAlchemy's types, or straight from a
driver) and the values an INSERT writes. All of them derive from the field table
(`apikeys.types.RECORD_FIELDS`) through the keys table's columns (`record_columns`); rows
are decoded on a miss of the key cache only, never per request."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final, cast

from apikeys.policies import load_metadata
from apikeys.stores.sql.schema import load_scopes, record_columns
from apikeys.types import RECORD_FIELDS, KeyRecord, Kind, StoredKey

__all__ = [
    "FIELDS",
    "SECRET_HASH",
    "interned",
    "record_from_row",
    "row_values",
    "stored_from_raw",
    "utc",
]

FIELDS: Final = tuple(column.name for column in record_columns())
"""Column order of every SELECT and RETURNING: the keys table's, the fields of `KeyRecord`
in order with the hash of the secret among them."""

SECRET_HASH: Final = FIELDS.index("secret_hash")
"""Where the hash of the secret is in a row of `FIELDS`."""

# Where each field of `RECORD_FIELDS` is in a row of `FIELDS`.
_AT: Final = tuple(FIELDS.index(field.name) for field in RECORD_FIELDS)


def interned(text: Any) -> Any:
    """`text` interned: the values many keys hold alike (workspace, access, state, limits)
    are kept once, not once per cached key, as a driver returns them."""
    return text if text is None else sys.intern(text)


def _as_is(value: Any) -> Any:
    return value


def sqlite_time(value: Any) -> datetime | None:
    if value is None:
        return None
    return datetime.fromisoformat(value).replace(tzinfo=UTC)


def utc(value: Any) -> datetime | None:
    if value is None or value.tzinfo is UTC:
        return cast(datetime | None, value)
    return cast(datetime, value.astimezone(UTC))


def _decoders(raw: Mapping[Kind, Callable[[Any], Any]]) -> tuple[Callable[[Any], Any], ...]:
    """Per field of `RECORD_FIELDS`: how its column's value becomes the record's."""
    return tuple(
        interned if field.shared else raw.get(field.kind, _as_is) for field in RECORD_FIELDS
    )


_TYPED: Final = _decoders({})
# The bare drivers' values: lists and objects are the JSON text stored; asyncpg returns
# `timestamptz` as aware UTC datetimes, sqlite3 the text `UTCDateTime` stored.
_RAW: Final[Mapping[Kind, Callable[[Any], Any]]] = {
    Kind.NAMES: load_scopes,
    Kind.OBJECT: load_metadata,
}
_POSTGRES: Final = _decoders({**_RAW, Kind.TIME: utc})
_SQLITE: Final = _decoders({**_RAW, Kind.TIME: sqlite_time})


def record_from_row(row: Sequence[Any]) -> KeyRecord:
    """A record from a row of `FIELDS` read through SQLAlchemy's column types."""
    return KeyRecord(*[decode(row[at]) for at, decode in zip(_AT, _TYPED, strict=True)])


def stored_from_raw(row: Sequence[Any], *, sqlite: bool) -> StoredKey:
    """A `StoredKey` from a row of `FIELDS` read with the bare driver, without
    SQLAlchemy's types."""
    decoders = _SQLITE if sqlite else _POSTGRES
    record = KeyRecord(*[decode(row[at]) for at, decode in zip(_AT, decoders, strict=True)])
    return StoredKey(record=record, secret_hash=row[SECRET_HASH])


def row_values(stored: StoredKey) -> dict[str, Any]:
    """The keys table's row of `stored`, by column, as an INSERT writes it."""
    record = stored.record
    values = {field.name: getattr(record, field.name) for field in RECORD_FIELDS}
    return {name: stored.secret_hash if name == "secret_hash" else values[name] for name in FIELDS}
