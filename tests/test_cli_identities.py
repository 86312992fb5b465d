"""`apikeys identities …` and the key commands' `--identity`, end to end on SQLite (and
once on PostgreSQL), in-process through click's `CliRunner` as `tests/test_cli.py` runs."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.test_cli import ok, refused_with_one_line, run

pytestmark = pytest.mark.sqlite


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIKEYS_PEPPER", "SQ-SUvFjge0pjQ9upfz5ybw7QFrEa7gr-JnfSl7h7IA")
    monkeypatch.delenv("APIKEYS_STORE_URL", raising=False)


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'k.db'}"


def as_json(store_url: str, *args: str) -> Any:
    return json.loads(ok(store_url, *args, "--json").stdout)


def usage_error(store_url: str, *args: str) -> str:
    result = run(store_url, *args)
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return result.stderr


def walk_through(store_url: str) -> None:
    """Every subcommand, as an operator uses them."""
    made = as_json(
        store_url,
        "identities",
        "create",
        "acme",
        "--workspace",
        "w1",
        "--name",
        "Acme",
        "--rate-limit",
        "burst=10/second",
        "--rate-limit",
        "daily=1000/day",
        "--credits",
        "500",
        "--metadata",
        '{"plan": "pro"}',
        "--actor",
        "ops",
    )
    assert made["id"] == "acme"
    assert made["status"] == "active"
    assert made["rate_limit"] == "burst=10/second, daily=1000/day"
    assert made["credits"] == 500
    assert made["metadata"] == {"plan": "pro"}
    assert "Created identity globex" in ok(store_url, "identities", "create", "globex").stdout

    listed = as_json(store_url, "identities", "list", "--workspace", "w1")
    assert [one["id"] for one in listed] == ["acme"]
    table = ok(store_url, "identities", "list").stdout
    assert "acme" in table
    assert "globex" in table

    key = as_json(
        store_url,
        "create",
        "--name",
        "k",
        "--workspace",
        "w1",
        "--full-access",
        "--identity",
        "acme",
    )
    assert key["identity"] == "acme"
    other = as_json(store_url, "create", "--name", "k2", "--workspace", "w1", "--full-access")
    assert [k["id"] for k in as_json(store_url, "list", "--identity", "acme")] == [key["id"]]
    assert "identity:" in ok(store_url, "show", key["id"]).stdout
    moved = as_json(store_url, "update", other["id"], "--identity", "acme")
    assert moved["identity"] == "acme"
    assert as_json(store_url, "update", other["id"], "--no-identity")["identity"] is None

    shown = as_json(store_url, "identities", "show", "acme")
    assert shown["keys"] == 1
    assert "keys:" in ok(store_url, "identities", "show", "acme").stdout

    updated = as_json(
        store_url, "identities", "update", "acme", "--name", "Acme Inc", "--no-credits"
    )
    assert updated["name"] == "Acme Inc"
    assert updated["credits"] is None
    assert "now disabled" in ok(store_url, "identities", "disable", "acme").stdout
    assert "already disabled" in ok(store_url, "identities", "disable", "acme").stdout
    assert "now active" in ok(store_url, "identities", "enable", "acme").stdout
    assert "Revoked identity acme" in ok(store_url, "identities", "revoke", "acme", "--yes").stdout
    assert "already revoked" in ok(store_url, "identities", "revoke", "acme", "--yes").stdout

    line = refused_with_one_line(run(store_url, "identities", "enable", "acme"))
    assert "cannot enable identity 'acme'" in line
    line = refused_with_one_line(
        run(
            store_url,
            "create",
            "--name",
            "k3",
            "--workspace",
            "w1",
            "--full-access",
            "--identity",
            "acme",
        )
    )
    assert "it is revoked" in line
    audit = ok(store_url, "audit", "--identity", "acme", "--json").stdout
    actions = [event["action"] for event in json.loads(audit)]
    assert actions[0] == "identity.created"
    assert actions[-1] == "identity.revoked"


def test_every_identities_command_end_to_end(store_url: str) -> None:
    walk_through(store_url)


@pytest.mark.postgres
def test_every_identities_command_end_to_end_on_postgres(postgres_url: str) -> None:
    # A database of its own: the command line uses the default tables.
    import asyncpg

    base, _, _ = postgres_url.rpartition("/")
    name = f"apikeys_cli_identities_{uuid.uuid4().hex[:8]}"

    async def admin(sql: str) -> None:
        connection = await asyncpg.connect(postgres_url)
        try:
            await connection.execute(sql)
        finally:
            await connection.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        walk_through(f"{base}/{name}")
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["identities", "create", "a:b"], "ID"),
        (["identities", "create", "x" * 65], "ID"),
        (["identities", "show", "a b"], "ID"),
        (["identities", "create", "acme", "--rate-limit", "lots"], "--rate-limit"),
        (["identities", "create", "acme", "--credit-refill", "9/fortnight"], "--credit-refill"),
        (["identities", "create", "acme", "--metadata", "[1, 2]"], "--metadata"),
        (["identities", "create", "acme", "--credits", "-1"], "--credits"),
        (["identities", "update", "acme"], "say what to change"),
        (["identities", "update", "acme", "--name", "x", "--no-name"], "exclude each other"),
        (["identities", "revoke", "acme"], "--yes"),
        (["create", "--name", "k", "--full-access", "--identity", "{x}"], "--identity"),
        (["list", "--identity", "a/b"], "--identity"),
    ],
)
def test_bad_text_exits_2_naming_the_option_and_changes_nothing(
    store_url: str, args: list[str], names: str
) -> None:
    assert names in usage_error(store_url, *args)
    assert as_json(store_url, "identities", "list") == []


@pytest.mark.parametrize(
    "command",
    [
        ["identities", "show", "nobody"],
        ["identities", "update", "nobody", "--name", "x"],
        ["identities", "disable", "nobody"],
        ["identities", "enable", "nobody"],
        ["identities", "revoke", "nobody", "--yes"],
        ["create", "--name", "k", "--full-access", "--identity", "nobody"],
    ],
)
def test_unknown_identity_is_refused_with_one_line(store_url: str, command: list[str]) -> None:
    assert "no identity with id 'nobody'" in refused_with_one_line(run(store_url, *command))


def test_a_duplicate_identity_is_refused(store_url: str) -> None:
    ok(store_url, "identities", "create", "acme")
    line = refused_with_one_line(run(store_url, "identities", "create", "acme"))
    assert "exists already" in line
