"""`RevealStore`: a new key is shown once, to its user, within 5 minutes, and is never at rest.

Each test runs on every store of the table (memory, SQLite, PostgreSQL, Redis), as the page
does with the store its manager uses.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import pytest

from apikeys import KeyManager, parse_key
from apikeys.errors import ConfigurationError
from apikeys.stores import KeyStore, MemoryStore
from apikeys.ui import KeysPage, PageUser, Reveal, RevealStore
from apikeys.ui.onetime import _slot


async def new_reveal(manager: KeyManager, user_id: str = "u_1") -> Reveal:
    created = await manager.create(name="integration", workspace="acme", scopes=["a:read"])
    return Reveal(created.key, created.record, user_id)


async def at_rest(store: KeyStore) -> str:
    """Everything the store holds, as text: its rows, or its Redis keys and their values."""
    if isinstance(store, MemoryStore):
        return repr(store._once) + repr(store._keys)
    if type(store).__name__ == "SQLStore":
        import sqlalchemy as sa

        from apikeys.stores.sql.schema import store_tables
        from apikeys.stores.sql.store import SQLStore

        assert isinstance(store, SQLStore)
        rows = []
        async with store.engine.connect() as conn:
            for table in store_tables(store.table.name):
                rows += [repr(row) for row in await conn.execute(sa.select(table))]
        return "\n".join(rows)
    client: Any = store.client  # type: ignore[attr-defined]
    dump = []
    async for name in client.scan_iter(match=f"{store.key_prefix}*"):  # type: ignore[attr-defined]
        kind = await client.type(name)
        if kind == "string":
            dump.append(f"{name} {await client.get(name)}")
        elif kind == "hash":
            dump.append(f"{name} {await client.hgetall(name)}")
        elif kind == "list":
            dump.append(f"{name} {await client.lrange(name, 0, -1)}")
        else:
            dump.append(f"{name} {kind}")
    return "\n".join(dump)


async def test_a_new_key_is_revealed_once_to_its_user_then_never(manager: KeyManager) -> None:
    reveals = RevealStore(manager.store)
    reveal = await new_reveal(manager)
    half = await reveals.put(reveal)

    assert await reveals.pop(half, "u_2") is None  # another user's page cannot spend it
    shown = await reveals.pop(half, "u_1")
    assert shown is not None
    assert shown.key == reveal.key
    assert shown.record.id == reveal.record.id
    assert await reveals.pop(half, "u_1") is None  # a replay finds nothing


async def test_if_many_pages_pop_one_key_at_once_then_exactly_one_shows_it(
    manager: KeyManager,
) -> None:
    reveals = RevealStore(manager.store)
    half = await reveals.put(await new_reveal(manager))
    shown = await asyncio.gather(*(reveals.pop(half, "u_1") for _ in range(10)))
    assert sum(reveal is not None for reveal in shown) == 1


async def test_a_rolled_key_is_revealed_with_the_key_it_replaces(manager: KeyManager) -> None:
    reveals = RevealStore(manager.store)
    old = await manager.create(name="old", workspace="acme", scopes=["a:read"])
    rolled = await manager.roll(old.record.id, grace=timedelta(hours=1))
    previous = await manager.get(old.record.id)
    half = await reveals.put(Reveal(rolled.key, rolled.record, "u_1", rolled_from=previous))
    shown = await reveals.pop(half, "u_1")
    assert shown is not None
    assert shown.rolled_from is not None
    assert shown.rolled_from.id == old.record.id
    assert shown.old_expires_at == previous.expires_at


async def test_if_five_minutes_have_passed_then_the_key_is_not_revealed(
    manager: KeyManager,
) -> None:
    expired = RevealStore(manager.store, ttl=timedelta(0))
    assert await expired.pop(await expired.put(await new_reveal(manager)), "u_1") is None
    soon = RevealStore(manager.store, ttl=timedelta(milliseconds=50))
    half = await soon.put(await new_reveal(manager))
    await asyncio.sleep(0.5)
    assert await soon.pop(half, "u_1") is None
    assert RevealStore(manager.store).ttl == timedelta(minutes=5)


@pytest.mark.parametrize("field", ["pad", "mac", "token", "id"])
async def test_if_the_cookie_half_was_changed_then_nothing_is_revealed(
    manager: KeyManager, field: str
) -> None:
    reveals = RevealStore(manager.store)
    other = await new_reveal(manager)
    half = await reveals.put(await new_reveal(manager))
    changed = dict(half)
    if field == "id":
        changed["id"] = other.record.id
    else:
        value = half[field]
        changed[field] = ("B" if value[0] == "A" else "A") + value[1:]
    assert await reveals.pop(changed, "u_1") is None


@pytest.mark.parametrize("half", [None, "a nonce of an older release", {}, {"token": 1}, []])
async def test_if_the_cookie_half_is_not_one_then_nothing_is_revealed(
    manager: KeyManager, half: object
) -> None:
    assert await RevealStore(manager.store).pop(half, "u_1") is None


async def test_if_the_sealed_half_was_changed_in_the_store_then_nothing_is_revealed(
    manager: KeyManager,
) -> None:
    reveals = RevealStore(manager.store)
    half = await reveals.put(await new_reveal(manager))
    slot = _slot(half["token"], "u_1")
    sealed = await manager.store.take_once(slot)
    assert sealed is not None
    flipped = ("B" if sealed[0] == "A" else "A") + sealed[1:]
    await manager.store.put_once(slot, flipped, timedelta(minutes=5))
    assert await reveals.pop(half, "u_1") is None


async def test_the_key_is_in_neither_half_nor_anywhere_at_rest(manager: KeyManager) -> None:
    reveals = RevealStore(manager.store)
    reveal = await new_reveal(manager)
    secret = parse_key(reveal.key).secret
    half = await reveals.put(reveal)

    cookie = json.dumps(half)
    stored = await at_rest(manager.store)
    assert _slot(half["token"], "u_1") in stored  # the sealed half is there, read raw
    for text in (cookie, stored, repr(reveals), repr(reveal)):
        assert reveal.key not in text
        assert secret not in text
    assert await reveals.pop(half, "u_1") is not None
    assert _slot(half["token"], "u_1") not in await at_rest(manager.store)


async def no_user(request: Any) -> PageUser | None:
    return None


def test_if_the_store_keeps_no_one_time_values_then_the_page_says_what_to_do() -> None:
    class OwnStore(MemoryStore):
        put_once = KeyStore.put_once
        take_once = KeyStore.take_once

    manager = KeyManager(OwnStore())
    with pytest.raises(ConfigurationError, match="reveals=RevealStore"):
        KeysPage(manager, user=no_user, secret_key="s")
    page = KeysPage(manager, user=no_user, secret_key="s", reveals=RevealStore(MemoryStore()))
    assert isinstance(page.reveals.store, MemoryStore)
