"""Webhooks in one process: signatures, rolled secrets, retries, failure, replay, pruning."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from standardwebhooks import Webhook, WebhookVerificationError

import apikeys.stores.sql.sqlite_channel as sqlite_channel
from apikeys import Hasher, KeyManager, MemoryStore, RateLimiter
from apikeys.gate import Gate
from apikeys.stores import KeyStore
from apikeys.stores.contract import WebhookStore
from apikeys.stores.redis import RedisStore
from apikeys.stores.redis import webhooks as redis_hooks
from apikeys.stores.sql.store import SQLStore
from apikeys.types import utcnow
from apikeys.webhooks import Deliverer, DeliveryOptions, new_secret, signed_headers
from apikeys.webhooks import delivery as delivery_module
from apikeys.webhooks.admin import add_endpoint, roll_endpoint_secret
from apikeys.webhooks.model import DeliveryStatus
from tests.conftest import SCALE_OUT_STORES, STORES
from tests.pgbouncer import free_port
from tests.webhooks.receiver import Receiver

# Every receiver here listens on 127.0.0.1: internal targets are allowed explicitly.
FAST = DeliveryOptions(
    poll_interval=0.02,
    retry_delays=(0.05, 0.1),
    timeout=2,
    lease=10,
    allow_private_targets=True,
)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(
    message_id=st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1),
    data=_JSON,
)
@settings(max_examples=50, deadline=None)
def test_every_signature_verifies_with_standard_webhooks(message_id: str, data: object) -> None:
    body = json.dumps(data).encode()
    secret = new_secret()
    headers = signed_headers([secret], message_id, int(time.time()), body)
    Webhook(secret).verify(body, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(body, headers)


def test_during_an_overlap_both_secrets_verify() -> None:
    old, new = new_secret(), new_secret()
    body = b'{"type":"key.created"}'
    headers = signed_headers([new, old], "msg_1", int(time.time()), body)
    assert len(headers["webhook-signature"].split()) == 2
    Webhook(old).verify(body, headers)
    Webhook(new).verify(body, headers)


@pytest.fixture(
    params=[
        STORES[0],
        pytest.param("sqlite", marks=pytest.mark.sqlite, id="sqlite"),
        pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
        *STORES[3:],
        *SCALE_OUT_STORES,
    ]
)
def store_kind(request: pytest.FixtureRequest) -> str:
    """Every store that keeps webhooks (`store` in tests/conftest.py makes each)."""
    return str(request.param)


@pytest.fixture
async def manager(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(
        store, hasher=Hasher(pepper=b"L8dw49pa41XlgoBNkvoeuME4lzC2vZHAO-p4QCm4Kiw"), webhooks=False
    ) as made:
        yield made


def hooks_of(store: KeyStore) -> WebhookStore:
    hooks = store.webhooks()
    assert hooks is not None
    return hooks


async def deliver_claimed(hooks: WebhookStore) -> list[Any]:
    """Claim what is due (in line first per endpoint and key), mark each delivered, and
    return their bodies."""
    now = utcnow()
    bodies = []
    for item in await hooks.claim("test", now, now + timedelta(minutes=1), 10):
        bodies.append(json.loads(item.body))
        await hooks.finish(
            item.id,
            "test",
            now=now,
            status="delivered",
            next_attempt_at=now,
            response=200,
            error=None,
        )
    return bodies


async def deliver_until(deliverer: Deliverer, done: Callable[[], bool]) -> None:
    async with asyncio.timeout(30):
        while not done():
            await deliverer.run_once()
            await asyncio.sleep(0.02)


async def test_a_rolled_secret_signs_beside_the_new_one_during_the_overlap(
    store: KeyStore, manager: KeyManager
) -> None:
    receiver = Receiver(free_port())
    await receiver.start()
    hooks = hooks_of(store)
    endpoint = await add_endpoint(hooks, receiver.url)
    new = await roll_endpoint_secret(hooks, endpoint.id)
    assert new is not None
    assert new != endpoint.secret
    deliverer = Deliverer(hooks, FAST)
    try:
        await manager.create(name="a", full_access=True)
        await deliver_until(deliverer, lambda: len(receiver.received) == 1)
    finally:
        await deliverer.aclose()
        await receiver.stop()
    item = receiver.received[0]
    assert Webhook(endpoint.secret).verify(item.body, item.headers)["type"] == "key.created"
    assert Webhook(new).verify(item.body, item.headers)["type"] == "key.created"


async def test_a_failing_receiver_is_retried_then_failed_and_the_next_event_goes(
    store: KeyStore, manager: KeyManager
) -> None:
    receiver = Receiver(free_port(), status=500)
    await receiver.start()
    hooks = hooks_of(store)
    await add_endpoint(hooks, receiver.url)
    # Retries every 0.05 s for 3 s: room for a second attempt however slow the first.
    options = DeliveryOptions(
        poll_interval=0.02, retry_delays=(0.05,), give_up_after=timedelta(seconds=3)
    )
    deliverer = Deliverer(hooks, options)
    try:
        created = await manager.create(name="a", full_access=True)
        await manager.disable(created.record.id)

        async def failed() -> bool:
            return any(d.status == "failed" for d in await hooks.deliveries())

        async with asyncio.timeout(30):
            while not await failed():
                await deliverer.run_once()
                await asyncio.sleep(0.02)
        # Every attempt so far was the first event's: the second waited behind it.
        kinds = {json.loads(item.body)["type"] for item in receiver.received}
        assert kinds == {"key.created"}
        assert len(receiver.received) >= 2
        receiver.status = 200
        await deliver_until(
            deliverer,
            lambda: json.loads(receiver.received[-1].body)["type"] == "key.disabled",
        )
    finally:
        await deliverer.aclose()
        await receiver.stop()
    listed = {d.event: d for d in await hooks.deliveries()}
    assert listed["key.created"].status == "failed"
    assert listed["key.created"].last_status == 500
    assert listed["key.disabled"].status == "delivered"
    assert [d.status for d in await hooks.deliveries(status="failed")] == ["failed"]


async def test_a_replay_sends_the_same_delivery_again(store: KeyStore, manager: KeyManager) -> None:
    receiver = Receiver(free_port())
    await receiver.start()
    hooks = hooks_of(store)
    endpoint = await add_endpoint(hooks, receiver.url, events=["key.revoked"])
    deliverer = Deliverer(hooks, FAST)
    try:
        created = await manager.create(name="a", full_access=True)
        await manager.revoke(created.record.id)
        await deliver_until(deliverer, lambda: len(receiver.received) == 1)
        (delivery,) = await hooks.deliveries()
        assert await hooks.replay(delivery.id, delivery.created_at)
        assert not await hooks.replay("msg_unknown", delivery.created_at)
        await deliver_until(deliverer, lambda: len(receiver.received) == 2)
    finally:
        await deliverer.aclose()
        await receiver.stop()
    first, again = receiver.received
    assert first.body == again.body
    assert first.headers["webhook-id"] == again.headers["webhook-id"] == delivery.id
    assert Webhook(endpoint.secret).verify(again.body, again.headers)["type"] == "key.revoked"
    (delivery,) = await hooks.deliveries()
    assert delivery.status == "delivered"
    assert delivery.attempts == 2
    assert await hooks.remove_endpoint(endpoint.id)
    assert await hooks.endpoints() == []
    assert await hooks.deliveries() == []


async def test_two_deliverers_never_send_one_delivery_twice(
    store: KeyStore, manager: KeyManager
) -> None:
    receiver = Receiver(free_port())
    await receiver.start()
    hooks = hooks_of(store)
    await add_endpoint(hooks, receiver.url)
    first, second = Deliverer(hooks, FAST), Deliverer(store.webhooks() or hooks, FAST)
    try:
        for number in range(10):
            await manager.create(name=f"k{number}", full_access=True)
        async with asyncio.timeout(30):
            while len(receiver.received) < 10:
                await asyncio.gather(first.run_once(), second.run_once())
    finally:
        await first.aclose()
        await second.aclose()
        await receiver.stop()
    ids = [item.headers["webhook-id"] for item in receiver.received]
    assert len(ids) == len(set(ids)) == 10


async def test_the_sqlite_log_keeps_what_a_webhook_has_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SQLStore(f"sqlite:///{tmp_path / 'keys.db'}")
    channel = store.channel()
    assert channel is not None
    monkeypatch.setattr(sqlite_channel, "KEEP_CHANGES", 1)
    hooks = hooks_of(store)
    try:
        async with KeyManager(
            store,
            hasher=Hasher(pepper=b"L8dw49pa41XlgoBNkvoeuME4lzC2vZHAO-p4QCm4Kiw"),
            webhooks=False,
        ) as manager:
            await add_endpoint(hooks, "http://127.0.0.1:9/hooks")
            for number in range(5):
                await manager.create(name=f"k{number}", full_access=True)
            await channel.connect("pruner", lambda notice: None)
            await channel.register(1.0)
            assert await hooks.take(utcnow()) == 5
            await channel.register(1.0)
            assert await hooks.take(utcnow()) == 0
    finally:
        await channel.disconnect()
        await store.aclose()
    with sqlite3.connect(tmp_path / "keys.db") as db:
        left = db.execute("SELECT count(*) FROM apikeys_keys_changes").fetchone()[0]
    assert left == 1


async def test_key_expiring_is_sent_once_per_key_notice_and_expiry(
    store: KeyStore, manager: KeyManager
) -> None:
    hooks = hooks_of(store)
    await add_endpoint(hooks, "http://127.0.0.1:9/hooks", events=["key.expiring"])
    soon = await manager.create(name="soon", full_access=True, expires_in=timedelta(hours=12))
    later = await manager.create(name="later", full_access=True, expires_in=timedelta(days=3))
    await manager.create(name="far", full_access=True, expires_in=timedelta(days=30))
    await manager.create(name="never", full_access=True)
    now = utcnow()
    assert await hooks.expiring(now) == 3
    assert await hooks.expiring(now + timedelta(minutes=1)) == 0  # once, whoever looks again
    await hooks.take(now)  # the other events are not this endpoint's
    made = await hooks.deliveries()
    assert sorted((d.key_id, d.event) for d in made) == sorted(
        [
            (soon.record.id, "key.expiring"),
            (soon.record.id, "key.expiring"),
            (later.record.id, "key.expiring"),
        ]
    )
    # A new expiry is a new window: its notices are sent again.
    await manager.update(later.record.id, expires_in=timedelta(days=5))
    assert await hooks.expiring(utcnow()) == 1


async def test_a_cluster_outbox_left_out_of_the_index_is_found_by_the_sweep(
    store: KeyStore, manager: KeyManager
) -> None:
    if not isinstance(store, RedisStore) or store.deployment != "cluster":
        pytest.skip("only a Redis Cluster counts an outbox after the change's script")
    hooks = hooks_of(store)
    await add_endpoint(hooks, "http://127.0.0.1:9/hooks")
    created = await manager.create(name="a", full_access=True)
    # As if the process that made the change died before it counted the key's outbox.
    assert await store.client.zrem(store.outbox_index_name, created.record.id) == 1
    assert await hooks.take(utcnow()) == 0
    await hooks.expiring(utcnow())
    assert await hooks.take(utcnow()) == 1
    assert [d.event for d in await hooks.deliveries()] == ["key.created"]


async def test_key_usage_threshold_is_sent_once_per_threshold_and_refill_period(
    store: KeyStore, manager: KeyManager
) -> None:
    hooks = hooks_of(store)
    await add_endpoint(hooks, "http://127.0.0.1:9/hooks", events=["key.usage_threshold"])
    metered = await manager.create(name="metered", full_access=True, credit_refill="100/day")
    await manager.create(name="one-off", full_access=True, credits=10)  # no refill: none
    await manager.create(name="unlimited", full_access=True)
    assert await hooks.usage_thresholds(utcnow()) == 0
    sent: list[tuple[int, int]] = []
    for spend, reached in ((79, 0), (1, 1), (5, 0), (5, 1), (9, 0), (1, 1)):
        record = await manager.get(metered.record.id)
        assert await manager.spend_credits(record, spend) is not None
        assert await hooks.usage_thresholds(utcnow()) == reached
        assert await hooks.usage_thresholds(utcnow()) == 0  # once, whoever looks again
    for _ in range(3):  # one a round: each is in line after the one before
        for body in await deliver_claimed(hooks):
            assert body["type"] == "key.usage_threshold"
            assert body["data"]["key"]["id"] == metered.record.id
            assert body["data"]["source"] == "credits"
            sent.append((body["data"]["threshold"], body["data"]["used"]))
    assert sorted(sent) == [(80, 80), (90, 90), (100, 100)]
    jumping = await manager.create(name="jumping", full_access=True, credit_refill="100/day")
    assert await manager.spend_credits(jumping.record, 95) == 5
    assert await hooks.usage_thresholds(utcnow()) == 2  # the 80 and the 90 together


async def test_a_leaked_key_is_key_leaked_or_key_revoked_to_an_endpoint_that_asks_only_for_that(
    store: KeyStore, manager: KeyManager
) -> None:
    hooks = hooks_of(store)
    every = await add_endpoint(hooks, "http://127.0.0.1:9/every")
    revocations = await add_endpoint(hooks, "http://127.0.0.1:9/revoked", events=["key.revoked"])
    leaks = await add_endpoint(hooks, "http://127.0.0.1:9/leaked", events=["key.leaked"])
    leaked = await manager.create(name="leaked", full_access=True)
    plain = await manager.create(name="plain", full_access=True)
    await manager.revoke(leaked.record.id, leaked=True)
    await manager.revoke(plain.record.id)
    await hooks.take(utcnow())
    made = {
        (d.webhook_id, d.key_id, d.event)
        for d in await hooks.deliveries()
        if d.event != "key.created"
    }
    assert made == {
        (every.id, leaked.record.id, "key.leaked"),
        (every.id, plain.record.id, "key.revoked"),
        (revocations.id, leaked.record.id, "key.revoked"),
        (revocations.id, plain.record.id, "key.revoked"),
        (leaks.id, leaked.record.id, "key.leaked"),
    }


async def test_an_endpoint_of_one_workspace_is_sent_only_that_workspaces_events(
    store: KeyStore, manager: KeyManager
) -> None:
    hooks = hooks_of(store)
    acme = await add_endpoint(hooks, "http://127.0.0.1:9/acme", workspace="acme")
    every = await add_endpoint(hooks, "http://127.0.0.1:9/every")
    ours = await manager.create(
        name="ours",
        workspace="acme",
        full_access=True,
        expires_in=timedelta(hours=12),
        credit_refill="100/day",
    )
    theirs = await manager.create(
        name="theirs",
        workspace="globex",
        full_access=True,
        expires_in=timedelta(hours=12),
        credit_refill="100/day",
    )
    for created in (ours, theirs):
        assert await manager.spend_credits(created.record, 80) is not None
    now = utcnow()
    await hooks.take(now)
    await hooks.expiring(now)
    await hooks.usage_thresholds(now)
    sent = {(d.webhook_id, d.key_id, d.event) for d in await hooks.deliveries()}
    events = {"key.created", "key.expiring", "key.usage_threshold"}
    assert {(key, event) for hook, key, event in sent if hook == acme.id} == {
        (ours.record.id, event) for event in events
    }
    assert {(key, event) for hook, key, event in sent if hook == every.id} == {
        (created.record.id, event) for created in (ours, theirs) for event in events
    }


async def test_a_revoked_key_is_sent_no_expiring_or_usage_threshold_event(
    store: KeyStore, manager: KeyManager
) -> None:
    hooks = hooks_of(store)
    await add_endpoint(
        hooks, "http://127.0.0.1:9/hooks", events=["key.expiring", "key.usage_threshold"]
    )
    created = await manager.create(
        name="gone", full_access=True, expires_in=timedelta(hours=12), credit_refill="100/day"
    )
    assert await manager.spend_credits(created.record, 90) is not None
    await manager.revoke(created.record.id)
    now = utcnow()
    assert await hooks.expiring(now) == 0
    assert await hooks.usage_thresholds(now) == 0


async def finish_claimed(hooks: WebhookStore, status: DeliveryStatus) -> list[str]:
    """Claim what is due and record each as `status` (delivered or failed) now; their ids."""
    now = utcnow()
    claimed = await hooks.claim("test", now, now + timedelta(minutes=1), 100)
    for item in claimed:
        await hooks.finish(
            item.id,
            "test",
            now=now,
            status=status,
            next_attempt_at=now,
            response=200 if status == "delivered" else 500,
            error=None,
        )
    return [item.id for item in claimed]


async def test_delivered_and_failed_deliveries_are_pruned_after_the_retention_and_pending_never(
    store: KeyStore, manager: KeyManager
) -> None:
    hooks = hooks_of(store)
    await add_endpoint(hooks, "http://127.0.0.1:9/hooks")
    for name in ("a", "b"):
        await manager.create(name=name, full_access=True)
    await hooks.take(utcnow())
    delivered = await finish_claimed(hooks, "delivered")
    for name in ("c", "d"):
        await manager.create(name=name, full_access=True)
    await hooks.take(utcnow())
    failed = await finish_claimed(hooks, "failed")
    replayed = await manager.create(name="replayed", full_access=True)
    waiting = await manager.create(name="waiting", full_access=True)
    await hooks.take(utcnow())
    (again,) = [d.id for d in await hooks.deliveries() if d.key_id == replayed.record.id]
    await finish_claimed(hooks, "delivered")  # the last two, delivered
    (pending,) = [d.id for d in await hooks.deliveries() if d.key_id == waiting.record.id]
    assert await hooks.replay(again, utcnow())  # delivered again, later
    await finish_claimed(hooks, "delivered")
    assert await hooks.replay(pending, utcnow())  # pending again: never pruned
    assert len(await hooks.deliveries()) == 6

    assert await hooks.prune(utcnow() - timedelta(days=1)) == 0  # none is that old
    later = utcnow() + timedelta(seconds=1)
    assert await hooks.prune(later, limit=2) == 2  # a batch at a time
    assert await hooks.prune(later, limit=2) == 2
    assert await hooks.prune(later, limit=2) == 1
    assert await hooks.prune(later) == 0
    (left,) = await hooks.deliveries()
    assert (left.id, left.status) == (pending, "pending")
    for gone in (*delivered, *failed, again):
        assert await hooks.delivery(gone) is None
    assert await hooks.deliveries(status="delivered") == []
    assert await hooks.deliveries(status="failed") == []
    assert [d.id for d in await hooks.deliveries(workspace="default")] == [pending]
    assert not await hooks.replay(delivered[0], utcnow())
    if isinstance(store, RedisStore):  # nothing of theirs is left, in no index either
        assert not set(await redis_names_and_members(store)) & {*delivered, *failed, again}


async def redis_names_and_members(store: RedisStore) -> list[str]:
    """The names of the store's Redis keys, and the members of its sets and sorted sets,
    each split at its colons."""
    client = store.client
    found = []
    async for name in client.scan_iter(match=f"{store.key_prefix}*"):
        found += name.split(":")
        kind = await client.type(name)
        if kind == "zset":
            found += await client.zrange(name, 0, -1)
        elif kind == "set":
            found += await client.smembers(name)
    return found


async def test_the_deliverer_prunes_what_finished_before_the_retention_a_batch_at_a_time(
    store: KeyStore, manager: KeyManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    hooks = hooks_of(store)
    await add_endpoint(hooks, "http://127.0.0.1:9/hooks")
    for number in range(5):
        await manager.create(name=f"k{number}", full_access=True)
    await hooks.take(utcnow())
    await finish_claimed(hooks, "delivered")
    await manager.create(name="pending", full_access=True)
    await hooks.take(utcnow())
    later = utcnow() + timedelta(seconds=1)
    assert await Deliverer(hooks, DeliveryOptions(retention=None)).prune(later) == 0
    assert len(await hooks.deliveries()) == 6
    monkeypatch.setattr(delivery_module, "PRUNE_BATCH", 2)
    monkeypatch.setattr(delivery_module, "PRUNE_BATCHES", 2)
    deliverer = Deliverer(hooks, DeliveryOptions(retention=timedelta(0)))
    assert await deliverer.prune(later) == 4  # two batches of two, this time
    assert await deliverer.prune(later) == 1
    assert [d.status for d in await hooks.deliveries()] == ["pending"]
    assert DeliveryOptions().retention == timedelta(days=30)


async def test_a_workspaces_deliveries_are_listed_and_found_by_id_however_busy_another_is(
    store: KeyStore, manager: KeyManager
) -> None:
    hooks = hooks_of(store)
    every = await add_endpoint(hooks, "http://127.0.0.1:9/every")
    busy = await add_endpoint(hooks, "http://127.0.0.1:9/busy", workspace="busy")
    quiet = await manager.create(
        name="quiet", workspace="quiet", full_access=True, expires_in=timedelta(hours=12)
    )
    await hooks.take(utcnow())
    await hooks.expiring(utcnow())
    for number in range(6):
        await manager.create(name=f"b{number}", workspace="busy", full_access=True)
    await hooks.take(utcnow())
    newest = await hooks.deliveries(limit=5)
    assert {d.workspace for d in newest} == {"busy"}  # the quiet workspace's are older
    ours = await hooks.deliveries(workspace="quiet", limit=5)
    assert sorted((d.event, d.webhook_id) for d in ours) == [
        ("key.created", every.id),
        ("key.expiring", every.id),  # the 7-day notice
        ("key.expiring", every.id),  # and the 1-day one
    ]
    assert {(d.key_id, d.workspace) for d in ours} == {(quiet.record.id, "quiet")}
    theirs = await hooks.deliveries(workspace="busy", limit=100)
    assert len(theirs) == 12  # each key's key.created, to both endpoints
    assert {d.webhook_id for d in theirs} == {every.id, busy.id}
    assert [d.id for d in await hooks.deliveries(workspace="busy", limit=3)] == [
        d.id for d in theirs[:3]
    ]
    assert len(await hooks.deliveries(workspace="busy", status="pending", limit=7)) == 7
    assert await hooks.deliveries(workspace="busy", status="failed") == []
    assert await hooks.deliveries(workspace="nobody") == []
    for delivery in ours:
        assert await hooks.delivery(delivery.id) == delivery
    assert (await hooks.delivery(theirs[-1].id)) == theirs[-1]
    assert await hooks.delivery("msg_000000000000000000000000") is None
    assert ours[0].to_dict()["workspace"] == "quiet"


async def test_a_claim_leases_at_most_its_limit(store: KeyStore, manager: KeyManager) -> None:
    hooks = hooks_of(store)
    await add_endpoint(hooks, "http://127.0.0.1:9/hooks")
    for number in range(5):
        await manager.create(name=f"k{number}", full_access=True)
    await hooks.take(utcnow())
    now = utcnow()
    lease = now + timedelta(minutes=1)
    first = await hooks.claim("one", now, lease, 2)
    second = await hooks.claim("two", now, lease, 2)
    third = await hooks.claim("three", now, lease, 2)
    assert [len(first), len(second), len(third)] == [2, 2, 1]
    assert len({item.id for item in (*first, *second, *third)}) == 5


async def test_an_endpoint_added_later_gets_the_notices_of_keys_already_in_their_window(
    store: KeyStore, manager: KeyManager
) -> None:
    hooks = hooks_of(store)
    first = await add_endpoint(hooks, "http://127.0.0.1:9/first", events=["key.expiring"])
    created = await manager.create(name="soon", full_access=True, expires_in=timedelta(days=3))
    assert await hooks.expiring(utcnow()) == 1
    assert await hooks.expiring(utcnow()) == 0
    second = await add_endpoint(hooks, "http://127.0.0.1:9/second", events=["key.expiring"])
    assert await hooks.expiring(utcnow()) == 1
    assert await hooks.expiring(utcnow()) == 0
    made = {(d.webhook_id, d.key_id) for d in await hooks.deliveries()}
    assert made == {(first.id, created.record.id), (second.id, created.record.id)}


def redis_only(store: KeyStore) -> RedisStore:
    if not isinstance(store, RedisStore):
        pytest.skip("the indexes of keys to look at are the Redis store's")
    return store


async def test_redis_keys_made_before_the_indexes_are_found_a_slice_of_every_key_at_a_time(
    store: KeyStore, manager: KeyManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_store = redis_only(store)
    monkeypatch.setattr(redis_hooks, "FIRST_SWEEP_SLICE", 3)
    monkeypatch.setattr(redis_hooks, "SWEEP_SLICE", 3)
    hooks = hooks_of(store)
    await add_endpoint(
        hooks, "http://127.0.0.1:9/hooks", events=["key.expiring", "key.usage_threshold"]
    )
    ids = []
    for number in range(8):
        options: dict[str, Any] = {}
        if number in (1, 6):
            options["expires_in"] = timedelta(days=3)
        if number == 7:
            options["credit_refill"] = "100/day"
        created = await manager.create(name=f"k{number}", full_access=True, **options)
        ids.append(created.record.id)
    assert await manager.spend_credits(await manager.get(ids[7]), 85) is not None
    # As a store of the previous release leaves them: keys, and no index of keys to look at.
    client = redis_store.client
    w = f"{redis_store.key_prefix}{{webhooks}}:"
    await client.delete(*(w + name for name in ("expiring", "refilled", "sweep", "swept")))

    # Each look reads the next 3 keys of the pass: the first round reaches 6 of the 8.
    now = utcnow()
    assert await hooks.expiring(now) + await hooks.usage_thresholds(now) == 1
    assert await client.get(w + "sweep") == "6"
    assert await hooks.expiring(now) + await hooks.usage_thresholds(now) == 2
    assert await hooks.expiring(now) + await hooks.usage_thresholds(now) == 0
    made = sorted((d.key_id, d.event) for d in await hooks.deliveries())
    assert made == sorted(
        [
            (ids[1], "key.expiring"),
            (ids[6], "key.expiring"),
            (ids[7], "key.usage_threshold"),
        ]
    )
    # The indexes hold the keys that can be due, and no other.
    assert set(await client.zrange(w + "expiring", 0, -1)) == {ids[1], ids[6]}
    assert set(await client.zrange(w + "refilled", 0, -1)) == {ids[7]}
    # A change is brought in by `take`, which reads the key's outbox.
    await manager.revoke(ids[1])
    await manager.update(ids[2], expires_in=timedelta(days=2))
    await hooks.take(utcnow())
    assert set(await client.zrange(w + "expiring", 0, -1)) == {ids[2], ids[6]}


async def test_redis_a_look_reads_the_keys_due_first_and_at_most_look_limit(
    store: KeyStore, manager: KeyManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis_store = redis_only(store)
    monkeypatch.setattr(redis_hooks, "LOOK_LIMIT", 2)
    hooks = hooks_of(store)
    await add_endpoint(hooks, "http://127.0.0.1:9/hooks", events=["key.expiring"])
    for number in range(5):
        await manager.create(name=f"k{number}", full_access=True, expires_in=timedelta(days=10))
    for number in range(3):
        await manager.create(name=f"far{number}", full_access=True, expires_in=timedelta(days=90))
    now = utcnow()
    assert await hooks.expiring(now) == 0  # none within 7 days yet
    w = f"{redis_store.key_prefix}{{webhooks}}:"
    assert await redis_store.client.zcard(w + "expiring") == 8
    # Three days and a minute on, the five are due: two a look, those due first.
    later = now + timedelta(days=3, minutes=1)
    assert [await hooks.expiring(later) for _ in range(4)] == [2, 2, 1, 0]
    assert len(await hooks.deliveries()) == 5
    # Each is looked at again at its next notice, 1 day before it expires.
    last = now + timedelta(days=9, minutes=1)
    assert [await hooks.expiring(last) for _ in range(4)] == [2, 2, 1, 0]
    assert sorted(d.event for d in await hooks.deliveries()) == ["key.expiring"] * 10


def test_a_manager_moved_to_another_loop_delivers_when_only_the_fast_path_serves() -> None:
    """A manager used on a second event loop after its first one closed, only through
    `Gate.decide`'s first call (the memory store answers every request without an await): its
    deliverer starts again on the new loop, as the awaited paths start it."""
    receiver = Receiver(free_port())
    options = DeliveryOptions(
        poll_interval=0.02,
        retry_delays=(0.05,),
        check_interval=3600,
        allow_private_targets=True,
    )
    manager = KeyManager(
        MemoryStore(),
        hasher=Hasher(pepper=b"L8dw49pa41XlgoBNkvoeuME4lzC2vZHAO-p4QCm4Kiw"),
        usage_flush_interval=0.05,
        webhooks=options,
    )
    gate = Gate(manager, limiter=RateLimiter("1000/minute"), scopes={"GET /api": "a:read"})
    request = {"type": "http", "method": "GET", "path": "/api", "client": ("10.0.0.1", 1)}

    async def first() -> str:
        hooks = hooks_of(manager.store)
        await add_endpoint(hooks, receiver.url)
        created = await manager.create(name="k", scopes=["a:read"])
        headers = [(b"authorization", f"Bearer {created.key}".encode())]
        assert type(gate.decide({**request, "headers": headers}, "/api")) is list
        return created.key

    async def second(key: str) -> None:
        headers = [(b"authorization", f"Bearer {key}".encode())]
        await receiver.start()
        try:
            async with asyncio.timeout(20):
                while not receiver.received:
                    assert type(gate.decide({**request, "headers": headers}, "/api")) is list
                    await asyncio.sleep(0.02)
        finally:
            await manager.aclose()
            await receiver.stop()

    try:
        key = asyncio.run(first())  # the loop ends, and the deliverer's task with it
    except BaseException:
        asyncio.run(manager.aclose())
        raise
    asyncio.run(second(key))
    assert json.loads(receiver.received[0].body)["type"] == "key.created"


async def test_deliveries_waiting_behind_one_keys_retries_never_hold_up_another_keys(
    store: KeyStore, manager: KeyManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_hooks, "CLAIM_SCAN", 3)  # fewer waiting than a claim reads
    hooks = hooks_of(store)
    await add_endpoint(hooks, "http://127.0.0.1:9/hooks")
    busy = await manager.create(name="busy", full_access=True)
    await hooks.take(utcnow())
    now = utcnow()
    (first,) = await hooks.claim("test", now, now + timedelta(minutes=1), 10)
    retry_at = now + timedelta(hours=1)
    await hooks.finish(
        first.id,
        "test",
        now=now,
        status="pending",
        next_attempt_at=retry_at,
        response=500,
        error=None,
    )
    for number in range(5):  # they wait behind the first, which is retried in an hour
        await manager.update(busy.record.id, name=f"busy{number}")
    await hooks.take(utcnow())
    other = await manager.create(name="other", full_access=True)
    await hooks.take(utcnow())
    claimed = []
    for _ in range(3):
        now = utcnow()
        claimed += await hooks.claim("test", now, now + timedelta(minutes=1), 10)
    assert [json.loads(item.body)["data"]["key"]["id"] for item in claimed] == [other.record.id]
    await hooks.finish(
        claimed[0].id,
        "test",
        now=utcnow(),
        status="delivered",
        next_attempt_at=utcnow(),
        response=200,
        error=None,
    )
    # Once the first is delivered, the next of its key goes, in order.
    later = retry_at + timedelta(seconds=1)
    (again,) = await hooks.claim("test", later, later + timedelta(minutes=1), 10)
    assert again.id == first.id
    await hooks.finish(
        first.id,
        "test",
        now=later,
        status="delivered",
        next_attempt_at=later,
        response=200,
        error=None,
    )
    (following,) = await hooks.claim("test", later, later + timedelta(minutes=1), 10)
    body = json.loads(following.body)
    assert (body["type"], body["data"]["key"]["name"]) == ("key.updated", "busy0")


@pytest.mark.parametrize("turns", range(6))
async def test_if_closed_as_its_wait_ends_then_the_delivery_task_ends_with_aclose(
    turns: int,
) -> None:
    # On Python 3.11 `wait_for` swallows a cancellation that comes as its wait ends (here a
    # send landing, which wakes the task): the task went on with rounds after `aclose`, on
    # a store being closed, and opened connections nobody closed.
    hooks = hooks_of(MemoryStore())
    rounds = asyncio.Event()
    endpoints = hooks.endpoints

    async def counted() -> Any:
        rounds.set()
        return await endpoints()

    hooks.endpoints = counted  # type: ignore[method-assign]
    deliverer = Deliverer(hooks, DeliveryOptions(poll_interval=0.05))
    deliverer.start()
    try:
        await rounds.wait()  # a round ran: the task now waits for the next
        await asyncio.sleep(0)
        assert deliverer._wake is not None
        deliverer._wake.set()  # as a send that lands does
        for _ in range(turns):
            await asyncio.sleep(0)
        await deliverer.aclose()
        left = [t for t in asyncio.all_tasks() if t.get_name() == "apikeys-webhooks"]
        assert [t for t in left if not t.done()] == []
    finally:
        for task in asyncio.all_tasks():
            if task.get_name() == "apikeys-webhooks":
                task.cancel()
