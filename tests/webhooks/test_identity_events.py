"""`identity.*` webhook events: one per change of an identity, with its snapshot, on every
store that keeps webhooks, delivered to a receiver that verifies them as Standard Webhooks
do; and `identity.usage_threshold` for the windows of an identity's limits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from standardwebhooks import Webhook

from apikeys import Hasher, KeyManager
from apikeys.ratelimit import RateLimiter
from apikeys.stores import KeyStore
from apikeys.stores.redis import RedisStore
from apikeys.types import utcnow
from apikeys.webhooks import Deliverer, DeliveryOptions
from apikeys.webhooks.admin import add_endpoint
from apikeys.webhooks.events import EVENT_TYPES, IDENTITY_EVENT_TYPES
from apikeys.webhooks.model import Endpoint
from tests.conftest import SCALE_OUT_STORES, STORES
from tests.webhooks.receiver import Receiver
from tests.webhooks.test_webhooks import hooks_of

FAST = DeliveryOptions(
    poll_interval=0.02, retry_delays=(0.05, 0.1), timeout=2, lease=10, allow_private_targets=True
)
PEPPER = b"ZC2n0Hk5tE7Lr3vuJ9yJ5zT1mKXnhA6pbeOqW4sYw8Q"


@pytest.fixture(params=[*STORES, *SCALE_OUT_STORES])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Every store that keeps webhooks (`store` in tests/conftest.py makes each)."""
    return str(request.param)


@pytest.fixture
async def manager(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(store, hasher=Hasher(pepper=PEPPER), webhooks=False) as made:
        yield made


def verified(receiver: Receiver, endpoint: Endpoint) -> list[dict[str, Any]]:
    verifier = Webhook(endpoint.secret)
    return [verifier.verify(item.body, item.headers) for item in receiver.received]


async def deliver(deliverer: Deliverer, receiver: Receiver, count: int) -> None:
    """Run rounds until `receiver` got `count` requests, then a few more (anything more
    would arrive in those)."""
    async with asyncio.timeout(30):
        while len(receiver.received) < count:
            await deliverer.run_once()
            await asyncio.sleep(0.02)
    for _ in range(3):
        await deliverer.run_once()


def test_identity_events_are_subscribable_like_key_events() -> None:
    assert set(IDENTITY_EVENT_TYPES) <= set(EVENT_TYPES)
    assert all(event.startswith("identity.") for event in IDENTITY_EVENT_TYPES)


async def test_each_change_of_an_identity_is_one_signed_event_with_its_snapshot_in_order(
    store: KeyStore, manager: KeyManager, receiver: Receiver
) -> None:
    hooks = hooks_of(store)
    endpoint = await add_endpoint(hooks, receiver.url)
    deliverer = Deliverer(hooks, FAST)
    try:
        await manager.create_identity(
            "cust_42", workspace="acme", name="Customer 42", rate_limit="100/minute"
        )
        await manager.update_identity("cust_42", name="Customer Forty-Two", actor="ops")
        await manager.disable_identity("cust_42")
        await manager.enable_identity("cust_42")
        await manager.revoke_identity("cust_42")
        await deliver(deliverer, receiver, 5)
    finally:
        await deliverer.aclose()
    sent = verified(receiver, endpoint)
    assert [event["type"] for event in sent] == [
        "identity.created",
        "identity.updated",
        "identity.disabled",
        "identity.enabled",
        "identity.revoked",
    ]
    for event in sent:
        assert set(event["data"]) == {"identity"}
        assert event["data"]["identity"]["id"] == "cust_42"
        assert event["data"]["identity"]["workspace"] == "acme"
        assert event["data"]["identity"]["rate_limit"] == "100/minute"
    snapshots = [event["data"]["identity"] for event in sent]
    assert [one["name"] for one in snapshots] == ["Customer 42", *["Customer Forty-Two"] * 4]
    assert [one["status"] for one in snapshots] == [
        "active",
        "active",
        "disabled",
        "active",
        "revoked",
    ]
    assert snapshots[-1]["revoked_at"] is not None
    listed = await hooks.deliveries()
    assert {delivery.key_id for delivery in listed} == {"i:cust_42"}
    assert {delivery.workspace for delivery in listed} == {"acme"}


async def test_an_identity_event_goes_only_where_its_type_and_workspace_are_wanted(
    store: KeyStore, manager: KeyManager, receiver: Receiver
) -> None:
    hooks = hooks_of(store)
    endpoint = await add_endpoint(hooks, receiver.url, events=["identity.revoked"])
    elsewhere = await add_endpoint(hooks, receiver.url, workspace="globex")
    keys_only = await add_endpoint(hooks, receiver.url, events=["key.created"])
    deliverer = Deliverer(hooks, FAST)
    try:
        await manager.create_identity("cust_7", workspace="acme")
        await manager.disable_identity("cust_7")
        await manager.revoke_identity("cust_7")
        await deliver(deliverer, receiver, 1)
    finally:
        await deliverer.aclose()
    assert [event["type"] for event in verified(receiver, endpoint)] == ["identity.revoked"]
    by_endpoint = {delivery.webhook_id for delivery in await hooks.deliveries()}
    assert by_endpoint == {endpoint.id}
    assert elsewhere.id not in by_endpoint
    assert keys_only.id not in by_endpoint


async def test_an_identity_limits_window_sends_identity_usage_threshold_naming_its_policy(
    store: KeyStore, receiver: Receiver
) -> None:
    hooks = hooks_of(store)
    endpoint = await add_endpoint(hooks, receiver.url, events=["identity.usage_threshold"])
    keys_only = await add_endpoint(hooks, receiver.url, events=["key.usage_threshold"])
    idle = DeliveryOptions(poll_interval=3600, timeout=2, lease=10, allow_private_targets=True)
    async with KeyManager(store, hasher=Hasher(pepper=PEPPER), webhooks=idle) as manager:
        await manager.create_identity("cust_9", workspace="acme", rate_limit="daily=10/minute")
        created = await manager.create(name="k", workspace="acme", full_access=True)
        deliverer = manager.deliverer
        assert deliverer is not None
        limiter = RateLimiter("1000/minute")
        deliverer.thresholds.attach(limiter)
        await deliverer.run_once()  # sees an endpoint that wants the event: the watch is on
        admitted = [
            (
                await limiter.hit_policies(
                    created.record.id, identity="cust_9", identity_policies="daily=10/minute"
                )
            ).allowed
            for _ in range(11)
        ]
        assert admitted == [True] * 10 + [False]
        await deliver(deliverer, receiver, 3)
    sent = verified(receiver, endpoint)
    assert {event["type"] for event in sent} == {"identity.usage_threshold"}
    assert sorted(event["data"]["threshold"] for event in sent) == [80, 90, 100]
    for event in sent:
        assert event["data"]["identity"]["id"] == "cust_9"
        assert event["data"]["policy"] == "identity.daily"
        assert event["data"]["source"] == "rate_limit"
        assert event["data"]["limit"] == 10
        assert "key" not in event["data"]
    listed = await hooks.deliveries()
    assert {delivery.key_id for delivery in listed} == {"i:cust_9"}
    assert keys_only.id not in {delivery.webhook_id for delivery in listed}


async def test_requests_through_the_middleware_send_identity_usage_threshold(
    store: KeyStore, receiver: Receiver
) -> None:
    from tests.webhooks.test_rate_thresholds import app_of, send

    hooks = hooks_of(store)
    endpoint = await add_endpoint(hooks, receiver.url, events=["identity.usage_threshold"])
    idle = DeliveryOptions(poll_interval=3600, timeout=2, lease=10, allow_private_targets=True)
    async with KeyManager(store, hasher=Hasher(PEPPER), webhooks=idle) as manager:
        await manager.create_identity("cust_5", workspace="acme", rate_limit="10/minute")
        first, second = [
            await manager.create(name=name, workspace="acme", full_access=True, identity="cust_5")
            for name in ("a", "b")
        ]
        deliverer = manager.deliverer
        assert deliverer is not None
        await deliverer.run_once()  # sees an endpoint that wants the event: the watch is on
        app = app_of(manager)
        # Two keys, one identity's window of ten: the eleventh request is refused.
        statuses = await send(app, first.key, 6) + await send(app, second.key, 5)
        assert statuses == [200] * 10 + [429]
        await deliver(deliverer, receiver, 3)
    sent = verified(receiver, endpoint)
    assert sorted(event["data"]["threshold"] for event in sent) == [80, 90, 100]
    assert {event["data"]["policy"] for event in sent} == {"identity.default"}
    assert {event["data"]["identity"]["id"] for event in sent} == {"cust_5"}


async def test_an_identitys_credits_send_identity_usage_threshold_once_per_period(
    store: KeyStore, manager: KeyManager, receiver: Receiver
) -> None:
    hooks = hooks_of(store)
    endpoint = await add_endpoint(hooks, receiver.url, events=["identity.usage_threshold"])
    keys_only = await add_endpoint(hooks, receiver.url, events=["key.usage_threshold"])
    await manager.create_identity("cust_c", workspace="acme", credit_refill="10/day")
    await manager.create_identity("cust_gone", workspace="acme", credit_refill="10/day")
    await manager.update_identity("cust_c", credits=1)  # 9 of the day's 10 used
    await manager.update_identity("cust_gone", credits=0)
    await manager.revoke_identity("cust_gone")
    deliverer = Deliverer(hooks, FAST)
    try:
        for _ in range(2):  # a second look makes nothing new
            await hooks.usage_thresholds(utcnow())
        await deliver(deliverer, receiver, 2)
    finally:
        await deliverer.aclose()
    sent = verified(receiver, endpoint)
    assert sorted(event["data"]["threshold"] for event in sent) == [80, 90]
    for event in sent:
        assert event["type"] == "identity.usage_threshold"
        assert event["data"]["identity"]["id"] == "cust_c"
        assert (event["data"]["source"], event["data"]["used"]) == ("credits", 9)
        assert event["data"]["granted"] == 10
    listed = await hooks.deliveries()
    assert {delivery.key_id for delivery in listed} == {"i:cust_c"}
    assert keys_only.id not in {delivery.webhook_id for delivery in listed}


async def test_a_cluster_identity_outbox_left_out_of_the_index_is_found_by_the_sweep(
    store: KeyStore, manager: KeyManager
) -> None:
    if not isinstance(store, RedisStore) or store.deployment != "cluster":
        pytest.skip("only a Redis Cluster counts an outbox after the change's script")
    hooks = hooks_of(store)
    await add_endpoint(hooks, "http://127.0.0.1:9/hooks")
    await manager.create_identity("cust_s", workspace="acme")
    # As if the process that made the change died before it counted the identity's outbox.
    assert await store.client.zrem(store.outbox_index_name, "i:cust_s") == 1
    assert await hooks.take(utcnow()) == 0
    await hooks.expiring(utcnow())
    assert await hooks.take(utcnow()) == 1
    assert [(d.event, d.key_id) for d in await hooks.deliveries()] == [
        ("identity.created", "i:cust_s")
    ]
