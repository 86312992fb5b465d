"""The SQL store's one-time values on an SQLite without `DELETE … RETURNING` (before 3.35)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from apikeys.stores.sql.store import SQLStore


@pytest.fixture
async def old_sqlite(tmp_path: Path) -> AsyncIterator[SQLStore]:
    store = SQLStore(f"sqlite:///{tmp_path / 'keys.db'}")
    await store.setup()
    # As SQLAlchemy finds an SQLite older than 3.35.
    store.engine.dialect.delete_returning = False
    try:
        yield store
    finally:
        await store.aclose()


async def test_without_returning_a_value_is_taken_once_and_never_after_its_ttl(
    old_sqlite: SQLStore,
) -> None:
    await old_sqlite.put_once("t1", "value", timedelta(minutes=5))
    taken = await asyncio.gather(*(old_sqlite.take_once("t1") for _ in range(10)))
    assert taken.count("value") == 1
    assert taken.count(None) == 9
    await old_sqlite.put_once("t2", "expired", timedelta(0))
    assert await old_sqlite.take_once("t2") is None
