"""Listing keys a page at a time through `KeyManager` (issue #23, item 16): cursors, page
sizes and filters, on every store; the store's side is in the conformance table."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apikeys import InvalidKeyParameters, KeyManager, KeyPage
from apikeys.hashing import Hasher
from apikeys.listing import (
    MAX_PAGE_SIZE,
    decode_cursor,
    decode_delivery_cursor,
    encode_cursor,
)
from apikeys.sync import KeyManager as SyncKeyManager
from tests.conftest import TEST_PEPPER

moments = st.datetimes(
    min_value=datetime(1970, 1, 1), max_value=datetime(9999, 1, 1), timezones=st.just(UTC)
)
ids = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=64)


@given(moments, ids)
def test_a_cursor_gives_back_the_position_it_was_made_from(moment: datetime, key_id: str) -> None:
    cursor = encode_cursor((moment, key_id))
    assert decode_cursor(cursor) == (moment, key_id)
    assert set(cursor) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1), ids)
def test_a_delivery_cursor_gives_back_the_position_it_was_made_from(
    order: int, delivery_id: str
) -> None:
    assert decode_delivery_cursor(encode_cursor((order, delivery_id))) == (order, delivery_id)


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


BAD_CURSORS = [
    "",
    "garbage",
    "%%%",
    "é",
    "A" * 201,
    _b64("1.1."),  # no id
    _b64("2.1.abc"),  # another version
    _b64("1.x.abc"),  # not a time
    _b64("1.9999999999999999999.abc"),  # past year 9999
    _b64("1.-9999999999999999999.abc"),  # before year 1
    _b64("1.1.ab c"),  # a space in the id
    _b64("1.1." + "a" * 65),  # an id too long
]


@pytest.mark.parametrize("cursor", [*BAD_CURSORS, _b64("1.9223372036854775808.a")])
def test_a_delivery_cursor_not_made_here_is_refused_with_a_clear_error(cursor: str) -> None:
    # A delivery's order is a 64-bit integer: one past it names no delivery.
    with pytest.raises(InvalidKeyParameters, match="invalid cursor"):
        decode_delivery_cursor(cursor)


@pytest.mark.parametrize("cursor", BAD_CURSORS)
async def test_a_cursor_not_made_here_is_refused_with_a_clear_error(cursor: str) -> None:
    async with KeyManager("memory://", hasher=Hasher(pepper=TEST_PEPPER)) as manager:
        await manager.create(name="n", workspace="w", full_access=True)
        with pytest.raises(InvalidKeyParameters, match="invalid cursor"):
            await manager.list_page(cursor=cursor)


@pytest.mark.parametrize("limit", [0, -1, MAX_PAGE_SIZE + 1, True, 2.5, "10", None])
async def test_a_page_size_outside_1_to_1000_is_refused(limit: Any) -> None:
    async with KeyManager("memory://", hasher=Hasher(pepper=TEST_PEPPER)) as manager:
        with pytest.raises(InvalidKeyParameters, match="page size"):
            await manager.list_page(limit=limit)
        assert (await manager.list_page(limit=MAX_PAGE_SIZE)).records == []


async def test_an_unknown_status_is_refused() -> None:
    async with KeyManager("memory://", hasher=Hasher(pepper=TEST_PEPPER)) as manager:
        with pytest.raises(InvalidKeyParameters, match="status"):
            await manager.list_page(status="rolled")  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyParameters, match="status"):
            await manager.list(status="gone")  # type: ignore[arg-type]


async def test_pages_cursors_and_iteration_agree_with_list_on_every_store(
    manager: KeyManager,
) -> None:
    made = [
        await manager.create(name=f"k{index}", workspace="acme", full_access=True, owner=owner)
        for index, owner in enumerate(["ann", "bob", "ann", None, "ann"])
    ]
    other = await manager.create(name="other", workspace="globex", full_access=True, owner="ann")
    await manager.revoke(made[2].record.id)
    successor = (await manager.roll(made[4].record.id, grace=timedelta(0))).record  # expires k4

    pages: list[KeyPage] = [await manager.list_page("acme", limit=2)]
    while pages[-1].next_cursor is not None:
        pages.append(await manager.list_page("acme", limit=2, cursor=pages[-1].next_cursor))
    every = await manager.list("acme")
    assert [len(page.records) for page in pages] == [2, 2, 2]
    assert [r for page in pages for r in page.records] == every
    assert [r async for r in manager.iter_keys("acme", page_size=4)] == every
    assert [r.id for r in every] == [c.record.id for c in made] + [successor.id]

    ann = [r.id async for r in manager.iter_keys("acme", owner="ann", page_size=1)]
    assert ann == [made[0].record.id, made[2].record.id, made[4].record.id] + (
        [successor.id] if successor.owner == "ann" else []
    )
    for status, expected in (
        ("active", [made[0].record.id, made[1].record.id, made[3].record.id, successor.id]),
        ("revoked", [made[2].record.id]),
        ("expired", [made[4].record.id]),
        ("disabled", []),
    ):
        listed = await manager.list("acme", status=status)  # type: ignore[arg-type]
        paged = [
            r
            async for r in manager.iter_keys("acme", status=status, page_size=1)  # type: ignore[arg-type]
        ]
        assert [r.id for r in listed] == expected, status
        assert paged == listed, status
    everywhere = await manager.list_page(owner="ann", status="active", limit=10)
    assert [r.id for r in everywhere.records] == [made[0].record.id, other.record.id] + (
        [successor.id] if successor.owner == "ann" else []
    )
    assert everywhere.next_cursor is None


async def test_a_cursor_holds_no_secret_and_still_works_after_its_key_is_revoked(
    manager: KeyManager,
) -> None:
    made = [await manager.create(name=f"k{i}", workspace="acme", full_access=True) for i in "ab"]
    page = await manager.list_page("acme", limit=1)
    assert page.next_cursor is not None
    decoded = base64.urlsafe_b64decode(page.next_cursor + "==").decode()
    assert made[0].key not in decoded
    assert made[0].key.rsplit("_", 1)[1][:32] not in decoded
    await manager.revoke(made[0].record.id)

    rest = await manager.list_page("acme", limit=1, cursor=page.next_cursor)

    assert [r.id for r in rest.records] == [made[1].record.id]
    assert rest.next_cursor is None


def test_the_synchronous_manager_pages_and_iterates_too() -> None:
    with SyncKeyManager("memory://", hasher=Hasher(pepper=TEST_PEPPER)) as manager:
        made = [manager.create(name=f"k{i}", workspace="w", full_access=True) for i in range(3)]
        page = manager.list_page("w", limit=2)
        assert [r.id for r in page.records] == [c.record.id for c in made[:2]]
        assert list(manager.iter_keys("w", page_size=1)) == manager.list("w")
