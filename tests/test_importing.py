"""`apikeys import`: keys of djangorestframework-api-key (a real database, made by that
package in `tests/drf_project.py`) and of CSV files keep working with their old key strings,
and are re-hashed with apikeys' own scheme on first use."""

from __future__ import annotations

import asyncio
import csv
import hashlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result
from hypothesis import given, settings
from hypothesis import strategies as st
from passlib.hash import argon2, bcrypt, django_argon2, django_pbkdf2_sha256, pbkdf2_sha256

from apikeys import APIKeyMiddleware, KeyManager, store_from_url
from apikeys.cli import main
from apikeys.errors import (
    ConfigurationError,
    InvalidAPIKey,
    InvalidKeyParameters,
    KeyExpired,
    KeyRevoked,
    MalformedAPIKey,
)
from apikeys.hashing import Hasher
from apikeys.importing import ForeignKey, foreign, import_keys, read_csv, read_drf
from apikeys.keys import parse_key
from apikeys.stores.contract import KeyStore
from tests.conftest import TEST_PEPPER
from tests.drf_databases import drf_database  # noqa: F401 - the `drf` fixture
from tests.public_surface import assert_all_is_complete, assert_exports_are_documented


@pytest.fixture
async def importer(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(store, hasher=Hasher(TEST_PEPPER)) as manager:
        yield manager


async def _import_drf(manager: KeyManager, url: str, **options: Any) -> Any:
    options.setdefault("workspace", "acme")
    if "scopes" not in options:
        options.setdefault("full_access", True)
    return await import_keys(manager, await read_drf(url), source="drf-api-key", **options)


async def test_if_drf_database_imported_then_old_keys_work_as_they_are(
    importer: KeyManager, drf: tuple[str, dict[str, str]]
) -> None:
    url, keys = drf
    report = await _import_drf(importer, url)
    assert (len(report.imported), report.skipped, report.refused) == (len(keys), [], [])
    for label in ("active", "expiring", "pbkdf2_sha256", "argon2", "bcrypt_sha256"):
        record = await importer.verify(keys[label])
        assert record.workspace == "acme"
        assert record.access == "full"
    names = {record.name for record in await importer.list("acme")}
    assert {"Zapier", "Make.com", "old laptop", "trial", "legacy argon2"} <= names
    with pytest.raises(KeyRevoked):
        await importer.verify(keys["revoked"])
    with pytest.raises(KeyExpired):
        await importer.verify(keys["expired"])
    # A wrong secret for a known old prefix, and an unknown old prefix: the same answer.
    prefix, _, secret = keys["active"].partition(".")
    for wrong in (f"{prefix}.{secret[::-1]}", f"ZZZZZZZZ.{secret}", f"{prefix}.{secret}x"):
        with pytest.raises(InvalidAPIKey):
            await importer.verify(wrong)


async def test_if_imported_key_used_then_rehashed_once_to_apikeys_hash(
    importer: KeyManager, drf: tuple[str, dict[str, str]]
) -> None:
    url, keys = drf
    await _import_drf(importer, url)
    for label in ("active", "pbkdf2_sha256"):
        record = await importer.verify(keys[label])
        before = await importer.store.get(record.id)
        assert before is not None
        assert before.secret_hash.startswith("hmac-sha256$")  # rehashed on first use
        assert keys[label] not in before.secret_hash
        again = await importer.verify(keys[label])
        assert again.id == record.id
        events = await importer.audit(key_id=record.id)
        assert [event.action for event in events] == ["imported", "rehashed"]
        assert events[0].changes["imported_from"] == "drf-api-key"
        assert events[1].changes == {"scheme": "hmac-sha256"}
        assert keys[label] not in json.dumps([event.to_dict() for event in events])


async def test_if_imported_again_then_skipped_and_nothing_changes(
    importer: KeyManager, drf: tuple[str, dict[str, str]]
) -> None:
    url, keys = drf
    first = await _import_drf(importer, url)
    await importer.verify(keys["active"])
    second = await _import_drf(importer, url)
    assert second.imported == []
    assert sorted(second.skipped) == sorted(record.id for record in first.imported)
    assert len(await importer.list()) == len(keys)
    assert (await importer.verify(keys["active"])).name == "Zapier"


async def test_if_dry_run_then_reported_and_nothing_stored(
    importer: KeyManager, drf: tuple[str, dict[str, str]]
) -> None:
    url, keys = drf
    report = await _import_drf(importer, url, dry_run=True)
    assert report.dry_run
    assert len(report.imported) == len(keys)
    assert await importer.list() == []
    assert await importer.audit() == []
    with pytest.raises((MalformedAPIKey, InvalidAPIKey)):
        await importer.verify(keys["active"])


async def test_imported_keys_keep_fields_and_roll_to_apikeys_format(
    importer: KeyManager, drf: tuple[str, dict[str, str]]
) -> None:
    url, keys = drf
    await _import_drf(importer, url, scopes=["contacts:read"])
    records = {record.name: record for record in await importer.list("acme")}
    assert records["old laptop"].status == "revoked"
    assert records["trial"].status == "expired"
    assert records["Make.com"].expires_at is not None
    assert records["Zapier"].expires_at is None
    assert records["Zapier"].scopes == ("contacts:read",)
    assert records["Zapier"].created_at < records["Make.com"].created_at
    rolled = await importer.roll(records["Zapier"].id)
    assert parse_key(rolled.key).id == rolled.record.id
    assert (await importer.verify(rolled.key)).name == "Zapier"
    assert (await importer.verify(keys["active"])).id == records["Zapier"].id  # in its grace
    await importer.revoke(records["Make.com"].id)
    with pytest.raises(KeyRevoked):
        await importer.verify(keys["expiring"])


async def test_if_store_holds_no_imported_keys_then_foreign_tokens_are_malformed(
    importer: KeyManager,
) -> None:
    looked_up: list[str] = []
    store = importer.store
    get, get_for_verification = store.get, store.get_for_verification

    async def counting_get(key_id: str) -> Any:
        looked_up.append(key_id)
        return await get(key_id)

    async def counting_get_for_verification(key_id: str) -> Any:
        looked_up.append(key_id)
        return await get_for_verification(key_id)

    store.get = counting_get  # type: ignore[method-assign]
    store.get_for_verification = counting_get_for_verification  # type: ignore[method-assign]
    for token in ("KHNhgcGJ.sXgJYYeP0OgexChAVC6sGy41SnRcfY3x", "sk_live_" + "a" * 40):
        with pytest.raises(MalformedAPIKey):
            await importer.verify(token)
    assert looked_up == []


async def test_progress_is_told_of_every_row(importer: KeyManager, tmp_path: Path) -> None:
    rows, _keys = csv_keys()
    path = _csv(tmp_path / "keys.csv", rows + [row for row, _ in REFUSED_ROWS])
    seen: list[int] = []
    await import_keys(
        importer, read_csv(path), source="csv", full_access=True, progress=seen.append
    )
    assert sum(seen) == len(rows) + len(REFUSED_ROWS)


@pytest.mark.sqlite
async def test_unknown_and_known_old_prefixes_cost_the_same_lookups(
    tmp_path: Path, drf: tuple[str, dict[str, str]]
) -> None:
    url, keys = drf
    store = store_from_url(f"sqlite:///{tmp_path / 'k.db'}")
    async with KeyManager(store, hasher=Hasher(TEST_PEPPER), cache=False) as manager:
        await _import_drf(manager, url)
        looked_up: list[str] = []
        original = store.get_for_verification

        async def counting(key_id: str) -> Any:
            looked_up.append(key_id)
            return await original(key_id)

        store.get_for_verification = counting  # type: ignore[method-assign]
        prefix, _, secret = keys["active"].partition(".")
        counts = []
        for token in (f"{prefix}.{secret[::-1]}", f"Zz9Zz9Zz.{secret}"):
            looked_up.clear()
            with pytest.raises(InvalidAPIKey):
                await manager.verify(token)
            counts.append(len(looked_up))
        assert counts[0] == counts[1] == 3 * foreign.IMPORT_SLOTS
        # The ids say nothing of the old prefix: an HMAC under the store's own secret.
        assert all(prefix not in key_id for key_id in looked_up)


@pytest.mark.sqlite
async def test_imported_slow_hash_has_the_failure_budget_of_slow_hashes(
    tmp_path: Path, drf: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, keys = drf
    hasher = Hasher(TEST_PEPPER, failure_budget=3, failure_window=3600)
    async with KeyManager(f"sqlite:///{tmp_path / 'k.db'}", hasher=hasher) as manager:
        await _import_drf(manager, url)
        checked: list[str] = []
        real = foreign.verify_foreign

        def counting(token: str, hashed: str) -> bool:
            checked.append(hashed)
            return real(token, hashed)

        monkeypatch.setattr(foreign, "verify_foreign", counting)
        prefix, _, secret = keys["argon2"].partition(".")
        for _ in range(5):
            with pytest.raises(InvalidAPIKey):
                await manager.verify(f"{prefix}.{secret[::-1]}")
        assert len(checked) == 3  # then refused without hashing, until the window ends
        with pytest.raises(InvalidAPIKey):
            await manager.verify(keys["argon2"])  # even the right key, for now
        assert len(checked) == 3


# -- CSV ---------------------------------------------------------------------------------


def _csv(path: Path, rows: list[dict[str, str]]) -> Path:
    columns = ["name", "hash", "expires_at", "prefix"]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def csv_keys() -> tuple[list[dict[str, str]], dict[str, str]]:
    """Rows in every hash format apikeys reads, and their key strings, by name."""
    keys = {
        "unkey": "unk_3ZbPfqVYyZxWUe6b7cGHBRq9",
        "sha512": "home_7f9d2c1e8b4a6f3d0e5c9b2a7f1e4d8c",
        "drf-sha512": "home_0a1b2c3d4e5f60718293a4b5c6d7e8f9",
        "pbkdf2": "Pb7xKq2M.aaaaBBBBccccDDDDeeeeFFFFgggg1234",
        "argon2-django": "Ar9yLm3N.hhhhIIIIjjjjKKKKllllMMMMnnnn5678",
        "argon2": "Pa8zQw4R.ooooPPPPqqqqRRRRssssTTTTuuuu9012",
        "bcrypt": "Bc6vTn5S.vvvvWWWWxxxxYYYYzzzz0000111122223",
        "pbkdf2-passlib": "Pp5uYr6T.AAAAbbbbCCCCddddEEEEffffGGGGhhhh",
    }
    rows = [
        {"name": "unkey", "hash": "sha256:" + hashlib.sha256(keys["unkey"].encode()).hexdigest()},
        {"name": "sha512", "hash": "sha512:" + hashlib.sha512(keys["sha512"].encode()).hexdigest()},
        {
            "name": "drf-sha512",
            "hash": "sha512$$" + hashlib.sha512(keys["drf-sha512"].encode()).hexdigest(),
            "expires_at": "2999-01-01T00:00:00Z",
        },
        {
            "name": "pbkdf2",
            "hash": django_pbkdf2_sha256.using(rounds=1000).hash(keys["pbkdf2"]),
            "prefix": "Pb7xKq2M",
        },
        {
            "name": "argon2-django",
            "hash": django_argon2.using(rounds=1, memory_cost=1024).hash(keys["argon2-django"]),
            "prefix": "Ar9yLm3N",
        },
        {
            "name": "argon2",
            "hash": argon2.using(rounds=1, memory_cost=1024).hash(keys["argon2"]),
            "prefix": "Pa8zQw4R",
        },
        {
            "name": "bcrypt",
            "hash": bcrypt.using(rounds=4).hash(keys["bcrypt"]),
            "prefix": "Bc6vTn5S",
        },
        {
            "name": "pbkdf2-passlib",
            "hash": pbkdf2_sha256.using(rounds=1000).hash(keys["pbkdf2-passlib"]),
            "prefix": "Pp5uYr6T",
        },
    ]
    return rows, keys


REFUSED_ROWS = [
    ({"name": "md5", "hash": "5f4dcc3b5aa765d61d8327deb882cf99"}, "no format"),
    ({"name": "short", "hash": "sha256:abc"}, "no format"),
    ({"name": "salted", "hash": django_pbkdf2_sha256.using(rounds=1000).hash("x.y")}, "prefix"),
    ({"name": "", "hash": "sha256:" + "0" * 64}, "name is empty"),
    ({"name": "late", "hash": "sha256:" + "1" * 64, "expires_at": "soon"}, "unreadable time"),
    ({"name": "twice", "hash": "sha256:" + "2" * 64}, None),
    ({"name": "twice again", "hash": "sha256:" + "2" * 64}, "same prefix or the same hash"),
    ({"name": "dotted", "hash": "sha256:" + "3" * 64, "prefix": "a.b"}, "prefix is"),
]


async def test_if_csv_imported_then_every_hash_format_works_and_is_rehashed(
    importer: KeyManager, tmp_path: Path
) -> None:
    rows, keys = csv_keys()
    path = _csv(tmp_path / "keys.csv", rows)
    report = await import_keys(importer, read_csv(path), source="csv", full_access=True)
    assert report.refused == []
    assert len(report.imported) == len(rows)
    for name, key in keys.items():
        record = await importer.verify(key)
        assert record.name == name
        stored = await importer.store.get(record.id)
        assert stored is not None
        assert stored.secret_hash.startswith("hmac-sha256$")
        assert (await importer.verify(key)).id == record.id
        with pytest.raises(InvalidAPIKey):
            await importer.verify(key[:-1] + ("0" if key[-1] != "0" else "1"))
    again = await import_keys(importer, read_csv(path), source="csv", full_access=True)
    assert (len(again.imported), len(again.skipped)) == (0, len(rows))


async def test_if_csv_rows_cannot_be_imported_then_each_refusal_says_why(
    importer: KeyManager, tmp_path: Path
) -> None:
    path = _csv(tmp_path / "bad.csv", [row for row, _ in REFUSED_ROWS])
    report = await import_keys(importer, read_csv(path), source="csv", full_access=True)
    assert len(report.imported) == 1
    reasons = {refusal.row: refusal.reason for refusal in report.refused}
    for line, (row, why) in enumerate(REFUSED_ROWS, start=2):
        if why is None:
            assert line not in reasons
        else:
            assert why in reasons[line], (row, reasons)
    for refusal in report.refused:
        assert "$" not in refusal.reason
        assert "sha256:" not in refusal.reason


@pytest.mark.parametrize("workspace", ["", "acme\nevil", "w" * 201])
async def test_if_workspace_is_not_a_workspace_name_then_import_is_refused_and_nothing_stored(
    importer: KeyManager, tmp_path: Path, workspace: str
) -> None:
    path = _csv(tmp_path / "keys.csv", [{"name": "a", "hash": "sha256:" + "4" * 64}])
    with pytest.raises(InvalidKeyParameters, match="workspace"):
        await import_keys(
            importer, read_csv(path), source="csv", full_access=True, workspace=workspace
        )
    assert await importer.store.list() == []


def test_a_foreign_key_repr_shows_no_hash() -> None:
    key = ForeignKey(row=1, name="n", hashed="sha256:" + "a" * 64)
    assert "a" * 64 not in repr(key)


def test_if_a_hash_backend_is_missing_then_import_and_verify_name_the_extra(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    hashed = django_argon2.using(rounds=1, memory_cost=1024).hash("Ar9yLm3N.secret")
    real = foreign._context()

    class WithoutBackend:
        """passlib's context as it is without argon2-cffi."""

        def identify(self, hashed: str) -> Any:
            return real.identify(hashed)

        def handler(self, scheme: str) -> Any:
            return SimpleNamespace(has_backend=lambda: False)

        def verify(self, *_: Any) -> bool:
            raise RuntimeError("argon2: no backends available")

    monkeypatch.setattr(foreign, "_context", WithoutBackend)
    with pytest.raises(ConfigurationError, match=r"pip install 'apikeys\[import\]'"):
        foreign.foreign_scheme(hashed)
    verdict = Hasher(TEST_PEPPER).verify("Ar9yLm3N.secret", foreign.IMPORTED + hashed)
    assert not verdict.ok  # fails closed: 401, never a 500
    assert "pip install 'apikeys[import]'" in caplog.text


def test_if_libpass_is_missing_then_the_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "passlib.context", None)
    foreign._context.cache_clear()
    try:
        with pytest.raises(ConfigurationError, match=r"pip install 'apikeys\[import\]'"):
            foreign.foreign_scheme("pbkdf2_sha256$1000$salt$hash")
    finally:
        monkeypatch.undo()
        foreign._context.cache_clear()


# -- the command line ------------------------------------------------------------------


def run(store_url: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--store", store_url, *args])


@pytest.fixture
def cli_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("APIKEYS_PEPPER", TEST_PEPPER)
    monkeypatch.delenv("APIKEYS_STORE_URL", raising=False)
    return f"sqlite:///{tmp_path / 'cli.db'}"


@pytest.mark.sqlite
def test_cli_import_drf_dry_run_then_import_then_again(
    cli_store: str, drf: tuple[str, dict[str, str]]
) -> None:
    url, keys = drf
    args = ("import", "--from", "drf-api-key", url, "--workspace", "acme")
    dry = run(cli_store, *args, "--scope", "contacts:read", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert f"Would import {len(keys)} key(s)" in dry.output
    assert "Dry run: nothing was changed." in dry.output
    assert json.loads(run(cli_store, "list", "--json").output) == []
    done = run(cli_store, *args, "--scope", "contacts:read", "--json")
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert (report["imported"], report["skipped"], report["refused"]) == (len(keys), 0, 0)
    assert {key["name"] for key in report["keys"]} >= {"Zapier", "old laptop"}
    # Each imported key keeps its old prefix (not secret: drf-api-key shows it in its admin),
    # so that a customer's "my key starting with Pb7x…" finds its new id; the secret never shows.
    assert {key["imported_prefix"] for key in report["keys"]} == {
        key.partition(".")[0] for key in keys.values()
    }
    for key in keys.values():
        assert key not in done.output
        assert key.partition(".")[2] not in done.output
    assert "sha512$$" not in done.output
    assert "pbkdf2_sha256$" not in done.output
    again = run(cli_store, *args, "--scope", "contacts:read")
    assert again.exit_code == 0, again.output
    assert f"Imported 0 key(s) into workspace 'acme'; skipped {len(keys)}" in again.output
    listed = json.loads(run(cli_store, "list", "--json").output)
    assert {key["status"] for key in listed} == {"active", "revoked", "expired"}


@pytest.mark.sqlite
def test_cli_import_csv_prints_refusals_with_their_reasons(cli_store: str, tmp_path: Path) -> None:
    path = _csv(tmp_path / "bad.csv", [row for row, _ in REFUSED_ROWS])
    result = run(cli_store, "import", "--from", "csv", str(path), "--full-access")
    assert result.exit_code == 0, result.output
    assert "Imported 1 key(s)" in result.output
    assert f"refused {len(REFUSED_ROWS) - 1}." in result.output
    assert "refused row 4 ('salted'): a salted hash cannot find its key" in result.output


@pytest.mark.sqlite
def test_cli_import_prints_each_old_prefix_beside_its_new_id_and_show_keeps_it(
    cli_store: str, tmp_path: Path
) -> None:
    rows, keys = csv_keys()
    path = _csv(tmp_path / "keys.csv", rows)
    result = run(cli_store, "import", "--from", "csv", str(path), "--full-access")
    assert result.exit_code == 0, result.output
    listed = {key["name"]: key for key in json.loads(run(cli_store, "list", "--json").output)}
    for row in rows:
        record = listed[row["name"]]
        assert record["imported_prefix"] == row.get("prefix")
        if "prefix" in row:
            line = next(line for line in result.output.splitlines() if row["prefix"] in line)
            assert line.split() == [row["prefix"], record["id"], row["name"]]
            shown = run(cli_store, "show", record["id"])
            # `label: value` lines, the values aligned after the longest label.
            assert f"old prefix:  {row['prefix']}" in shown.output
    for key in keys.values():
        assert (key.partition(".")[2] or key) not in result.output


@pytest.mark.sqlite
def test_cli_import_usage_errors_and_unreadable_sources(cli_store: str, tmp_path: Path) -> None:
    missing = run(cli_store, "import", "--from", "csv", str(tmp_path / "none.csv"))
    assert missing.exit_code == 2
    assert "--full-access" in missing.output
    unreadable = run(
        cli_store, "import", "--from", "csv", str(tmp_path / "none.csv"), "--full-access"
    )
    assert unreadable.exit_code == 1
    assert "cannot read" in unreadable.output
    headless = tmp_path / "headless.csv"
    headless.write_text("a,b\n1,2\n")
    bad = run(cli_store, "import", "--from", "csv", str(headless), "--full-access")
    assert bad.exit_code == 1
    assert "lacks name, hash" in bad.output
    no_table = run(
        cli_store,
        "import",
        "--from",
        "drf-api-key",
        f"sqlite:///{tmp_path / 'empty.db'}",
        "--full-access",
    )
    assert no_table.exit_code == 1
    assert "could not read rest_framework_api_key_apikey" in no_table.output


@pytest.mark.sqlite
def test_cli_import_refuses_a_bad_workspace_as_a_usage_error(
    cli_store: str, tmp_path: Path
) -> None:
    path = _csv(tmp_path / "keys.csv", [{"name": "a", "hash": "sha256:" + "4" * 64}])
    bad = run(cli_store, "import", "--from", "csv", str(path), "--full-access", "--workspace", "")
    assert bad.exit_code == 2
    assert "workspace must be a non-empty string" in bad.output
    assert json.loads(run(cli_store, "list", "--json").output) == []


# -- through the middleware -------------------------------------------------------------


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.sqlite
async def test_through_the_middleware_old_key_is_200_and_garbage_is_401(
    tmp_path: Path, drf: tuple[str, dict[str, str]]
) -> None:
    url, keys = drf
    async with KeyManager(f"sqlite:///{tmp_path / 'k.db'}", hasher=Hasher(TEST_PEPPER)) as manager:
        await _import_drf(manager, url)
        app = APIKeyMiddleware(_ok, manager=manager, protect="/api/", limiter_url="memory://")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

            async def status(token: str) -> tuple[int, str | None]:
                response = await client.get("/api/x", headers={"Authorization": f"Bearer {token}"})
                code = None if response.status_code == 200 else response.json()["code"]
                return response.status_code, code

            assert await status(keys["active"]) == (200, None)
            assert await status(keys["active"]) == (200, None)
            assert await status(keys["revoked"]) == (401, "key_revoked")
            assert await status("Zz9Zz9Zz.nothing-like-a-key") == (401, "invalid_api_key")


@pytest.mark.sqlite
def test_foreign_looking_garbage_tokens_are_always_401_never_500(
    tmp_path: Path, drf: tuple[str, dict[str, str]]
) -> None:
    url, _keys = drf

    async def prepare() -> None:
        async with KeyManager(f"sqlite:///{tmp_path / 'k.db'}", hasher=Hasher(TEST_PEPPER)) as m:
            await _import_drf(m, url)

    asyncio.run(prepare())
    with asyncio.Runner() as runner:
        manager = KeyManager(f"sqlite:///{tmp_path / 'k.db'}", hasher=Hasher(TEST_PEPPER))
        runner.run(manager.setup())
        app = APIKeyMiddleware(_ok, manager=manager, protect="/api/", limiter_url="memory://")
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")

        @settings(max_examples=150, deadline=None)
        @given(
            st.one_of(
                st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=300),
                st.builds(
                    lambda p, s: f"{p}.{s}",
                    st.text(alphabet="abcXYZ0189", min_size=1, max_size=10),
                    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126)),
                ),
            )
        )
        def check(token: str) -> None:
            response = runner.run(
                client.get("/api/x", headers={"Authorization": f"Bearer {token}"})
            )
            assert response.status_code == 401, response.text
            assert response.json()["code"] in {"malformed_api_key", "invalid_api_key"}

        try:
            check()
        finally:
            runner.run(client.aclose())
            runner.run(manager.aclose())


@pytest.mark.parametrize(
    "name", ["apikeys.importing", "apikeys.importing.foreign", "apikeys.importing.sources"]
)
def test_importing_modules_export_every_public_name_with_a_docstring(name: str) -> None:
    assert_all_is_complete(name)
    assert_exports_are_documented(name)


async def test_if_store_keeps_no_settings_then_import_is_refused_and_tokens_stay_malformed(
    tmp_path: Path,
) -> None:
    from apikeys.stores.memory.store import MemoryStore

    class NoSettings(MemoryStore):
        async def claim_setting(self, name: str, value: str, **_: Any) -> str | None:
            return None

    rows, keys = csv_keys()
    path = _csv(tmp_path / "keys.csv", rows)
    async with KeyManager(NoSettings(), hasher=Hasher(TEST_PEPPER)) as manager:
        with pytest.raises(ConfigurationError, match="keeps no settings"):
            await import_keys(manager, read_csv(path), source="csv", full_access=True)
        assert await manager.list() == []
        with pytest.raises(MalformedAPIKey):
            await manager.verify(keys["unkey"])


async def test_an_import_adds_and_revokes_keys_through_the_manager(tmp_path: Path) -> None:
    """Each imported key is announced as `create` announces a key (`on_event`), and a key
    revoked at its source since is revoked by `KeyManager.revoke`."""
    events: list[Any] = []
    manager = KeyManager("memory://", hasher=Hasher(pepper=TEST_PEPPER), on_event=events.append)
    try:
        token = "Pk4wQe7R.abcdEFGHijklMNOPqrstUVWX"
        row = {"name": "one", "hash": pbkdf2_sha256.hash(token), "prefix": "Pk4wQe7R"}
        rows = read_csv(_csv(tmp_path / "a.csv", [row]))
        report = await import_keys(manager, rows, source="csv", full_access=True)
        (record,) = report.imported
        changed = [event.audit for event in events if event.kind == "key_changed"]
        assert [(event.key_id, event.action) for event in changed] == [(record.id, "imported")]
        assert changed[0].changes["imported_from"] == "csv"
        assert changed[0].changes["scheme"] == "pbkdf2_sha256"
        events.clear()
        revoked = [
            ForeignKey(row=1, name="one", hashed=row["hash"], prefix="Pk4wQe7R", revoked=True)
        ]
        again = await import_keys(manager, revoked, source="csv", full_access=True)
        assert again.revoked == [record.id]
        assert [event.audit.action for event in events if event.kind == "key_changed"] == [
            "revoked"
        ]
    finally:
        await manager.aclose()
