"""`key.usage_threshold` for rate limit windows: requests through the middleware, a
receiver started here, and the deliverer's rounds run by the test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from apikeys import APIKeyMiddleware, Hasher, KeyManager, MemoryStore
from apikeys.ratelimit import RateLimiter, ThresholdCrossing
from apikeys.stores import KeyStore
from apikeys.types import utcnow
from apikeys.webhooks import Deliverer, DeliveryOptions
from apikeys.webhooks.admin import add_endpoint
from apikeys.webhooks.model import Endpoint, Timed, delivery_id
from tests.conftest import delete_redis_keys_now
from tests.conftest import redis_prefix as tagged_prefix
from tests.webhooks.receiver import Receiver
from tests.webhooks.test_webhooks import hooks_of

# The rounds are the test's own: the background task waits an hour before its first.
# The receivers here listen on 127.0.0.1: internal targets are allowed explicitly.
IDLE = DeliveryOptions(poll_interval=3600, timeout=2, lease=10, allow_private_targets=True)
PEPPER = b"rEnq6hZybJkAJ8Ne0W0NSlsCksLb6pnppmz4eiEf5mA"


async def ok(request: Any) -> PlainTextResponse:
    return PlainTextResponse("ok")


def app_of(manager: KeyManager, limiter: RateLimiter | None = None) -> APIKeyMiddleware:
    return APIKeyMiddleware(
        Starlette(routes=[Route("/api/things", ok)]),
        manager=manager,
        protect="/api/",
        rate_limit="1000/minute",
        limiter=limiter,
    )


async def send(app: APIKeyMiddleware, key: str, count: int) -> list[int]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        headers = {"Authorization": f"Bearer {key}"}
        return [
            (await client.get("/api/things", headers=headers)).status_code for _ in range(count)
        ]


def deliverer_of(manager: KeyManager) -> Deliverer:
    deliverer = manager.deliverer
    assert deliverer is not None
    return deliverer


async def rounds_until(receiver: Receiver, count: int, *managers: KeyManager) -> None:
    """Run delivery rounds until `receiver` got `count` requests, then a few more rounds
    (anything more would arrive in those)."""
    async with asyncio.timeout(30):
        while len(receiver.received) < count:
            for manager in managers:
                await deliverer_of(manager).run_once()
            await asyncio.sleep(0.01)
    for _ in range(3):
        for manager in managers:
            await deliverer_of(manager).run_once()


def events(receiver: Receiver, endpoint: Endpoint) -> list[dict[str, Any]]:
    verifier = Webhook(endpoint.secret)
    return [verifier.verify(item.body, item.headers) for item in receiver.received]


@pytest.fixture
async def manager(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(store, hasher=Hasher(pepper=PEPPER), webhooks=IDLE) as made:
        yield made


@pytest.fixture
def redis_limiter_prefix(redis_url: str) -> Iterator[str]:
    prefix = tagged_prefix("limits")
    try:
        yield prefix
    finally:
        delete_redis_keys_now(redis_url, f"*{prefix}*")


async def test_ten_a_minute_sends_80_90_and_100_once_each_and_only_where_wanted(
    store: KeyStore, manager: KeyManager, receiver: Receiver
) -> None:
    hooks = hooks_of(store)
    endpoint = await add_endpoint(hooks, receiver.url, events=["key.usage_threshold"])
    others = [
        await add_endpoint(hooks, "http://127.0.0.1:9/revoked", events=["key.revoked"]),
        await add_endpoint(
            hooks, "http://127.0.0.1:9/globex", events=["key.usage_threshold"], workspace="globex"
        ),
    ]
    app = app_of(manager)
    created = await manager.create(
        name="metered", workspace="acme", full_access=True, rate_limit="10/minute"
    )
    await deliverer_of(manager).run_once()  # sees an endpoint that wants the event
    assert await send(app, created.key, 11) == [200] * 10 + [429]
    await rounds_until(receiver, 3, manager)
    assert await send(app, created.key, 3) == [429] * 3  # the same window, used up
    await rounds_until(receiver, 3, manager)
    sent = events(receiver, endpoint)
    assert len(sent) == 3
    assert sorted((event["data"]["threshold"], event["data"]["used"]) for event in sent) == [
        (80, 8),
        (90, 9),
        (100, 10),
    ]
    for event in sent:
        assert event["type"] == "key.usage_threshold"
        data = event["data"]
        assert data["key"]["id"] == created.record.id
        assert data["key"]["rate_limit"] == "10/minute"
        assert (data["source"], data["policy"], data["limit"], data["window"]) == (
            "rate_limit",
            "default",
            10,
            60,
        )
        assert data["window_end"] > event["timestamp"]
    assert len({event["data"]["window_end"] for event in sent}) == 1
    secret = created.key.rsplit("_", 1)[1]
    assert all(secret[:32] not in item.body.decode() for item in receiver.received)
    made = await hooks.deliveries()
    assert {(d.webhook_id, d.event) for d in made} == {(endpoint.id, "key.usage_threshold")}
    assert len(made) == 3
    assert all(other.id not in {d.webhook_id for d in made} for other in others)


async def test_named_policies_send_their_own_thresholds(
    store: KeyStore, manager: KeyManager, receiver: Receiver
) -> None:
    hooks = hooks_of(store)
    endpoint = await add_endpoint(hooks, receiver.url, events=["key.usage_threshold"])
    app = app_of(manager)
    created = await manager.create(
        name="bursty", full_access=True, rate_limit="burst=5/minute, daily=6/hour"
    )
    await deliverer_of(manager).run_once()
    assert await send(app, created.key, 7) == [200] * 5 + [429] * 2
    await rounds_until(receiver, 4, manager)
    sent = sorted(
        (event["data"]["policy"], event["data"]["threshold"], event["data"]["used"])
        for event in events(receiver, endpoint)
    )
    # burst: 4, 5 and 5 of 5; daily: 5 of 6 is its 80 % (the refused two charged nothing).
    assert sent == [("burst", 80, 4), ("burst", 90, 5), ("burst", 100, 5), ("daily", 80, 5)]
    windows = {
        event["data"]["policy"]: event["data"]["window"] for event in events(receiver, endpoint)
    }
    assert windows == {"burst": 60, "daily": 3600}


@pytest.mark.redis
async def test_two_processes_on_one_redis_limiter_send_each_threshold_once(
    store: KeyStore,
    receiver: Receiver,
    redis_url: str,
    redis_limiter_prefix: str,
) -> None:
    hooks = hooks_of(store)
    endpoint = await add_endpoint(hooks, receiver.url, events=["key.usage_threshold"])
    limiters = [
        RateLimiter("1000/minute", redis_url, key_prefix=redis_limiter_prefix) for _ in range(2)
    ]
    managers = [KeyManager(store, hasher=Hasher(pepper=PEPPER), webhooks=IDLE) for _ in range(2)]
    try:
        apps = [
            app_of(manager, limiter) for manager, limiter in zip(managers, limiters, strict=True)
        ]
        created = await managers[0].create(name="shared", full_access=True, rate_limit="10/minute")
        for manager in managers:
            await deliverer_of(manager).run_once()
        statuses = []
        for turn in range(14):
            statuses += await send(apps[turn % 2], created.key, 1)
        assert sorted(statuses) == [200] * 10 + [429] * 4
        await rounds_until(receiver, 3, *managers)
    finally:
        for manager in managers:
            await manager.aclose()
        for limiter in limiters:
            await limiter.aclose()
    sent = events(receiver, endpoint)
    assert sorted(event["data"]["threshold"] for event in sent) == [80, 90, 100]
    assert len({event["data"]["window_end"] for event in sent}) <= 2  # measured per lease
    assert len(await hooks.deliveries()) == 3


async def test_without_an_endpoint_that_wants_it_no_limiter_is_observed() -> None:
    store = MemoryStore()
    hooks = hooks_of(store)
    async with KeyManager(store, hasher=Hasher(pepper=PEPPER), webhooks=IDLE) as manager:
        app = app_of(manager)
        deliverer = deliverer_of(manager)
        await deliverer.run_once()
        assert app.limiter.on_threshold is None
        assert manager.limiter.on_threshold is None
        await add_endpoint(hooks, "http://127.0.0.1:9/revoked", events=["key.revoked"])
        await deliverer.run_once()
        assert app.limiter.on_threshold is None
        wanting = await add_endpoint(hooks, "http://127.0.0.1:9/all")  # every event
        await deliverer.run_once()
        assert app.limiter.on_threshold is not None
        assert manager.limiter.on_threshold is not None
        assert await hooks.remove_endpoint(wanting.id)
        await deliverer.run_once()
        assert app.limiter.on_threshold is None
        assert manager.limiter.on_threshold is None

        # A limiter with an observer of its own keeps it.
        told: list[ThresholdCrossing] = []
        own = RateLimiter("10/minute")
        own.on_threshold = told.append
        app_of(manager, own)
        await add_endpoint(hooks, "http://127.0.0.1:9/again", events=["key.usage_threshold"])
        await deliverer.run_once()
        assert own.on_threshold == told.append
        assert app.limiter.on_threshold is not None
    assert app.limiter.on_threshold is None  # a closed manager watches nothing
    assert own.on_threshold == told.append
    await own.aclose()
    async with KeyManager(MemoryStore(), webhooks=False) as quiet:
        assert quiet.deliverer is None
        assert app_of(quiet).limiter.on_threshold is None


async def test_a_delivery_made_twice_is_stored_once_and_none_for_a_removed_endpoint(
    store: KeyStore, manager: KeyManager
) -> None:
    hooks = hooks_of(store)
    kept = await add_endpoint(hooks, "http://127.0.0.1:9/kept")
    gone = await add_endpoint(hooks, "http://127.0.0.1:9/gone")
    created = await manager.create(name="a", full_access=True)
    await hooks.take(utcnow())  # the key.created deliveries
    assert await hooks.remove_endpoint(gone.id)

    def timed(endpoint: Endpoint, threshold: int) -> Timed:
        return Timed(
            delivery_id(endpoint.id, created.record.id, "default", f"{threshold}%", "end"),
            endpoint.id,
            created.record.id,
            "key.usage_threshold",
            b'{"type":"key.usage_threshold"}',
            created.record.workspace,
        )

    now = utcnow()
    assert await hooks.make_deliveries([timed(kept, 80), timed(gone, 80)], now) == 1
    assert await hooks.make_deliveries([timed(kept, 80), timed(kept, 90)], now) == 1
    assert await hooks.make_deliveries([], now) == 0
    made = [d for d in await hooks.deliveries() if d.event == "key.usage_threshold"]
    assert sorted(d.id for d in made) == sorted([timed(kept, 80).id, timed(kept, 90).id])
