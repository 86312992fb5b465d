"""The suite's pool of PostgreSQL table sets (`tests/pg_tables.py`): a set handed to the
next test holds nothing the last one wrote, and a set whose schema a test changed is never
handed out again."""

from __future__ import annotations

import asyncio

import pytest

from apikeys import Hasher, KeyManager, store_from_url
from tests.conftest import TEST_PEPPER
from tests.pg_tables import PostgresTables

pytestmark = pytest.mark.postgres


async def _fetch(url: str, query: str) -> list[tuple[object, ...]]:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        return [tuple(row) for row in await conn.fetch(query)]
    finally:
        await conn.close()


async def test_a_set_given_back_is_empty_and_counts_from_one_again(postgres_url: str) -> None:
    pool = PostgresTables(postgres_url)
    name = await asyncio.to_thread(pool.take)
    manager = KeyManager(
        store_from_url(postgres_url, table_name=name), hasher=Hasher(pepper=TEST_PEPPER)
    )
    try:
        created = await manager.create(name="first", full_access=True)
        await manager.revoke(created.record.id)
        first_changes = await _fetch(postgres_url, f'SELECT seq FROM "{name}_changes" ORDER BY seq')  # noqa: S608
    finally:
        await manager.aclose()
    assert first_changes
    await asyncio.to_thread(pool.give_back, name)

    assert await asyncio.to_thread(pool.take) == name
    for table in ("", "_changes", "_log", "_audit", "_settings"):
        assert await _fetch(postgres_url, f'SELECT * FROM "{name}{table}"') == []  # noqa: S608
    manager = KeyManager(
        store_from_url(postgres_url, table_name=name), hasher=Hasher(pepper=TEST_PEPPER)
    )
    try:
        assert await manager.list() == []
        created = await manager.create(name="second", full_access=True)
        changes = await _fetch(postgres_url, f'SELECT seq FROM "{name}_changes" ORDER BY seq')  # noqa: S608
    finally:
        await manager.aclose()
    assert changes == first_changes[:1]  # numbered from 1, as in a new database


async def test_a_set_whose_schema_a_test_changed_is_not_handed_out_again(
    postgres_url: str,
) -> None:
    pool = PostgresTables(postgres_url)
    name = await asyncio.to_thread(pool.take)
    await _fetch(postgres_url, f'ALTER TABLE "{name}" ADD COLUMN extra integer')
    await asyncio.to_thread(pool.give_back, name)
    assert pool.free == []
    assert await asyncio.to_thread(pool.take) != name
