"""A database error on a statement that carries a hash or a webhook secret shows neither:
SQLAlchemy writes a statement's parameters into its errors (and its echo log) unless the
engine hides them, and such an error reaches the application's log with its traceback."""

from __future__ import annotations

import traceback

import pytest
import sqlalchemy as sa

from apikeys import Hasher, KeyManager
from apikeys.stores import KeyStore
from apikeys.stores.sql.schema import webhooks_table
from apikeys.stores.sql.store import SQLStore
from apikeys.webhooks.admin import add_endpoint


@pytest.fixture(
    params=[
        pytest.param("sqlite", marks=pytest.mark.sqlite, id="sqlite"),
        pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    ]
)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def _refuse_inserts(store: SQLStore, table: str) -> None:
    """A trigger that fails every INSERT into `table`: a database error of any kind."""
    async with store.engine.begin() as conn:
        if conn.dialect.name == "sqlite":
            await conn.execute(
                sa.text(
                    f'CREATE TRIGGER refuse_{table} BEFORE INSERT ON "{table}" '
                    "BEGIN SELECT RAISE(ABORT, 'refused by a test trigger'); END"
                )
            )
            return
        await conn.execute(
            sa.text(
                f"CREATE FUNCTION refuse_{table}() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'refused by a test trigger'; END $$"
            )
        )
        await conn.execute(
            sa.text(
                f'CREATE TRIGGER refuse_{table} BEFORE INSERT ON "{table}" '
                f"FOR EACH ROW EXECUTE FUNCTION refuse_{table}()"
            )
        )


def _text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


async def test_a_failed_insert_of_a_key_shows_no_hash(store: KeyStore) -> None:
    assert isinstance(store, SQLStore)
    async with KeyManager(
        store, hasher=Hasher(pepper=b"L8dw49pa41XlgoBNkvoeuME4lzC2vZHAO-p4QCm4Kiw"), webhooks=False
    ) as manager:
        await _refuse_inserts(store, store._table.name)
        with pytest.raises(sa.exc.DBAPIError, match="refused by a test trigger") as raised:
            await manager.create(name="a", full_access=True)
    text = _text(raised.value)
    assert "refused by a test trigger" in text  # the error is the trigger's
    assert "hmac-sha256$" not in text


async def test_a_failed_insert_of_a_webhook_endpoint_shows_no_secret(store: KeyStore) -> None:
    assert isinstance(store, SQLStore)
    hooks = store.webhooks()
    assert hooks is not None
    await _refuse_inserts(store, webhooks_table(store.table.name).name)
    with pytest.raises(sa.exc.DBAPIError, match="refused by a test trigger") as raised:
        await add_endpoint(hooks, "https://hooks.example.com/")
    text = _text(raised.value)
    assert "refused by a test trigger" in text
    assert "whsec_" not in text
