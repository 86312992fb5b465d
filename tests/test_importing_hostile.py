"""`apikeys import` against hostile or damaged input: a stored imported hash that is not a
valid one, CSV files with odd encodings, huge fields and unknown values, and a key revoked
at its source after it was imported. Each is refused with a reason (or answered 401), never
a crash, a 500, a key left usable, or a hash shown."""

from __future__ import annotations

import csv
import hashlib
import json
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from passlib.hash import django_pbkdf2_sha256

from apikeys import APIKeyMiddleware, KeyManager
from apikeys.cli import main
from apikeys.errors import ConfigurationError, InvalidAPIKey, KeyRevoked
from apikeys.hashing import Hasher
from apikeys.importing import ForeignKey, Refusal, import_keys, read_csv
from apikeys.importing.foreign import IMPORTED, lookup_id, prefix_handle
from apikeys.importing.sources import MAX_CSV_LINE
from apikeys.keys import mask
from apikeys.stores.contract import KeyStore
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


# -- importing again ---------------------------------------------------------------------


async def test_if_a_key_is_revoked_at_its_source_after_import_then_importing_again_revokes_it(
    importer: KeyManager, tmp_path: Path
) -> None:
    old_key = "Rv0kEd01.aaaaBBBBccccDDDDeeeeFFFFgggg1234"
    columns = ["name", "hash", "revoked"]
    row = {"name": "leaked laptop", "hash": _sha256(old_key)}
    other = {"name": "kept", "hash": _sha256("kept.key12345678"), "revoked": "false"}
    first = _write(tmp_path / "first.csv", [{**row, "revoked": "false"}, other], columns)
    report = await import_keys(importer, read_csv(first), source="csv", full_access=True)
    (key_id,) = [record.id for record in report.imported if record.name == "leaked laptop"]
    assert (await importer.verify(old_key)).id == key_id

    # The old system revoked it since; the import runs again, as the docs suggest.
    again = _write(tmp_path / "again.csv", [{**row, "revoked": "true"}, other], columns)
    dry = await import_keys(importer, read_csv(again), source="csv", full_access=True, dry_run=True)
    assert (dry.revoked, len(dry.skipped)) == ([key_id], 1)
    assert (await importer.verify(old_key)).id == key_id  # a dry run changes nothing
    done = await import_keys(
        importer, read_csv(again), source="csv", full_access=True, actor="migration"
    )
    assert (done.imported, done.revoked, len(done.skipped)) == ([], [key_id], 1)
    assert done.to_dict()["revoked"] == 1
    with pytest.raises(KeyRevoked):
        await importer.verify(old_key)
    events = await importer.audit(key_id=key_id)
    assert [(event.action, event.actor) for event in events][-1] == ("revoked", "migration")
    # A third run finds it revoked already: skipped, nothing more in its trail.
    third = await import_keys(importer, read_csv(again), source="csv", full_access=True)
    assert (third.revoked, len(third.skipped)) == ([], 2)
    assert len(await importer.audit(key_id=key_id)) == len(events)


@pytest.mark.sqlite
def test_cli_import_again_names_the_keys_it_revoked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APIKEYS_PEPPER", TEST_PEPPER)
    store = f"sqlite:///{tmp_path / 'cli.db'}"
    columns = ["name", "hash", "revoked"]
    row = {"name": "leaked", "hash": _sha256("Rv0kEd02.aaaaBBBBccccDDDDeeeeFFFFgggg1234")}
    args = ["--store", store, "import", "--from", "csv", "--full-access"]
    first = _write(tmp_path / "first.csv", [{**row, "revoked": "no"}], columns)
    assert CliRunner().invoke(main, [*args, str(first)]).exit_code == 0
    again = _write(tmp_path / "again.csv", [{**row, "revoked": "yes"}], columns)
    dry = CliRunner().invoke(main, [*args, str(again), "--dry-run"])
    assert "Would revoke 1 key(s) imported before" in dry.output
    done = CliRunner().invoke(main, [*args, str(again), "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    (key_id,) = report["revoked_ids"]
    listed = CliRunner().invoke(main, ["--store", store, "show", key_id, "--json"])
    assert json.loads(listed.output)["status"] == "revoked"


def _good_pbkdf2(key: str) -> str:
    return django_pbkdf2_sha256.using(rounds=1000).hash(key)


# Hashes that name a salted scheme but are no valid hash of it: each could never verify.
DAMAGED_SALTED = [
    "$pbkdf2-sha256$garbage",
    "pbkdf2_sha256$x$y$z",
    "$2b$" + "x" * 1000,
    "$argon2id$x",
    "$pbkdf2-sha256$29000$x\x00$y",
    _good_pbkdf2("Nu1lHash.aaaaBBBBccccDDDDeeeeFFFFgggg1234") + "\x00",
    _good_pbkdf2("SpaceHsh.aaaaBBBBccccDDDDeeeeFFFFgggg1234") + " x",
]


async def test_a_salted_hash_that_is_no_valid_hash_of_its_scheme_is_refused_and_the_rest_imported(
    importer: KeyManager,
) -> None:
    good_key = "G00dPref.aaaaBBBBccccDDDDeeeeFFFFgggg1234"
    rows: list[ForeignKey | Refusal] = [
        ForeignKey(row, f"damaged {row}", hashed, prefix=f"Dmg{row:05d}")
        for row, hashed in enumerate(DAMAGED_SALTED, start=1)
    ]
    rows.append(ForeignKey(99, "good", _good_pbkdf2(good_key), prefix="G00dPref"))
    report = await import_keys(importer, rows, source="csv", full_access=True)
    assert [record.name for record in report.imported] == ["good"]
    assert sorted(refusal.row for refusal in report.refused) == list(
        range(1, len(DAMAGED_SALTED) + 1)
    )
    for refusal in report.refused:
        assert "no format" in refusal.reason
    assert (await importer.verify(good_key)).name == "good"


def test_a_csv_file_saved_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    # What spreadsheet programs write as "CSV UTF-8".
    path = tmp_path / "excel.csv"
    hashed = _sha256("excel.key12345678")
    path.write_bytes(f"name,hash\r\nZapier,{hashed}\r\n".encode("utf-8-sig"))
    (key,) = list(read_csv(path))
    assert isinstance(key, ForeignKey)
    assert (key.name, key.hashed) == ("Zapier", hashed)


UNREADABLE_FILES = [
    pytest.param("name,hash\nZàp,sha256:00\n".encode("latin-1"), id="latin-1"),
    pytest.param("name,hash\nZap,sha256:00\n".encode("utf-16"), id="utf-16"),
    pytest.param(b"name,hash," + b"c" * 200_000 + b"\nZap,sha256:00,x\n", id="huge-header"),
]


@pytest.mark.parametrize("content", UNREADABLE_FILES)
def test_an_unreadable_csv_file_is_a_configuration_error_naming_the_file(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "odd.csv"
    path.write_bytes(content)
    with pytest.raises(ConfigurationError, match="not a readable CSV file"):
        list(read_csv(path))


@pytest.mark.sqlite
def test_cli_import_of_an_unreadable_csv_file_blames_the_file_not_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APIKEYS_PEPPER", TEST_PEPPER)
    path = tmp_path / "odd.csv"
    path.write_bytes("name,hash\nZap,sha256:00\n".encode("utf-16"))
    store = f"sqlite:///{tmp_path / 'cli.db'}"
    result = CliRunner().invoke(
        main, ["--store", store, "import", "--from", "csv", str(path), "--full-access"]
    )
    assert result.exit_code == 1
    assert "not a readable CSV file" in result.output
    assert "key store" not in result.output


# -- the failure budget of slow hashes ---------------------------------------------------


async def test_guesses_at_a_known_old_prefix_with_a_digest_hash_never_lock_its_owner_out(
    importer: KeyManager,
) -> None:
    # djangorestframework-api-key's own format: a SHA-512 of the whole key, found by prefix.
    # A check costs what apikeys' own hash does: no CPU to bound, so no failure budget,
    # which would refuse the owner's first request (the one that re-hashes it) meanwhile.
    old_key = "Dr5fPref.aaaaBBBBccccDDDDeeeeFFFFgggg1234"
    hashed = "sha512$$" + hashlib.sha512(old_key.encode()).hexdigest()
    rows: list[ForeignKey | Refusal] = [ForeignKey(1, "drf", hashed, prefix="Dr5fPref")]
    (record,) = (await import_keys(importer, rows, source="csv", full_access=True)).imported
    for guess in range(25):  # the default budget is 10 failures a minute
        with pytest.raises(InvalidAPIKey):
            await importer.verify(f"Dr5fPref.{guess:032d}")
    assert (await importer.verify(old_key)).id == record.id
    stored = await importer.store.get(record.id)
    assert stored is not None
    assert stored.secret_hash.startswith("hmac-sha256$")


async def test_an_old_prefix_in_the_services_own_key_format_is_refused_not_imported_unusable(
    importer: KeyManager,
) -> None:
    # `ak_live.…` reads as an apikeys key (prefix `ak`): imported, it could never be found.
    own = f"{importer.prefix}_live.aaaaBBBBccccDDDDeeeeFFFFgggg1234"
    other = "Live0001.aaaaBBBBccccDDDDeeeeFFFFgggg1234"
    rows: list[ForeignKey | Refusal] = [
        ForeignKey(1, "own format", _good_pbkdf2(own), prefix=own.partition(".")[0]),
        ForeignKey(2, "other", _good_pbkdf2(other), prefix="Live0001"),
    ]
    report = await import_keys(importer, rows, source="csv", full_access=True)
    assert [record.name for record in report.imported] == ["other"]
    assert [refusal.row for refusal in report.refused] == [1]
    assert f"'{importer.prefix}_'" in report.refused[0].reason
    assert (await importer.verify(other)).name == "other"


# -- the options and the size of what is read ----------------------------------------------


@pytest.mark.sqlite
@pytest.mark.parametrize(
    ("source", "column"), [("csv", "hash"), ("csv", "HASH"), ("drf-api-key", "hashed_key")]
)
def test_cli_import_refuses_the_hash_column_as_the_workspace_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, column: str
) -> None:
    # A workspace is shown in every list, audit event and webhook body; a hash never.
    monkeypatch.setenv("APIKEYS_PEPPER", TEST_PEPPER)
    store = f"sqlite:///{tmp_path / 'cli.db'}"
    path = _write(
        tmp_path / "keys.csv",
        [{"name": "Zap", "hash": _sha256("Zap00001.aaaaBBBBccccDDDDeeeeFFFFgggg1234")}],
        ["name", "hash"],
    )
    location = str(path) if source == "csv" else f"sqlite:///{tmp_path / 'drf.db'}"
    args = ["--store", store, "import", "--from", source, location, "--full-access"]
    result = CliRunner().invoke(main, [*args, "--workspace-column", column])
    assert result.exit_code == 2, result.output
    assert "holds the keys' hashes" in result.output
    listed = CliRunner().invoke(main, ["--store", store, "list", "--json"])
    assert json.loads(listed.output) == []
    with pytest.raises(ConfigurationError, match="hashes"):
        list(read_csv(path, workspace_column=column))


def test_a_csv_line_over_the_bound_is_refused_as_it_is_read_not_held_whole(
    tmp_path: Path,
) -> None:
    # One line of 8 times the bound: read whole, it alone would take 8 MiB.
    path = tmp_path / "one-line.csv"
    path.write_text("name,hash\n" + "a" * (MAX_CSV_LINE * 8) + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(ConfigurationError, match="line 2 is longer than"):
            list(read_csv(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * MAX_CSV_LINE
