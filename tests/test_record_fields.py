"""The record's one field table (`apikeys.types.RECORD_FIELDS`): `KeyRecord` declares each
field once, and the stores' layouts derived from it are the layouts written before it
existed (no migration): the SQL columns, the Redis hash, the events' snapshots. A field
added since (`environment`) is a column at the end with a default, and a row or hash
written without it reads as that default."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import types
import typing
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateTable

from apikeys.fields import KEY_FIELDS
from apikeys.types import RECORD_FIELDS, KeyRecord, Kind, Role, StoredKey
from apikeys.webhooks.events import record_from_snapshot

# The keys table as `CREATE TABLE` wrote it before the columns were derived from the table.
POSTGRES_KEYS_TABLE = """
CREATE TABLE apikeys_keys (
    id VARCHAR(12) COLLATE "C" NOT NULL,
    name VARCHAR NOT NULL,
    workspace VARCHAR NOT NULL,
    prefix VARCHAR NOT NULL,
    access VARCHAR(16) NOT NULL,
    scopes TEXT NOT NULL,
    state VARCHAR(16) NOT NULL,
    rate_limit VARCHAR,
    created_at TIMESTAMP WITH TIME ZONE NOT NULL,
    expires_at TIMESTAMP WITH TIME ZONE,
    last_used_at TIMESTAMP WITH TIME ZONE,
    request_count BIGINT DEFAULT '0' NOT NULL,
    revoked_at TIMESTAMP WITH TIME ZONE,
    secret_hash TEXT NOT NULL,
    replaces VARCHAR(12),
    replaced_by VARCHAR(12),
    owner VARCHAR,
    metadata TEXT,
    allowed_ips TEXT,
    credits BIGINT,
    credit_refill VARCHAR(32),
    credits_refilled_at TIMESTAMP WITH TIME ZONE,
    imported_prefix VARCHAR(64),
    environment VARCHAR(16) DEFAULT 'live' NOT NULL,
    identity VARCHAR(64),
    PRIMARY KEY (id)
)
"""
SQLITE_KEYS_TABLE = """
CREATE TABLE apikeys_keys (
    id VARCHAR(12) NOT NULL,
    name VARCHAR NOT NULL,
    workspace VARCHAR NOT NULL,
    prefix VARCHAR NOT NULL,
    access VARCHAR(16) NOT NULL,
    scopes TEXT NOT NULL,
    state VARCHAR(16) NOT NULL,
    rate_limit VARCHAR,
    created_at DATETIME NOT NULL,
    expires_at DATETIME,
    last_used_at DATETIME,
    request_count BIGINT DEFAULT '0' NOT NULL,
    revoked_at DATETIME,
    secret_hash TEXT NOT NULL,
    replaces VARCHAR(12),
    replaced_by VARCHAR(12),
    owner VARCHAR,
    metadata TEXT,
    allowed_ips TEXT,
    credits BIGINT,
    credit_refill VARCHAR(32),
    credits_refilled_at DATETIME,
    imported_prefix VARCHAR(64),
    environment VARCHAR(16) DEFAULT 'live' NOT NULL,
    identity VARCHAR(64),
    PRIMARY KEY (id)
)
"""

# The Python type each kind holds, as `KeyRecord` annotates it (None aside).
KIND_TYPES = {
    Kind.TEXT: str,
    Kind.NAMES: tuple,
    Kind.TIME: datetime,
    Kind.COUNT: int,
    Kind.OBJECT: Mapping,
}


def _base(hint: typing.Any) -> type:
    """`str | None` is `str`, `tuple[str, ...]` is `tuple`, a `Literal` of texts is `str`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) is typing.Literal:
        return str
    base = typing.get_origin(hint) or hint
    assert isinstance(base, type)
    return base


def _record(**changes: object) -> KeyRecord:
    record = KeyRecord(
        id="abcdefABCDEF",
        name="billing",
        workspace="acme",
        prefix="ak_abcdefABCDEF_…",
        access="restricted",
        scopes=("items:read", "items:write"),
        state="disabled",
        rate_limit="burst=10/second, daily=1000/day",
        created_at=datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=UTC),
        expires_at=datetime(2027, 1, 1, tzinfo=UTC),
        last_used_at=datetime(2026, 2, 1, tzinfo=UTC),
        request_count=42,
        revoked_at=None,
        replaces="zyxwvuZYXWVU",
        replaced_by=None,
        owner="user@example.com",
        metadata={"plan": "pro", "seats": [1, 2], "ü": None},
        allowed_ips=("10.0.0.0/8", "2001:db8::/32"),
        credits=0,
        credit_refill="1000/day",
        credits_refilled_at=datetime(2026, 2, 1, tzinfo=UTC),
        environment="test",
    )
    return dataclasses.replace(record, **changes)


def test_every_field_of_the_record_is_declared_once_with_a_kind_its_type_agrees_with() -> None:
    declared = dataclasses.fields(KeyRecord)
    assert [field.name for field in RECORD_FIELDS] == [field.name for field in declared]
    hints = typing.get_type_hints(KeyRecord)
    for entry in RECORD_FIELDS:
        assert issubclass(_base(hints[entry.name]), KIND_TYPES[entry.kind]), entry.name
        # A field a key may lack is one the stores keep as NULL or leave out.
        optional = type(None) in typing.get_args(hints[entry.name])
        assert not (optional and entry.required), entry.name
        assert entry.has_default or entry.required or optional, entry.name


def test_the_editable_fields_are_the_entries_that_name_who_changes_them() -> None:
    assert list(KEY_FIELDS) == [f.name for f in RECORD_FIELDS if f.changed_by is not None]
    assert KEY_FIELDS["allowed_ips"].changed_by is Role.OPERATOR
    assert KEY_FIELDS["allowed_ips"].kind is Kind.NAMES
    assert "state" not in KEY_FIELDS
    assert "request_count" not in KEY_FIELDS


def test_to_dict_shows_the_contract_fields_in_their_order() -> None:
    assert list(_record().to_dict()) == [
        "id",
        "name",
        "workspace",
        "prefix",
        "access",
        "scopes",
        "status",
        "rate_limit",
        "rate_limits",
        "created_at",
        "expires_at",
        "last_used_at",
        "request_count",
        "revoked_at",
        "replaces",
        "replaced_by",
        "owner",
        "metadata",
        "allowed_ips",
        "credits",
        "credit_refill",
        "imported_prefix",
        "environment",
        "identity",
    ]
    data = _record().to_dict()
    assert data["created_at"] == "2026-01-01T12:00:00.123456Z"
    assert data["scopes"] == ["items:read", "items:write"]
    assert data["status"] == "disabled"
    assert data["rate_limits"] == [
        {"name": "burst", "limit": "10/second"},
        {"name": "daily", "limit": "1000/day"},
    ]


@pytest.mark.parametrize(
    ("dialect", "expected"),
    [(postgresql.dialect(), POSTGRES_KEYS_TABLE), (sqlite.dialect(), SQLITE_KEYS_TABLE)],
    ids=["postgresql", "sqlite"],
)
def test_the_derived_keys_table_is_the_table_of_before(dialect: sa.Dialect, expected: str) -> None:
    from apikeys.stores.sql.schema import keys_table

    table = keys_table("apikeys_keys", sa.MetaData())
    written = str(CreateTable(table).compile(dialect=dialect))
    assert _lines(written) == _lines(expected)


def _lines(ddl: str) -> list[str]:
    return [line.strip() for line in ddl.strip().splitlines()]


@pytest.mark.parametrize(
    "record",
    [
        _record(),
        _record(metadata={}, allowed_ips=(), credits=None, credit_refill=None, owner=None),
        _record(
            access="full",
            scopes=(),
            rate_limit=None,
            expires_at=None,
            state="revoked",
            revoked_at=datetime(2026, 3, 1, tzinfo=UTC),
        ),
    ],
    ids=["every field", "no policies", "full access, revoked"],
)
def test_an_event_snapshot_gives_back_the_record(record: KeyRecord) -> None:
    row = {name: value for name, value in json.loads(json.dumps(_as_row(record))).items()}
    assert record_from_snapshot(row) == record
    assert record_from_snapshot(row).metadata == record.metadata


def _as_row(record: KeyRecord) -> dict[str, object]:
    """The record as the keys table's row in JSON (SQLite's `json_object` of its columns)."""
    row: dict[str, object] = {}
    for entry in RECORD_FIELDS:
        value = getattr(record, entry.name)
        if entry.kind is Kind.TIME:
            value = None if value is None else value.replace(tzinfo=None).isoformat(" ")
        elif entry.kind is Kind.NAMES:
            value = json.dumps(list(value)) if value or entry.required else None
        elif entry.kind is Kind.OBJECT:
            value = json.dumps(dict(value)) if value else None
        row[entry.name] = value
    return row


# A key's hash as the Redis store wrote it before its codec was derived from the table.
REDIS_HASH = {
    "id": "abcdefABCDEF",
    "name": "billing",
    "workspace": "acme",
    "prefix": "ak_abcdefABCDEF_…",
    "access": "restricted",
    "scopes": '["items:read","items:write"]',
    "state": "disabled",
    "rate_limit": "burst=10/second, daily=1000/day",
    "created_at": "1767268800123456",
    "expires_at": "1798761600000000",
    "last_used_at": "1769904000000000",
    "request_count": "42",
    "replaces": "zyxwvuZYXWVU",
    "owner": "user@example.com",
    "metadata": '{"plan":"pro","seats":[1,2],"ü":null}',
    "allowed_ips": '["10.0.0.0/8","2001:db8::/32"]',
    "credits": "0",
    "credit_refill": "1000/day",
    "credits_refilled_at": "1769904000000000",
    "environment": "test",
    "secret_hash": "sha256$hash",
}
# A key with nothing but what a key must have: every other field is left out of its hash.
REDIS_BARE_HASH = {
    "id": "abcdefABCDEF",
    "name": "billing",
    "workspace": "acme",
    "prefix": "ak_abcdefABCDEF_…",
    "access": "full",
    "scopes": "[]",
    "state": "active",
    "created_at": "1767268800123456",
    "request_count": "0",
    "environment": "live",
    "secret_hash": "sha256$hash",
}
BARE = {
    "access": "full",
    "scopes": (),
    "state": "active",
    "rate_limit": None,
    "expires_at": None,
    "last_used_at": None,
    "request_count": 0,
    "replaces": None,
    "owner": None,
    "metadata": {},
    "allowed_ips": (),
    "credits": None,
    "credit_refill": None,
    "credits_refilled_at": None,
    "environment": "live",
}


@pytest.mark.parametrize(
    ("changes", "expected"),
    [({}, REDIS_HASH), (BARE, REDIS_BARE_HASH)],
    ids=["every field", "bare"],
)
def test_the_redis_hash_of_a_key_is_the_layout_of_before_and_reads_back(
    changes: dict[str, object], expected: dict[str, str]
) -> None:
    from apikeys.stores.redis.codec import decode, encode

    stored = StoredKey(_record(**changes), "sha256$hash")
    flat = encode(stored)
    written = dict(zip(flat[::2], flat[1::2], strict=True))
    assert written == expected
    assert decode(written) == stored


async def test_a_key_round_trips_through_a_redis_hash(
    redis_url: str, redis_key_prefix: str
) -> None:
    from redis.asyncio import Redis

    from apikeys.stores.redis import RedisStore

    store = RedisStore.from_url(redis_url, key_prefix=redis_key_prefix)
    admin = Redis.from_url(redis_url, decode_responses=True)
    try:
        for changes, expected in ((BARE, REDIS_BARE_HASH), ({}, REDIS_HASH)):
            record = _record(**changes)
            await store.insert(StoredKey(record, "sha256$hash"))
            assert await admin.hgetall(store.key_name(record.id)) == expected
            assert await store.get(record.id) == StoredKey(record, "sha256$hash")
            await admin.delete(store.key_name(record.id))
    finally:
        await admin.aclose()
        await store.aclose()


@pytest.mark.parametrize("record", [_record(), _record(**BARE)], ids=["every field", "bare"])
async def test_a_key_round_trips_through_a_sql_row(tmp_path: Path, record: KeyRecord) -> None:
    from apikeys.stores.sql.rows import FIELDS, row_values, stored_from_raw
    from apikeys.stores.sql.store import SQLStore

    stored = StoredKey(record, "sha256$hash")
    assert list(row_values(stored)) == list(FIELDS)
    store = SQLStore(f"sqlite+aiosqlite:///{tmp_path / 'keys.db'}")
    try:
        await store.setup()
        await store.insert(stored)
        assert await store.get(record.id) == stored
        assert await store.list(record.workspace) == [record]
    finally:
        await store.aclose()
    with sqlite3.connect(tmp_path / "keys.db") as db:
        columns = ", ".join(FIELDS)  # names of the table, not input
        row = db.execute(f"SELECT {columns} FROM apikeys_keys").fetchone()  # noqa: S608
    assert stored_from_raw(row, sqlite=True) == stored
