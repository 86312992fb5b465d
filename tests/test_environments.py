"""Live and test keys (CONTRACT section 13): the environment is in the key's prefix
(`ak_live_…`, `ak_test_…`) and in its record, the record is the truth, and keys made before
environments existed (`ak_…`, records without the field) keep working as live."""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from apikeys import APIKeyMiddleware, InvalidAPIKey, KeyManager, MalformedAPIKey
from apikeys.errors import InvalidKeyParameters
from apikeys.hashing import Hasher
from apikeys.importing import import_keys, read_csv
from apikeys.keys import (
    ParsedKey,
    environment_prefix,
    environments_of,
    generate_key,
    manager_prefix,
    mask,
    parse_key,
    parse_key_of,
    prefixes_splitter,
)
from apikeys.listing import KeyFilter
from apikeys.stores import KeyStore
from apikeys.types import ENVIRONMENTS, KeyRecord, StoredKey, utcnow
from tests.conftest import TEST_PEPPER
from tests.public_surface import assert_all_is_complete, assert_exports_are_documented

PREFIXES = st.from_regex(r"[a-z][a-z0-9_]{0,26}", fullmatch=True)
ENVIRONMENT = st.sampled_from(ENVIRONMENTS)


# -- the format -----------------------------------------------------------------------------


@given(prefix=PREFIXES, environment=st.sampled_from([*ENVIRONMENTS, None]))
@settings(max_examples=200, deadline=None)
def test_keys_of_both_environments_and_of_the_old_form_parse_back(
    prefix: str, environment: str | None
) -> None:
    key = generate_key(prefix, environment=environment)  # type: ignore[arg-type]
    expected = prefix if environment is None else f"{prefix}_{environment}"
    assert key.prefix == expected
    assert parse_key(key.token) == key
    assert parse_key_of(key.token, prefix) == key
    assert prefixes_splitter(environments_of(prefix))(key.token) == tuple(key)
    read_as = environments_of(prefix)[key.prefix]
    assert read_as == (environment or "live")
    if environment is not None:
        assert manager_prefix(key.prefix) == prefix
    assert key.masked == mask(expected, key.id)


@given(prefix=PREFIXES, environment=ENVIRONMENT, other=ENVIRONMENT)
@settings(max_examples=100, deadline=None)
def test_a_token_relabelled_to_another_environment_needs_a_new_checksum(
    prefix: str, environment: str, other: str
) -> None:
    key = generate_key(prefix, environment=environment)  # type: ignore[arg-type]
    relabelled = f"{prefix}_{other}" + key.token[len(key.prefix) :]
    if other == environment:
        assert relabelled == key.token
        return
    # The checksum covers the prefix: a relabelled token is noise unless recomputed.
    with pytest.raises(MalformedAPIKey):
        parse_key_of(relabelled, prefix)


def test_the_environment_is_live_or_test_and_a_prefix_leaves_room_for_it() -> None:
    assert environment_prefix("ak", "test") == "ak_test"
    with pytest.raises(InvalidKeyParameters):
        environment_prefix("ak", "prod")
    with pytest.raises(InvalidKeyParameters):
        KeyManager("memory://", prefix="a" * 28)  # `{prefix}_live` would be 33 characters
    with pytest.raises(InvalidKeyParameters):
        KeyFilter(environment="prod")  # type: ignore[arg-type]


def test_the_modules_of_the_format_export_and_document_what_they_define() -> None:
    for name in ("apikeys.keys", "apikeys.types", "apikeys.listing"):
        assert_all_is_complete(name)
        assert_exports_are_documented(name)


# -- the manager ----------------------------------------------------------------------------


async def test_if_created_as_test_then_its_token_record_roll_and_listing_say_test(
    manager: KeyManager,
) -> None:
    live = await manager.create(name="prod", workspace="acme", full_access=True)
    test = await manager.create(
        name="sandbox", workspace="acme", full_access=True, environment="test"
    )
    assert live.key.startswith("ak_live_")
    assert live.record.environment == "live"
    assert test.key.startswith("ak_test_")
    assert test.record.environment == "test"
    assert test.record.prefix == f"ak_test_{test.record.id}_…"
    assert (await manager.verify(test.key)).environment == "test"
    assert (await manager.get(test.record.id)).to_dict()["environment"] == "test"
    rolled = await manager.roll(test.record.id)
    assert rolled.key.startswith("ak_test_")
    assert rolled.record.environment == "test"
    listed = await manager.list("acme", environment="test")
    assert {record.id for record in listed} == {test.record.id, rolled.record.id}
    page = await manager.list_page("acme", environment="live")
    assert [record.id for record in page.records] == [live.record.id]
    created = [e for e in await manager.audit(key_id=test.record.id) if e.action == "created"]
    assert created[0].changes["environment"] == "test"
    with pytest.raises(TypeError):
        await manager.update(test.record.id, environment="live")  # type: ignore[call-arg]
    with pytest.raises(InvalidKeyParameters):
        await manager.create(name="x", full_access=True, environment="prod")  # type: ignore[arg-type]


def _relabelled(token: str, prefix: str) -> str:
    parts = parse_key(token)
    return ParsedKey(prefix, parts.id, parts.secret).token


async def test_if_a_token_names_another_environment_than_its_record_then_refused_as_unknown(
    manager: KeyManager,
) -> None:
    test = await manager.create(name="sandbox", full_access=True, environment="test")
    live = await manager.create(name="prod", full_access=True)
    await manager.verify(test.key)  # held in the key cache, where there is one
    await manager.verify(live.key)
    unknown = generate_key("ak", environment="live").token
    for forged in (
        _relabelled(test.key, "ak_live"),
        _relabelled(test.key, "ak"),  # the old form reads as live
        _relabelled(live.key, "ak_test"),
        _relabelled(live.key, "ak"),  # a live key made with ak_live_ is not an old key
    ):
        answers = []
        for token in (forged, unknown):
            with pytest.raises(InvalidAPIKey) as refused:
                await manager.verify(token)
            answers.append((refused.value.code, str(refused.value)))
        assert answers[0] == answers[1]  # the same answer as a key that does not exist
    assert (await manager.verify(test.key)).environment == "test"
    assert (await manager.verify(live.key)).environment == "live"


async def test_if_a_record_says_test_under_a_live_prefix_then_refused(
    store: KeyStore, hasher: Hasher
) -> None:
    # A record edited behind apikeys' back: the record is the truth, and the token that
    # names another environment is not believed, whatever the masked prefix says.
    parsed = generate_key("ak", environment="live")
    record = _old_record(parsed, environment="test")
    await store.insert(StoredKey(record, await hasher.ahash(parsed.secret)))
    async with KeyManager(store, hasher=hasher) as manager:
        with pytest.raises(InvalidAPIKey):
            await manager.verify(parsed.token)
        with pytest.raises(InvalidAPIKey):
            await manager.verify(_relabelled(parsed.token, "ak_test"))


# -- records written before the field -------------------------------------------------------


def _old_record(parsed: ParsedKey, **changes: Any) -> KeyRecord:
    record = KeyRecord(
        id=parsed.id,
        name="made before environments",
        workspace="acme",
        prefix=parsed.masked,
        access="full",
        scopes=(),
        state="active",
        rate_limit=None,
        created_at=utcnow(),
    )
    return dataclasses.replace(record, **changes)


async def _write_without_environment(store: KeyStore, stored: StoredKey, url: str) -> None:
    """Write `stored` as a writer that does not know the field does: a SQL INSERT that
    leaves the column out, an HSET without it, a memory record made without it."""
    from apikeys.stores.memory import MemoryStore
    from apikeys.stores.redis import RedisStore
    from apikeys.stores.redis.codec import encode
    from apikeys.stores.sql.rows import row_values
    from apikeys.stores.sql.store import SQLStore

    if isinstance(store, MemoryStore):
        await store.insert(stored)
    elif isinstance(store, SQLStore):
        values = dict(row_values(stored))
        del values["environment"]
        async with store.engine.begin() as conn:
            await conn.execute(store.table.insert().values(**values))
    elif isinstance(store, RedisStore):
        from redis.asyncio import Redis

        flat = encode(stored)
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        del fields["environment"]
        admin = Redis.from_url(url, decode_responses=True)
        try:
            await admin.hset(store.key_name(stored.record.id), mapping=fields)
        finally:
            await admin.aclose()
    else:  # pragma: no cover
        raise AssertionError(store)


async def test_a_key_written_without_the_field_reads_and_verifies_as_live(
    store: KeyStore, hasher: Hasher, store_url: str
) -> None:
    parsed = generate_key("ak")  # the old form: ak_<id>_…
    stored = StoredKey(_old_record(parsed), await hasher.ahash(parsed.secret))
    await _write_without_environment(store, stored, store_url)
    found = await store.get(parsed.id)
    assert found is not None
    assert found.record.environment == "live"
    async with KeyManager(store, hasher=hasher) as manager:
        for _ in range(2):  # from the store, then as held
            record = await manager.verify(parsed.token)
            assert record.environment == "live"
        with pytest.raises(InvalidAPIKey):
            await manager.verify(_relabelled(parsed.token, "ak_test"))


async def test_a_sql_table_of_before_takes_the_column_with_its_default(
    tmp_path: Path, hasher: Hasher
) -> None:
    # A table made before the field: setup names the missing column and changes nothing;
    # `ALTER TABLE … ADD COLUMN environment VARCHAR(16) NOT NULL DEFAULT 'live'` makes
    # every key it holds live.
    import sqlalchemy as sa

    from apikeys.errors import ConfigurationError
    from apikeys.stores.sql.store import SQLStore
    from tests.stores.test_sql import drop_change_log_triggers

    url = f"sqlite+aiosqlite:///{tmp_path / 'keys.db'}"
    parsed = generate_key("ak")
    store = SQLStore(url)
    await store.setup()
    await store.insert(StoredKey(_old_record(parsed), await hasher.ahash(parsed.secret)))
    async with store.engine.begin() as conn:
        await drop_change_log_triggers(conn, store.table.name)
        await conn.execute(sa.text("ALTER TABLE apikeys_keys DROP COLUMN environment"))
    await store.aclose()
    refusing = SQLStore(url)
    try:
        with pytest.raises(ConfigurationError, match="environment"):
            await refusing.setup()
    finally:
        await refusing.aclose()
    again = SQLStore(url)
    async with again.engine.begin() as conn:
        await conn.execute(
            sa.text(
                "ALTER TABLE apikeys_keys ADD COLUMN environment VARCHAR(16) "
                "NOT NULL DEFAULT 'live'"
            )
        )
    try:
        async with KeyManager(again, hasher=hasher) as manager:
            await manager.setup()
            assert (await manager.verify(parsed.token)).environment == "live"
    finally:
        await again.aclose()


# -- the request path -----------------------------------------------------------------------


async def _where(request: Request) -> JSONResponse:
    record = request.scope["apikey"]
    return JSONResponse({"environment": record.environment, "id": record.id})


async def test_the_application_routes_by_one_attribute_and_a_relabelled_token_gets_401(
    memory_manager: KeyManager,
) -> None:
    app = APIKeyMiddleware(
        Starlette(routes=[Route("/api/where", _where)]), manager=memory_manager, protect="/api/"
    )
    live = await memory_manager.create(name="prod", full_access=True)
    test = await memory_manager.create(name="sandbox", full_access=True, environment="test")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:

        async def get(token: str) -> httpx.Response:
            return await http.get("/api/where", headers={"Authorization": f"Bearer {token}"})

        assert (await get(live.key)).json()["environment"] == "live"
        assert (await get(test.key)).json()["environment"] == "test"
        forged = await get(_relabelled(test.key, "ak_live"))
        unknown = await get(generate_key("ak", environment="live").token)
    assert forged.status_code == unknown.status_code == 401
    assert forged.json() == unknown.json()
    assert forged.headers["www-authenticate"] == unknown.headers["www-authenticate"]


def test_the_sync_api_creates_and_lists_by_environment() -> None:
    from apikeys.sync import KeyManager as SyncKeyManager

    with SyncKeyManager("memory://", hasher=Hasher(pepper=TEST_PEPPER)) as manager:
        test = manager.create(name="sandbox", full_access=True, environment="test")
        manager.create(name="prod", full_access=True)
        assert manager.verify(test.key).environment == "test"
        assert [r.name for r in manager.list(environment="test")] == ["sandbox"]
        assert [r.name for r in manager.iter_keys(environment="live")] == ["prod"]


# -- import ---------------------------------------------------------------------------------


OLD_KEY = "sandbox-old-key-0001"


async def test_an_import_reads_the_environment_column_live_when_empty(
    tmp_path: Path, memory_manager: KeyManager
) -> None:
    path = tmp_path / "keys.csv"
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["name", "hash", "environment"])
        writer.writerow(
            ["sandbox", "sha256:" + hashlib.sha256(OLD_KEY.encode()).hexdigest(), "test"]
        )
        writer.writerow(["prod", "sha256:" + "b" * 64, ""])
        writer.writerow(["odd", "sha256:" + "c" * 64, "staging"])
    report = await import_keys(memory_manager, read_csv(path), source="csv", full_access=True)
    assert {r.name: r.environment for r in report.imported} == {"sandbox": "test", "prod": "live"}
    assert [(r.name, "environment" in r.reason) for r in report.refused] == [("odd", True)]
    for record in report.imported:
        assert (await memory_manager.get(record.id)).environment == record.environment
    shown = {r.name: r.prefix for r in report.imported}
    assert shown["sandbox"].startswith("ak_test_")
    assert not shown["prod"].startswith(("ak_live_", "ak_test_"))
    # The old key string verifies, as its record's environment.
    for _ in range(2):
        assert (await memory_manager.verify(OLD_KEY)).environment == "test"


# -- the command line, end to end -----------------------------------------------------------


def _apikeys(store_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "APIKEYS_PEPPER": TEST_PEPPER, "APIKEYS_STORE_URL": store_url}
    return subprocess.run(
        [sys.executable, "-m", "apikeys", *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )


def test_the_command_line_creates_lists_and_shows_test_keys(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    made = _apikeys(url, "create", "--name", "sandbox", "--full-access", "--environment", "test")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token.startswith("ak_test_")
    assert "Created test API key" in made.stderr
    live = _apikeys(url, "create", "--name", "prod", "--full-access", "--json")
    assert json.loads(live.stdout)["environment"] == "live"

    listed = _apikeys(url, "list", "--environment", "test", "--json")
    assert [item["name"] for item in json.loads(listed.stdout)] == ["sandbox"]
    table = _apikeys(url, "list", "--environment", "live").stdout
    assert "prod" in table
    assert "sandbox" not in table
    shown = _apikeys(url, "show", parse_key(token).id).stdout
    assert "environment:  test" in shown or "environment: test" in shown
    usage = json.loads(_apikeys(url, "usage", parse_key(token).id, "--json").stdout)
    assert usage["environment"] == "test"
    refused = _apikeys(url, "list", "--environment", "prod")
    assert refused.returncode == 2

    async def verify() -> KeyRecord:
        async with KeyManager(url, hasher=Hasher(pepper=TEST_PEPPER)) as manager:
            return await manager.verify(token)

    assert asyncio.run(verify()).environment == "test"


async def test_a_held_key_of_either_environment_or_the_old_form_is_split_by_position(
    memory_manager: KeyManager, hasher: Hasher
) -> None:
    # The request path reads a held key's token by position from its end; the full split
    # (regex and checksum) runs once per token, when its secret first matches.
    old = generate_key("ak")
    await memory_manager.store.insert(StoredKey(_old_record(old), await hasher.ahash(old.secret)))
    tokens = [
        old.token,
        (await memory_manager.create(name="l", full_access=True)).key,
        (await memory_manager.create(name="t", full_access=True, environment="test")).key,
    ]
    full_splits: list[str] = []
    split = memory_manager._split

    def counted(token: str) -> tuple[str, str, str]:
        full_splits.append(token)
        return split(token)

    memory_manager._split = counted  # type: ignore[method-assign]
    for token in tokens:
        for _ in range(3):
            record = memory_manager.verify_now(token, count=False)
            assert record is not None
            assert record.environment == ("test" if "_test_" in token else "live")
    assert sorted(full_splits) == sorted(tokens)


async def test_the_test_kit_makes_test_keys() -> None:
    from apikeys.testing import KeyFactory, in_memory_manager

    async with in_memory_manager() as manager:
        made = await KeyFactory(manager)(scopes=["contacts:read"], environment="test")
        assert made.key.startswith("ak_test_")
        assert (await manager.verify(made.key)).environment == "test"
