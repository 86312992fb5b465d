"""Where `apikeys import` reads from: a source that cannot be reached is named as the
source (its URL without its password), never as the destination store; `--table` reads a
custom `AbstractAPIKey` model's table (an SQL identifier, never pasted into a statement);
`--workspace-column` puts each key in the workspace its row names."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from apikeys import KeyManager
from apikeys.cli import main
from apikeys.errors import ConfigurationError
from apikeys.hashing import Hasher
from apikeys.importing import ForeignKey, import_keys, read_csv, read_drf
from apikeys.importing.sources import check_table
from tests import services
from tests.conftest import TEST_PEPPER, _create_database, _drop_database

PASSWORD = "s3cret-Old-pw"
ACME_KEY = "AcmeOld1.acme-secret-key-000000000001"
GLOBEX_KEY = "GlobexO2.globex-secret-key-00000000002"


def run(store_url: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--store", store_url, *args])


@pytest.fixture
def cli_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("APIKEYS_PEPPER", TEST_PEPPER)
    monkeypatch.delenv("APIKEYS_STORE_URL", raising=False)
    return f"sqlite:///{tmp_path / 'cli.db'}"


def _drf_hash(key: str) -> str:
    return "sha512$$" + hashlib.sha512(key.encode()).hexdigest()


def _custom_table(path: Path, table: str, rows: list[tuple[str, str, object]]) -> str:
    """A database with a custom `AbstractAPIKey` model's table (drf-api-key's columns and
    an `organization_id`): rows of (name, key, organization_id)."""
    with sqlite3.connect(path) as db:
        db.execute(
            f"CREATE TABLE {table} (id varchar(150) PRIMARY KEY, prefix varchar(8), "
            "hashed_key varchar(150), created datetime, name varchar(50), revoked bool, "
            "expiry_date datetime, organization_id)"
        )
        for number, (name, key, organization) in enumerate(rows):
            db.execute(
                f"INSERT INTO {table} VALUES (?, ?, ?, ?, ?, 0, NULL, ?)",  # noqa: S608
                (
                    f"{key.partition('.')[0]}.{number}",
                    key.partition(".")[0],
                    _drf_hash(key),
                    f"2024-01-0{number + 1} 12:00:00",
                    name,
                    organization,
                ),
            )
    db.close()
    return f"sqlite:///{path}"


# -- an unreachable source --------------------------------------------------------------


@pytest.mark.sqlite
@pytest.mark.parametrize(
    "source",
    [
        f"postgresql://olduser:{PASSWORD}@127.0.0.1:1/old",  # nothing listens
        f"postgresql://olduser:{PASSWORD}@no-such-host.invalid/old",  # no such name
    ],
)
def test_if_the_source_is_unreachable_then_the_error_names_the_source_not_the_store(
    cli_store: str, source: str
) -> None:
    result = run(cli_store, "import", "--from", "drf-api-key", source, "--full-access")
    assert result.exit_code == 1, result.output
    hidden = source.replace(PASSWORD, "***")
    assert f"import source unreachable: {hidden}: " in result.output
    assert PASSWORD not in result.output
    assert "key store" not in result.output
    assert cli_store not in result.output


@pytest.mark.sqlite
def test_if_the_source_has_no_such_table_then_the_error_names_the_table_and_source(
    cli_store: str, tmp_path: Path
) -> None:
    source = f"sqlite:///{tmp_path / 'empty.db'}"
    result = run(cli_store, "import", "--from", "drf-api-key", source, "--full-access")
    assert result.exit_code == 1
    assert f"could not read rest_framework_api_key_apikey from the import source {source}" in (
        result.output
    )
    assert "key store" not in result.output


# -- --table ----------------------------------------------------------------------------


@pytest.mark.sqlite
def test_if_table_names_a_custom_model_then_its_keys_are_imported_and_work(
    cli_store: str, tmp_path: Path
) -> None:
    source = _custom_table(
        tmp_path / "old.db", "billing_apikey", [("acme", ACME_KEY, 1), ("globex", GLOBEX_KEY, 2)]
    )
    args = ("import", "--from", "drf-api-key", source, "--full-access", "--json")
    default = run(cli_store, *args)
    assert default.exit_code == 1
    assert "could not read rest_framework_api_key_apikey" in default.output
    done = run(cli_store, *args, "--table", "billing_apikey")
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["imported"] == 2

    async def check() -> None:
        async with KeyManager(cli_store, hasher=Hasher(TEST_PEPPER)) as manager:
            assert (await manager.verify(ACME_KEY)).name == "acme"
            assert (await manager.verify(GLOBEX_KEY)).name == "globex"

    asyncio.run(check())


@pytest.mark.sqlite
@pytest.mark.parametrize(
    "table",
    [
        "billing_apikey; DROP TABLE billing_apikey",
        'billing_apikey"',
        "billing apikey",
        "1billing",
        "a.b.c",
        "",
        "billing_apikey\n",
        "x" * 64,
    ],
)
def test_if_table_is_not_an_identifier_then_refused_before_any_statement(
    cli_store: str, tmp_path: Path, table: str
) -> None:
    source = _custom_table(tmp_path / "old.db", "billing_apikey", [("acme", ACME_KEY, 1)])
    args = ("import", "--from", "drf-api-key", source, "--full-access", "--table", table)
    result = run(cli_store, *args)
    assert result.exit_code == 2
    assert "the table is an SQL identifier" in result.output
    with pytest.raises(ConfigurationError, match="the table is an SQL identifier"):
        asyncio.run(read_drf(source, table=table))
    with sqlite3.connect(tmp_path / "old.db") as db:
        assert db.execute("SELECT count(*) FROM billing_apikey").fetchone() == (1,)
    db.close()


def test_a_schema_qualified_table_is_an_identifier() -> None:
    assert check_table("billing.api_keys") == "billing.api_keys"
    assert check_table("rest_framework_api_key_apikey") == "rest_framework_api_key_apikey"


@pytest.mark.postgres
async def test_a_schema_qualified_table_and_a_workspace_column_are_read_on_postgres() -> None:
    """The names are quoted by SQLAlchemy: a mixed-case column, a table in a schema."""
    import asyncpg

    services.require(services.POSTGRES_URL, "PostgreSQL", "APIKEYS_TEST_POSTGRES_URL")
    name = f"apikeys_imp_{uuid.uuid4().hex[:12]}"
    await _create_database(services.POSTGRES_URL, name)
    url = f"{services.POSTGRES_URL.rsplit('/', 1)[0]}/{name}"
    try:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(
                "CREATE SCHEMA billing; CREATE TABLE billing.api_keys (prefix text, "
                "hashed_key text, created timestamptz, name text, revoked bool, "
                'expiry_date timestamptz, "orgId" integer)'
            )
            await conn.execute(
                "INSERT INTO billing.api_keys VALUES ($1, $2, now(), 'acme', false, NULL, 7)",
                ACME_KEY.partition(".")[0],
                _drf_hash(ACME_KEY),
            )
        finally:
            await conn.close()
        rows = await read_drf(url, table="billing.api_keys", workspace_column="orgId")
        assert [(row.name, row.workspace) for row in rows if isinstance(row, ForeignKey)] == [
            ("acme", "7")
        ]
        with pytest.raises(ConfigurationError, match="could not read api_keys from the import"):
            await read_drf(url, table="api_keys")
    finally:
        await _drop_database(services.POSTGRES_URL, name)


@pytest.mark.sqlite
def test_table_is_for_drf_api_key_only(cli_store: str, tmp_path: Path) -> None:
    path = tmp_path / "keys.csv"
    path.write_text(f"name,hash\na,sha256:{'4' * 64}\n")
    args = ("import", "--from", "csv", str(path), "--full-access", "--table", "keys")
    result = run(cli_store, *args)
    assert result.exit_code == 2
    assert "--table is for --from drf-api-key only" in result.output


# -- --workspace-column -----------------------------------------------------------------


@pytest.mark.sqlite
def test_if_workspace_column_given_then_each_key_is_in_its_rows_workspace(
    cli_store: str, tmp_path: Path
) -> None:
    source = _custom_table(
        tmp_path / "old.db",
        "billing_apikey",
        [
            ("acme", ACME_KEY, "acme"),
            ("globex", GLOBEX_KEY, 42),
            ("orphan", "Orphan03.orphan-secret-key-000000003", None),
            ("blank", "BlankKe4.blank-secret-key-0000000004", "  "),
            ("control", "Control5.control-secret-key-00000005", "acme\x01evil"),
        ],
    )
    args = ("import", "--from", "drf-api-key", source, "--table", "billing_apikey")
    result = run(cli_store, *args, "--full-access", "--workspace-column", "organization_id")
    assert result.exit_code == 0, result.output
    assert "Imported 2 key(s) into the workspaces of column 'organization_id'" in result.output
    assert "refused 3." in result.output
    empty = "the workspace column organization_id is empty: the key has no workspace"
    assert f"refused row 3 ('orphan'): {empty}" in result.output
    assert f"refused row 4 ('blank'): {empty}" in result.output
    assert "refused row 5 ('control'): the workspace must be at most" in result.output
    listed = json.loads(run(cli_store, "list", "--json").output)
    assert {(key["name"], key["workspace"]) for key in listed} == {
        ("acme", "acme"),
        ("globex", "42"),
    }

    async def check() -> None:
        async with KeyManager(cli_store, hasher=Hasher(TEST_PEPPER)) as manager:
            assert (await manager.verify(ACME_KEY)).workspace == "acme"
            assert (await manager.verify(GLOBEX_KEY)).workspace == "42"

    asyncio.run(check())
    # Imported again: each key is found in its own workspace and skipped.
    again = run(cli_store, *args, "--full-access", "--workspace-column", "organization_id")
    assert "Imported 0 key(s)" in again.output
    assert "skipped 2 (imported before)" in again.output


@pytest.mark.sqlite
def test_workspace_column_is_an_identifier_and_excludes_workspace(
    cli_store: str, tmp_path: Path
) -> None:
    source = _custom_table(tmp_path / "old.db", "billing_apikey", [("acme", ACME_KEY, "acme")])
    base = ("import", "--from", "drf-api-key", source, "--table", "billing_apikey")
    injected = run(cli_store, *base, "--full-access", "--workspace-column", "name); --")
    assert injected.exit_code == 2
    assert "the workspace column is an SQL identifier" in injected.output
    both = run(
        cli_store, *base, "--full-access", "--workspace-column", "organization_id",
        "--workspace", "acme",
    )  # fmt: skip
    assert both.exit_code == 2
    assert "not both" in both.output
    missing = run(cli_store, *base, "--full-access", "--workspace-column", "tenant")
    assert missing.exit_code == 1
    assert "could not read billing_apikey from the import source" in missing.output
    assert json.loads(run(cli_store, "list", "--json").output) == []


async def test_a_csv_workspace_column_sets_each_keys_workspace(tmp_path: Path) -> None:
    path = tmp_path / "keys.csv"
    path.write_text(
        "name,hash,tenant\n"
        f"one,sha256:{hashlib.sha256(b'one-old-key-0001').hexdigest()},acme\n"
        f"two,sha256:{hashlib.sha256(b'two-old-key-0002').hexdigest()},\n"
    )
    with pytest.raises(ConfigurationError, match="lacks org"):
        list(read_csv(path, workspace_column="org"))
    rows = list(read_csv(path, workspace_column="tenant"))
    assert isinstance(rows[0], ForeignKey)
    assert rows[0].workspace == "acme"
    async with KeyManager("memory://", hasher=Hasher(TEST_PEPPER)) as manager:
        report = await import_keys(manager, rows, source="csv", full_access=True)
        assert [record.workspace for record in report.imported] == ["acme"]
        assert [(refusal.row, refusal.name) for refusal in report.refused] == [(3, "two")]
        assert (await manager.verify("one-old-key-0001")).workspace == "acme"
        events = await manager.audit(key_id=report.imported[0].id)
        assert [event.action for event in events] == ["imported", "rehashed"]
        assert events[0].changes["imported_from"] == "csv"
