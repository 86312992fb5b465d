"""`apikeys sync-revocations`: a key imported from djangorestframework-api-key and revoked in
apikeys is refused by the old service too (its own check, on a database it made)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from click.testing import CliRunner

from apikeys import KeyManager
from apikeys.cli import main
from apikeys.errors import ConfigurationError, KeyRevoked
from apikeys.hashing import Hasher
from apikeys.importing import import_keys, read_drf, write_revocations
from apikeys.stores.memory import MemoryStore
from tests.conftest import TEST_PEPPER
from tests.drf_databases import (
    drf_accepts,
    drf_database,  # noqa: F401 - the `drf` fixture
)
from tests.public_surface import assert_all_is_complete, assert_exports_are_documented


@pytest.fixture
async def importer() -> AsyncIterator[KeyManager]:
    async with KeyManager(MemoryStore(), hasher=Hasher(TEST_PEPPER)) as manager:
        yield manager


async def test_if_imported_key_revoked_in_apikeys_then_old_service_refuses_it(
    importer: KeyManager, drf: tuple[str, dict[str, str]]
) -> None:
    url, keys = drf
    report = await import_keys(
        importer, await read_drf(url), source="drf-api-key", workspace="acme", full_access=True
    )
    assert report.refused == []
    record = await importer.verify(keys["active"])
    other = await importer.verify(keys["expiring"])
    assert drf_accepts(url, [keys["active"], keys["expiring"]]) == [True, True]
    await importer.revoke(record.id)

    dry = await write_revocations(importer, url, workspace="acme", dry_run=True)
    assert (dry.revoked, dry.dry_run) == ([record.id], True)
    assert drf_accepts(url, [keys["active"]]) == [True]  # nothing written

    # Another workspace's keys are not this one's: nothing to write there.
    elsewhere = await write_revocations(importer, url, workspace="other")
    assert elsewhere.revoked == []

    done = await write_revocations(importer, url, workspace="acme")
    assert done.revoked == [record.id]
    assert keys["active"] not in json.dumps(done.to_dict())
    # Refused by both services; the other key still works in both.
    with pytest.raises(KeyRevoked):
        await importer.verify(keys["active"])
    assert drf_accepts(url, [keys["active"], keys["expiring"]]) == [False, True]
    assert (await importer.verify(keys["expiring"])).id == other.id
    # Again: nothing left to write.
    assert (await write_revocations(importer, url, workspace="acme")).revoked == []
    # And importing again keeps the key revoked here.
    again = await import_keys(
        importer, await read_drf(url), source="drf-api-key", workspace="acme", full_access=True
    )
    assert again.imported == []


async def test_a_store_without_imports_writes_nothing(importer: KeyManager) -> None:
    report = await write_revocations(importer, "sqlite:///does-not-matter.db")
    assert (report.revoked, report.checked) == ([], 0)


async def test_table_name_checked(importer: KeyManager) -> None:
    with pytest.raises(ConfigurationError, match="not a table name"):
        await write_revocations(importer, "sqlite:///x.db", table="keys; DROP TABLE x")


def test_sync_revocations_command(
    drf: tuple[str, dict[str, str]], tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, keys = drf
    store = f"sqlite:///{tmp_path}/apikeys.db"
    monkeypatch.setenv("APIKEYS_PEPPER", TEST_PEPPER)
    runner = CliRunner()

    def ok(*args: str) -> str:
        result = runner.invoke(main, ["--store", store, *args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    ok("import", "--from", "drf-api-key", url, "--workspace", "acme", "--full-access")
    listed = json.loads(ok("list", "--json"))
    # (The module's database is shared: the test above revoked Zapier's old row already.)
    zapier = next(key for key in listed if key["name"] == "legacy pbkdf2_sha256")
    ok("revoke", zapier["id"], "--yes")
    dry = ok("sync-revocations", "--to", "drf-api-key", url, "--workspace", "acme", "--dry-run")
    assert "Would revoke 1 of" in dry
    assert zapier["id"] in dry
    report = json.loads(
        ok("sync-revocations", "--to", "drf-api-key", url, "--workspace", "acme", "--json")
    )
    assert report["revoked"] == [zapier["id"]]
    assert drf_accepts(url, [keys["pbkdf2_sha256"]]) == [False]


def test_revocations_module_exports_every_public_name_with_a_docstring() -> None:
    assert_all_is_complete("apikeys.importing.revocations")
    assert_exports_are_documented("apikeys.importing.revocations")
