"""How a row of the keys table becomes a `KeyRecord`: the column order of every SELECT and
RETURNING, and the row decoders (through SQLAlchemy's types, or straight from a driver)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Final, cast

from apikeys.policies import load_metadata
from apikeys.stores.sql.schema import load_scopes
from apikeys.types import KeyRecord, StoredKey

__all__ = ["FIELDS", "SECRET_HASH", "interned", "record_from_row", "stored_from_raw", "utc"]

# Column order of every SELECT and RETURNING: the fields of KeyRecord, then the hash.
FIELDS: Final = (
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

SECRET_HASH: Final = FIELDS.index("secret_hash")
"""Where the hash of the secret is in a row of `FIELDS`."""


def interned(text: Any) -> Any:
    """`text` interned: the values many keys hold alike (workspace, access, state, limits)
    are kept once, not once per cached key, as a driver returns them."""
    return text if text is None else sys.intern(text)


def record_from_row(row: Sequence[Any]) -> KeyRecord:
    return KeyRecord(
        id=row[0],
        name=row[1],
        workspace=interned(row[2]),
        prefix=row[3],
        access=interned(row[4]),
        scopes=row[5],
        state=interned(row[6]),
        rate_limit=interned(row[7]),
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
        credit_refill=interned(row[20]),
        credits_refilled_at=row[21],
    )


def sqlite_time(value: Any) -> datetime | None:
    if value is None:
        return None
    return datetime.fromisoformat(value).replace(tzinfo=UTC)


def stored_from_raw(row: Sequence[Any], *, sqlite: bool) -> StoredKey:
    """A `StoredKey` from a row read with the bare driver, without SQLAlchemy's types.

    asyncpg already returns `timestamptz` as aware UTC datetimes; sqlite3 returns the text
    `UTCDateTime` stored.
    """
    time = sqlite_time if sqlite else utc
    record = KeyRecord(
        id=row[0],
        name=row[1],
        workspace=interned(row[2]),
        prefix=row[3],
        access=interned(row[4]),
        scopes=load_scopes(row[5]),
        state=interned(row[6]),
        rate_limit=interned(row[7]),
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
        credit_refill=interned(row[20]),
        credits_refilled_at=time(row[21]),
    )
    return StoredKey(record=record, secret_hash=row[13])


def utc(value: Any) -> datetime | None:
    if value is None or value.tzinfo is UTC:
        return cast(datetime | None, value)
    return cast(datetime, value.astimezone(UTC))
