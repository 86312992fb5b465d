"""Webhook deliveries listed a page at a time (`WebhookStore.deliveries_page`), on every
store that keeps webhooks: a walk through the pages gets every delivery that stays listed
exactly once, in the store's one order (newest first by `Delivery.order`, then id), with
any page size and filter, also when deliveries share an order (one event for several
endpoints, several timed deliveries for one endpoint) and when the delivery a page ended
with leaves the listing before the next page is read (sent, replayed, removed)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta

import pytest

from apikeys import Hasher, KeyManager
from apikeys.listing import DeliveryPosition
from apikeys.stores import KeyStore
from apikeys.stores.contract import WebhookStore
from apikeys.types import utcnow
from apikeys.webhooks.admin import add_endpoint
from apikeys.webhooks.model import Delivery, DeliveryStatus, Timed, delivery_id
from tests.conftest import SCALE_OUT_STORES, STORES, TEST_PEPPER

FILTERS: list[tuple[DeliveryStatus | None, str | None]] = [
    (None, None),
    ("pending", None),
    ("delivered", None),
    ("failed", None),
    (None, "a"),
    ("pending", "a"),
    ("delivered", "b"),
]


@pytest.fixture(params=[*STORES, *SCALE_OUT_STORES])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Every store that keeps webhooks (`store` in tests/conftest.py makes each)."""
    return str(request.param)


@pytest.fixture
async def manager(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(store, hasher=Hasher(pepper=TEST_PEPPER), webhooks=False) as made:
        yield made


def hooks_of(store: KeyStore) -> WebhookStore:
    hooks = store.webhooks()
    assert hooks is not None
    return hooks


def place(delivery: Delivery) -> DeliveryPosition:
    assert delivery.order is not None
    return delivery.order, delivery.id


async def walk(
    hooks: WebhookStore, size: int, status: DeliveryStatus | None, workspace: str | None
) -> list[Delivery]:
    """Every page of the listing, `size` at a time, each read after the last one's end."""
    walked: list[Delivery] = []
    start: DeliveryPosition | None = None
    while True:
        page = await hooks.deliveries_page(start, status=status, workspace=workspace, limit=size)
        assert len(page) <= size
        walked += page
        if len(page) < size:
            return walked
        assert start is None or place(page[0]) < start  # each page after the last
        start = place(page[-1])


async def finish_some(hooks: WebhookStore, statuses: list[DeliveryStatus]) -> None:
    """Claim what is first in line and record an attempt of each, with the statuses in
    turn (a claim leases one delivery per endpoint and key)."""
    now = utcnow()
    claimed = await hooks.claim("pages", now, now + timedelta(minutes=1), 100)
    for number, item in enumerate(claimed):
        await hooks.finish(
            item.id,
            "pages",
            now=now,
            status=statuses[number % len(statuses)],
            next_attempt_at=now,
            response=200,
            error=None,
        )


async def make_deliveries(manager: KeyManager, hooks: WebhookStore) -> list[Delivery]:
    """Deliveries of three endpoints (two for every workspace, one for `a`) about keys of
    workspaces `a` and `b`, and timed ones that share one order per endpoint; some
    delivered, some failed. Every delivery, as `deliveries` lists them."""
    every = await add_endpoint(hooks, "http://127.0.0.1:9/every")
    also = await add_endpoint(hooks, "http://127.0.0.1:9/also")
    await add_endpoint(hooks, "http://127.0.0.1:9/a", workspace="a")
    made = []
    for number in range(4):
        for workspace in ("a", "b"):
            made.append(
                await manager.create(name=f"k{number}", workspace=workspace, full_access=True)
            )
    await hooks.take(utcnow())
    await finish_some(hooks, ["delivered", "failed", "pending"])
    for made_key in made[:3]:
        await manager.revoke(made_key.record.id)
    await hooks.take(utcnow())
    timed = [
        Timed(
            id=delivery_id(endpoint.id, key.record.id, "pages"),
            webhook_id=endpoint.id,
            key_id=key.record.id,
            event="key.expiring",
            body=b"{}",
            workspace=key.record.workspace,
        )
        for endpoint in (every, also)
        for key in made
    ]
    assert await hooks.make_deliveries(timed, utcnow()) == len(timed)
    await finish_some(hooks, ["delivered", "failed"])
    listed = await hooks.deliveries(limit=1000)
    # 8 keys' key.created to 2 endpoints, 4 of them to `a`'s; 3 revoked alike; 16 timed.
    assert len(listed) == 8 * 2 + 4 + 3 * 2 + 2 + 16
    return listed


async def test_a_walk_through_the_pages_gets_every_delivery_once_in_order(
    store: KeyStore, manager: KeyManager
) -> None:
    hooks = hooks_of(store)
    every = await make_deliveries(manager, hooks)
    assert [place(d) for d in every] == sorted({place(d) for d in every}, reverse=True)
    assert {d.status for d in every} == {"pending", "delivered", "failed"}
    orders = [d.order for d in every]
    assert len(set(orders)) < len(orders) / 2  # many deliveries share an order
    for status, workspace in FILTERS:
        expected = [
            d
            for d in every
            if (status is None or d.status == status)
            and (workspace is None or d.workspace == workspace)
        ]
        assert expected, (status, workspace)
        assert await hooks.deliveries(status=status, workspace=workspace) == expected
        for size in (1, 2, 3, 7, 1000):
            assert await walk(hooks, size, status, workspace) == expected, (status, workspace)
    last = place(every[-1])
    assert await hooks.deliveries_page(last) == []
    oldest = [d for d in every if d.order == last[0]]
    assert await hooks.deliveries_page((last[0] + 1, ""), limit=1000) == oldest
    for found in every:
        assert await hooks.delivery(found.id) == found


async def test_a_page_after_a_delivery_that_left_the_listing_starts_where_it_was(
    store: KeyStore, manager: KeyManager
) -> None:
    hooks = hooks_of(store)
    await make_deliveries(manager, hooks)
    delivered = await hooks.deliveries(status="delivered", limit=1000)
    walked: list[Delivery] = []
    replayed = set()
    start: DeliveryPosition | None = None
    while page := await hooks.deliveries_page(start, status="delivered", limit=2):
        assert start is None or place(page[0]) < start
        walked += page
        start = place(page[-1])
        # The page's last delivery is replayed meanwhile: it is listed as delivered no more.
        assert await hooks.replay(page[-1].id, utcnow())
        replayed.add(page[-1].id)
    assert walked == delivered
    left = await hooks.deliveries(status="delivered")
    assert [d.id for d in left] == [d.id for d in delivered if d.id not in replayed]
    # And after one that is gone: its endpoint removed, with its deliveries.
    every = await hooks.deliveries(limit=1000)
    middle = every[len(every) // 2]
    expected = [d for d in every[len(every) // 2 + 1 :] if d.webhook_id != middle.webhook_id]
    assert await hooks.remove_endpoint(middle.webhook_id)
    assert await hooks.delivery(middle.id) is None
    assert await walk_after(hooks, place(middle)) == expected


async def test_a_page_after_a_delivery_sent_meanwhile_starts_where_it_was(
    store: KeyStore, manager: KeyManager
) -> None:
    hooks = hooks_of(store)
    for name in ("one", "two", "three"):
        await add_endpoint(hooks, f"http://127.0.0.1:9/{name}")
    for number in range(4):
        await manager.create(name=f"k{number}", full_access=True)
    await hooks.take(utcnow())
    pending = await hooks.deliveries(status="pending")
    assert len(pending) == 12  # each one first in its line (one per endpoint and key)
    walked: list[Delivery] = []
    start: DeliveryPosition | None = None
    while page := await hooks.deliveries_page(start, status="pending", limit=2):
        assert start is None or place(page[0]) < start
        walked += page
        start = place(page[-1])
        # The page's last delivery is sent meanwhile: it is listed as pending no more.
        now = utcnow()
        for item in await hooks.claim("pages", now, now + timedelta(minutes=1), 100):
            sent = item.id == page[-1].id
            await hooks.finish(
                item.id,
                "pages",
                now=now,
                status="delivered" if sent else "pending",
                next_attempt_at=now,
                response=200 if sent else 503,
                error=None,
            )
        assert (await hooks.delivery(page[-1].id)).status == "delivered"  # type: ignore[union-attr]
    assert [d.id for d in walked] == [d.id for d in pending]


async def walk_after(hooks: WebhookStore, start: DeliveryPosition) -> list[Delivery]:
    walked = []
    while page := await hooks.deliveries_page(start, limit=4):
        assert place(page[0]) < start
        walked += page
        start = place(page[-1])
    return walked


class OnePageDeep(WebhookStore):
    """A webhook store of one's own written before `deliveries_page`: it lists the newest
    deliveries only, and its deliveries carry no order."""

    def __init__(self, listed: list[Delivery]) -> None:
        self.listed = listed

    async def deliveries(
        self,
        *,
        status: DeliveryStatus | None = None,
        workspace: str | None = None,
        limit: int = 100,
    ) -> list[Delivery]:
        return self.listed[:limit]

    # What a listing never calls.
    add_endpoint = endpoints = remove_endpoint = roll_secret = take = expiring = None  # type: ignore[assignment]
    claim = finish = delivery = replay = None  # type: ignore[assignment]


@pytest.mark.parametrize("store_kind", ["memory"])
async def test_a_webhook_store_of_ones_own_is_listed_one_page_deep(
    store: KeyStore, manager: KeyManager
) -> None:
    every = [replace(d, order=None) for d in await make_deliveries(manager, hooks_of(store))]
    own = OnePageDeep(every)
    assert await own.deliveries_page(None, limit=5) == every[:5]
    assert await own.deliveries_page((2**62, "msg_"), limit=5) == []
