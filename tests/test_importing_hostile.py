"""`apikeys import` against hostile or damaged input: a stored imported hash that is not a
valid one, CSV files with odd encodings, huge fields and unknown values, and a key revoked
at its source after it was imported. Each is refused with a reason (or answered 401), never
a crash, a 500, a key left usable, or a hash shown."""

from __future__ import annotations

import csv
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from apikeys import APIKeyMiddleware, KeyManager
from apikeys.errors import InvalidAPIKey
from apikeys.hashing import Hasher
from apikeys.importing import Refusal, import_keys, read_csv
from apikeys.importing.foreign import IMPORTED, lookup_id, prefix_handle
from apikeys.keys import mask
from apikeys.stores.base import KeyStore
from apikeys.types import ACTIVE, KeyRecord, StoredKey, utcnow
from tests.conftest import TEST_PEPPER


@pytest.fixture
async def importer(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(store, hasher=Hasher(TEST_PEPPER)) as manager:
        yield manager


def _write(path: Path, rows: list[dict[str, str]], columns: list[str]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _sha256(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


# -- a stored imported hash that is not a valid one ------------------------------------

DAMAGED_HASHES = [
    "sha256:zz",
    "sha256:" + "0" * 63 + "g",
    "sha512:" + "0" * 12,
    "sha512$$nothex",
    "$pbkdf2-sha256$garbage",
    "pbkdf2_sha256$x$y$z",
    "",
]


async def _with_damaged_hash(manager: KeyManager, old_prefix: str, damaged: str) -> str:
    """A record found by `old_prefix` whose stored hash is `imported$<damaged>`: a row
    edited by hand, or damaged, in the store."""
    secret = await manager.import_lookup_secret()
    assert secret is not None
    key_id = lookup_id(secret, prefix_handle(old_prefix))
    record = KeyRecord(
        id=key_id,
        name="damaged",
        workspace="acme",
        prefix=mask(manager.prefix, key_id),
        access="full",
        scopes=(),
        state=ACTIVE,
        rate_limit=None,
        created_at=utcnow(),
    )
    await manager.store.insert(StoredKey(record, IMPORTED + damaged))
    return key_id


@pytest.mark.parametrize("damaged", DAMAGED_HASHES)
async def test_if_a_stored_imported_hash_is_damaged_then_its_key_is_invalid_never_an_error(
    importer: KeyManager, damaged: str
) -> None:
    await _with_damaged_hash(importer, "Dm4gEd01", damaged)
    with pytest.raises(InvalidAPIKey):
        await importer.verify("Dm4gEd01.aaaaBBBBccccDDDDeeeeFFFFgggg1234")


async def test_through_the_middleware_a_damaged_imported_hash_is_401_not_503(
    importer: KeyManager,
) -> None:
    await _with_damaged_hash(importer, "Dm4gEd02", "sha256:zz")

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        raise AssertionError("a request with a damaged key's token went through")

    protected = APIKeyMiddleware(app, manager=importer, protect="/api/")
    transport = httpx.ASGITransport(app=protected)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.get(
            "/api/v1/contacts",
            headers={"Authorization": "Bearer Dm4gEd02.aaaaBBBBccccDDDDeeeeFFFFgggg1234"},
        )
    assert response.status_code == 401
    assert response.json()["code"] == "invalid_api_key"


# -- CSV files ---------------------------------------------------------------------------


def test_if_a_time_column_holds_a_hash_then_the_refusal_does_not_show_it(tmp_path: Path) -> None:
    # The columns of a file written in another order than its header says.
    hashed = _sha256("shifted.key12345678")
    path = _write(
        tmp_path / "shifted.csv",
        [{"name": "shifted", "expires_at": hashed, "hash": "2030-01-01T00:00:00Z"}],
        ["name", "expires_at", "hash"],
    )
    (refusal,) = list(read_csv(path))
    assert isinstance(refusal, Refusal)
    assert "unreadable time" in refusal.reason
    assert "expires_at" in refusal.reason
    assert hashed not in refusal.reason
    assert hashed[len("sha256:") :] not in refusal.reason


def test_if_a_time_is_past_year_9999_in_utc_then_its_row_is_refused(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "late.csv",
        [
            {
                "name": "late",
                "hash": _sha256("late.key12345678"),
                "expires_at": "9999-12-31T23:59:59-01:00",
            }
        ],
        ["name", "hash", "expires_at"],
    )
    (refusal,) = list(read_csv(path))
    assert isinstance(refusal, Refusal)
    assert "unreadable time in expires_at" in refusal.reason


REVOKED_VALUES = [
    ("true", "revoked"),
    ("TRUE", "revoked"),
    ("1", "revoked"),
    (" yes ", "revoked"),
    ("false", "active"),
    ("0", "active"),
    ("no", "active"),
    ("", "active"),
    # Not true or false: a revocation time, a spreadsheet's words. Refused, never active.
    ("2024-01-01T00:00:00Z", None),
    ("on", None),
    ("x", None),
    ("revoked_at", None),
]


async def test_a_revoked_value_that_is_not_true_or_false_refuses_its_row_never_makes_it_active(
    importer: KeyManager, tmp_path: Path
) -> None:
    rows = [
        {"name": f"key {number}", "hash": _sha256(f"key.{number:012d}"), "revoked": value}
        for number, (value, _) in enumerate(REVOKED_VALUES)
    ]
    path = _write(tmp_path / "revoked.csv", rows, ["name", "hash", "revoked"])
    report = await import_keys(importer, read_csv(path), source="csv", full_access=True)
    refused = {refusal.name: refusal.reason for refusal in report.refused}
    status = {record.name: record.status for record in await importer.list()}
    for number, (value, expected) in enumerate(REVOKED_VALUES):
        name = f"key {number}"
        if expected is None:
            assert name not in status, (value, status)
            assert "revoked" in refused[name]
        else:
            assert status[name] == expected, value
    assert len(report.imported) == sum(1 for _, expected in REVOKED_VALUES if expected)
