"""Importing keys into identities: a CSV's `identity` column, and a drf-api-key custom
model's column named by `--identity-column`. The identity must exist, in the key's
workspace, and not be revoked: any other row is refused, naming the row and why, and an
import never makes an identity."""

from __future__ import annotations

import asyncio
import csv
import hashlib
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from apikeys import KeyManager, store_from_url
from apikeys.cli import main
from apikeys.hashing import Hasher
from apikeys.importing import ForeignKey, import_keys, read_csv
from apikeys.stores.contract import KeyStore
from tests.conftest import TEST_PEPPER


def _sha256(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture
async def importer(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(store, hasher=Hasher(TEST_PEPPER), webhooks=False) as manager:
        await manager.create_identity("cust_1", workspace="acme", name="Customer 1")
        await manager.create_identity("cust_g", workspace="globex")
        await manager.create_identity("cust_gone", workspace="acme")
        await manager.revoke_identity("cust_gone")
        yield manager


def _rows() -> list[ForeignKey]:
    return [
        ForeignKey(2, "in cust_1", _sha256("old-key-0001"), identity="cust_1"),
        ForeignKey(3, "no identity", _sha256("old-key-0002")),
        ForeignKey(4, "unknown", _sha256("old-key-0003"), identity="cust_404"),
        ForeignKey(5, "globex's", _sha256("old-key-0004"), identity="cust_g"),
        ForeignKey(6, "revoked", _sha256("old-key-0005"), identity="cust_gone"),
        ForeignKey(7, "not an id", _sha256("old-key-0006"), identity="a/b"),
    ]


@pytest.mark.parametrize("dry_run", [True, False])
async def test_a_row_naming_an_identity_of_its_workspace_is_imported_into_it_others_refused(
    importer: KeyManager, dry_run: bool
) -> None:
    report = await import_keys(
        importer, _rows(), source="csv", workspace="acme", full_access=True, dry_run=dry_run
    )
    assert {record.name: record.identity for record in report.imported} == {
        "in cust_1": "cust_1",
        "no identity": None,
    }
    reasons = {refusal.row: refusal.reason for refusal in report.refused}
    assert sorted(reasons) == [4, 5, 6, 7]
    assert "no identity with id 'cust_404' in workspace 'acme'" in reasons[4]
    # Another workspace's identity answers as an unknown one.
    assert "no identity with id 'cust_g' in workspace 'acme'" in reasons[5]
    assert "revoked" in reasons[6]
    assert "invalid identity" in reasons[7]
    assert all("(from the identity column)" in reason for reason in reasons.values())
    stored = await importer.list("acme")
    if dry_run:
        assert stored == []
    else:
        assert {record.name: record.identity for record in stored} == {
            "in cust_1": "cust_1",
            "no identity": None,
        }
        assert [record.name for record in await importer.list(identity="cust_1")] == ["in cust_1"]
        # The old key works, as a key of its identity.
        assert (await importer.verify("old-key-0001")).identity == "cust_1"
    # An import never makes an identity.
    assert sorted(one.id for one in await importer.list_identities()) == [
        "cust_1",
        "cust_g",
        "cust_gone",
    ]


def _csv(path: Path, rows: list[dict[str, str]]) -> Path:
    columns = list(dict.fromkeys(name for row in rows for name in row))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_the_csv_identity_column_is_read_and_another_column_may_be_named(tmp_path: Path) -> None:
    path = _csv(
        tmp_path / "keys.csv",
        [
            {"name": "a", "hash": _sha256("k1"), "identity": " cust_1 ", "customer": "c9"},
            {"name": "b", "hash": _sha256("k2"), "identity": "", "customer": ""},
        ],
    )
    assert [row.identity for row in read_csv(path)] == ["cust_1", None]  # type: ignore[union-attr]
    named = list(read_csv(path, identity_column="customer"))
    assert [row.identity for row in named] == ["c9", None]  # type: ignore[union-attr]
    headless = _csv(tmp_path / "plain.csv", [{"name": "a", "hash": _sha256("k1")}])
    assert [row.identity for row in read_csv(headless)] == [None]  # type: ignore[union-attr]


# -- the command line -------------------------------------------------------------------


def _run(store_url: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--store", store_url, *args])


@pytest.fixture
def cli_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("APIKEYS_PEPPER", TEST_PEPPER)
    monkeypatch.delenv("APIKEYS_STORE_URL", raising=False)
    url = f"sqlite:///{tmp_path / 'cli.db'}"

    async def identities() -> None:
        async with KeyManager(store_from_url(url), hasher=Hasher(TEST_PEPPER)) as manager:
            await manager.create_identity("cust_1", workspace="acme")
            await manager.create_identity("cust_g", workspace="globex")

    asyncio.run(identities())
    return url


def _custom_model(path: Path) -> str:
    """A custom `AbstractAPIKey` model's table with a `customer_id` column."""
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE billing_apikey (id varchar(150) PRIMARY KEY, prefix varchar(8), "
            "hashed_key varchar(150), created datetime, name varchar(50), revoked bool, "
            "expiry_date datetime, customer_id varchar(64))"
        )
        for number, (name, customer) in enumerate(
            [("acme one", "cust_1"), ("none", None), ("elsewhere", "cust_g")]
        ):
            key = f"Pfx{number}abcd.secret-{number}"
            db.execute(
                "INSERT INTO billing_apikey VALUES (?, ?, ?, ?, ?, 0, NULL, ?)",
                (
                    f"Pfx{number}abcd.{number}",
                    f"Pfx{number}abcd",
                    "sha512$$" + hashlib.sha512(key.encode()).hexdigest(),
                    f"2024-01-0{number + 1} 12:00:00",
                    name,
                    customer,
                ),
            )
    db.close()
    return f"sqlite:///{path}"


@pytest.mark.sqlite
def test_cli_drf_custom_model_keys_go_into_the_identity_its_column_names(
    cli_store: str, tmp_path: Path
) -> None:
    source = _custom_model(tmp_path / "old.db")
    args = ("import", "--from", "drf-api-key", source, "--table", "billing_apikey")
    done = _run(
        cli_store, *args, "--workspace", "acme", "--full-access", "--identity-column", "customer_id"
    )
    assert done.exit_code == 0, done.output
    assert "Imported 2 key(s) into workspace 'acme'; skipped 0 (imported before); refused 1." in (
        done.output
    )
    assert (
        "refused row 3 ('elsewhere'): no identity with id 'cust_g' in workspace 'acme' "
        "(from the identity column)"
    ) in done.output
    listed = json.loads(_run(cli_store, "list", "--identity", "cust_1", "--json").output)
    assert [key["name"] for key in listed] == ["acme one"]
    assert listed[0]["identity"] == "cust_1"


@pytest.mark.sqlite
def test_cli_identity_column_is_an_identifier_and_never_the_hash(
    cli_store: str, tmp_path: Path
) -> None:
    source = _custom_model(tmp_path / "old.db")
    base = ("import", "--from", "drf-api-key", source, "--table", "billing_apikey")
    for column, said in (
        ("customer_id); --", "the identity column is an SQL identifier"),
        ("hashed_key", "the identity column cannot be 'hashed_key'"),
    ):
        result = _run(cli_store, *base, "--full-access", "--identity-column", column)
        assert result.exit_code == 2, result.output
        assert said in result.output
    csv_hash = _csv(tmp_path / "k.csv", [{"name": "a", "hash": _sha256("k1")}])
    result = _run(
        cli_store, "import", "--from", "csv", str(csv_hash), "--full-access",
        "--identity-column", "hash",
    )  # fmt: skip
    assert result.exit_code == 2
    assert json.loads(_run(cli_store, "list", "--json").output) == []
