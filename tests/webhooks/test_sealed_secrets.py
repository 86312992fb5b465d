"""Webhook signing secrets are not in the store: each is derived from the pepper and a
nonce, and the store keeps `sealed$<pepper id>$<nonce>`. Read here from the database or
Redis itself, on every store; a receiver verifies with the secret `add` gave, across a
pepper rotation; a dropped pepper fails the delivery clearly; an earlier release's clear
secret still signs, and a roll takes it out of the store."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from standardwebhooks import Webhook

from apikeys import Hasher, KeyManager, MemoryStore
from apikeys.cli import main
from apikeys.stores import KeyStore
from apikeys.stores.contract import WebhookStore
from apikeys.stores.redis import RedisStore
from apikeys.stores.sql.store import SQLStore
from apikeys.types import utcnow
from apikeys.webhooks import Deliverer, DeliveryOptions, Endpoint, new_secret
from apikeys.webhooks.admin import add_endpoint, roll_endpoint_secret
from apikeys.webhooks.signing import (
    SEALED_PREFIX,
    UNSEALABLE,
    seal_new_secret,
    sealed_pepper_id,
    unseal_secret,
)
from tests import services
from tests.webhooks.receiver import Receiver

OLD_PEPPER = "KiW13tlctr3NdBnTqyD5_hHw_XrZApekCtsNL3wOgVA"
NEW_PEPPER = "rAyss7LGYsJRB0b9HNIDPCh1jr3E8WyDKOi0Oxz284A"
# The receivers here listen on 127.0.0.1: internal targets are allowed explicitly.
FAST = DeliveryOptions(
    poll_interval=0.02,
    retry_delays=(0.05, 0.1),
    timeout=2,
    lease=10,
    allow_private_targets=True,
)


@pytest.fixture
async def manager(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(store, hasher=Hasher(pepper=OLD_PEPPER), webhooks=False) as made:
        yield made


@pytest.fixture(autouse=True)
def no_pepper_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each hasher here has the peppers it is given, whatever the environment says."""
    monkeypatch.delenv("APIKEYS_PEPPER", raising=False)
    monkeypatch.delenv("APIKEYS_OLD_PEPPERS", raising=False)


def unpeppered() -> Hasher:
    return Hasher(pepper=None, old_peppers=[])


def hooks_of(store: KeyStore) -> WebhookStore:
    hooks = store.webhooks()
    assert hooks is not None
    return hooks


def encodings(secret: str) -> list[bytes]:
    """The ways a secret's bytes could be written down."""
    raw = base64.b64decode(secret.removeprefix("whsec_"))
    b64 = base64.b64encode(raw)
    return [
        secret.encode(),
        raw,
        b64,
        b64.rstrip(b"="),
        base64.urlsafe_b64encode(raw).rstrip(b"="),
        base64.b32encode(raw),
        raw.hex().encode(),
        raw.hex().upper().encode(),
    ]


async def raw_contents(store: KeyStore, *, files: bool = False) -> bytes:
    """Everything the store keeps, read from the database or Redis itself (for the memory
    store, its endpoints as it holds them). `files`: for SQLite, the bytes of its files
    too, which also hold what was overwritten (until SQLite reuses those pages)."""
    if isinstance(store, MemoryStore):
        endpoints = await hooks_of(store).endpoints()
        return repr([dataclasses.astuple(endpoint) for endpoint in endpoints]).encode()
    if isinstance(store, SQLStore):
        prefix = store.table.name
        dumped = []
        async with store.engine.connect() as conn:
            names = await conn.run_sync(lambda sync: sa.inspect(sync).get_table_names())
            for name in sorted(names):
                if name.startswith(prefix):
                    rows = await conn.execute(sa.text(f'SELECT * FROM "{name}"'))  # noqa: S608
                    dumped.append(repr([tuple(row) for row in rows]))
        text = "\n".join(dumped).encode()
        if files and store.engine.dialect.name == "sqlite":
            # The file's bytes too, with its write-ahead log: what a copy of it would hold.
            path = Path(str(store.engine.url.database))
            for part in (path, path.with_name(path.name + "-wal")):
                if part.exists():
                    text += part.read_bytes()
        return text
    assert isinstance(store, RedisStore)
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(services.REDIS_URL)  # bytes, not decoded
    dumped_values: list[bytes] = []
    try:
        async for name in client.scan_iter(match=f"{store.key_prefix}*", count=1000):
            kind = (await client.type(name)).decode()
            if kind == "string":
                value = await client.get(name)
            elif kind == "hash":
                value = await client.hgetall(name)
            elif kind == "list":
                value = await client.lrange(name, 0, -1)
            elif kind == "set":
                value = await client.smembers(name)
            elif kind == "zset":
                value = await client.zrange(name, 0, -1, withscores=True)
            else:
                value = kind
            dumped_values.append(name + b"=" + repr(value).encode())
    finally:
        await client.aclose()
    return b"\n".join(dumped_values)


async def assert_kept_sealed(store: KeyStore, *secrets: str, files: bool = False) -> None:
    contents = await raw_contents(store, files=files)
    assert b"whsec_" not in contents
    for secret in secrets:
        for encoded in encodings(secret):
            assert encoded not in contents
    assert SEALED_PREFIX.encode() in contents


async def deliver_until(deliverer: Deliverer, done: Callable[[], bool]) -> None:
    async with asyncio.timeout(30):
        while not done():
            await deliverer.run_once()
            await asyncio.sleep(0.02)


def test_a_derived_secret_needs_the_pepper_that_sealed_it() -> None:
    old, new = Hasher(pepper=OLD_PEPPER), Hasher(pepper=NEW_PEPPER, old_peppers=[OLD_PEPPER])
    secret, sealed = seal_new_secret(old)
    assert secret.startswith("whsec_")
    assert len(base64.b64decode(secret.removeprefix("whsec_"))) == 32
    assert sealed.startswith(SEALED_PREFIX)
    assert sealed_pepper_id(sealed) == old.pepper_fingerprint
    assert secret not in sealed
    assert unseal_secret(old, sealed) == unseal_secret(new, sealed) == secret
    assert seal_new_secret(old)[0] != secret  # a new nonce each time
    for without in (Hasher(pepper=NEW_PEPPER, old_peppers=[]), unpeppered()):
        with pytest.raises(Exception, match="not configured: roll it") as raised:
            unseal_secret(without, sealed)
        assert secret not in str(raised.value)
    # A secret stored as it is (no pepper, or an earlier release) is read as it is.
    clear = new_secret()
    assert unseal_secret(new, clear) == clear


async def test_add_and_roll_keep_no_secret_in_the_store(
    store: KeyStore, manager: KeyManager
) -> None:
    hasher = Hasher(pepper=OLD_PEPPER)
    hooks = hooks_of(store)
    endpoint = await add_endpoint(hooks, "http://127.0.0.1:9/hooks", hasher=hasher)
    assert endpoint.secret.startswith("whsec_")
    (stored,) = await hooks.endpoints()
    assert stored.secret.startswith(SEALED_PREFIX)
    await manager.create(name="a", full_access=True)
    await hooks.take(utcnow())  # a delivery's row, too, holds no secret
    await assert_kept_sealed(store, endpoint.secret, files=True)
    rolled = await roll_endpoint_secret(hooks, endpoint.id, hasher=hasher)
    assert rolled is not None
    await assert_kept_sealed(store, endpoint.secret, rolled, files=True)
    # Nor does what shows an endpoint.
    (stored,) = await hooks.endpoints()
    for shown in (repr(stored), json.dumps(stored.to_dict())):
        assert "whsec_" not in shown
        assert "sealed$" not in shown


async def test_a_receiver_verifies_with_the_secret_add_gave_and_both_after_a_roll(
    store: KeyStore, manager: KeyManager, receiver: Receiver
) -> None:
    hasher = Hasher(pepper=OLD_PEPPER)
    hooks = hooks_of(store)
    endpoint = await add_endpoint(hooks, receiver.url, hasher=hasher)
    deliverer = Deliverer(hooks, FAST, hasher=hasher)
    try:
        await manager.create(name="a", full_access=True)
        await deliver_until(deliverer, lambda: len(receiver.received) == 1)
        rolled = await roll_endpoint_secret(hooks, endpoint.id, hasher=hasher)
        assert rolled is not None
        await manager.create(name="b", full_access=True)
        await deliver_until(deliverer, lambda: len(receiver.received) == 2)
    finally:
        await deliverer.aclose()
    first, second = receiver.received
    assert Webhook(endpoint.secret).verify(first.body, first.headers)["type"] == "key.created"
    # The overlap: two signatures, one with each secret.
    assert len(second.headers["webhook-signature"].split()) == 2
    assert Webhook(endpoint.secret).verify(second.body, second.headers)["type"] == "key.created"
    assert Webhook(rolled).verify(second.body, second.headers)["type"] == "key.created"


async def test_after_a_pepper_rotation_deliveries_still_verify(
    store: KeyStore, manager: KeyManager, receiver: Receiver
) -> None:
    hooks = hooks_of(store)
    endpoint = await add_endpoint(hooks, receiver.url, hasher=Hasher(pepper=OLD_PEPPER))
    rotated = Hasher(pepper=NEW_PEPPER, old_peppers=[OLD_PEPPER])
    deliverer = Deliverer(hooks, FAST, hasher=rotated)
    try:
        await manager.create(name="a", full_access=True)
        await deliver_until(deliverer, lambda: len(receiver.received) == 1)
    finally:
        await deliverer.aclose()
    (item,) = receiver.received
    assert Webhook(endpoint.secret).verify(item.body, item.headers)["type"] == "key.created"


async def test_with_its_pepper_dropped_an_endpoint_fails_clearly_and_the_others_are_sent(
    store: KeyStore,
    manager: KeyManager,
    receiver: Receiver,
    caplog: pytest.LogCaptureFixture,
) -> None:
    hooks = hooks_of(store)
    lost = await add_endpoint(hooks, "http://127.0.0.1:9/lost", hasher=Hasher(pepper=OLD_PEPPER))
    kept = await add_endpoint(hooks, receiver.url, hasher=Hasher(pepper=NEW_PEPPER, old_peppers=[]))
    # The old pepper is no longer listed: its endpoint's secret cannot be made again.
    deliverer = Deliverer(hooks, FAST, hasher=Hasher(pepper=NEW_PEPPER, old_peppers=[]))

    async def attempts_of_lost() -> int:
        return sum(d.attempts for d in await hooks.deliveries() if d.webhook_id == lost.id)

    caplog.set_level(logging.WARNING, logger="apikeys.webhooks")
    deliverer.start()  # the deliverer's own loop, as a KeyManager runs it
    try:
        await manager.create(name="a", full_access=True)
        async with asyncio.timeout(30):
            while not receiver.received or await attempts_of_lost() < 3:  # noqa: ASYNC110 - a poll
                await asyncio.sleep(0.02)
        # The loop goes on: a later event is sent while the lost endpoint's is retried.
        await manager.create(name="b", full_access=True)
        async with asyncio.timeout(30):
            await receiver.wait_for(2)
    finally:
        await deliverer.aclose()
    assert all(Webhook(kept.secret).verify(item.body, item.headers) for item in receiver.received)
    # Retried, as an unreachable endpoint's deliveries are, with the reason as their error.
    failing = [d for d in await hooks.deliveries() if d.webhook_id == lost.id]
    assert {d.status for d in failing} == {"pending"}
    assert max(d.attempts for d in failing) >= 3
    for delivery in failing:
        if delivery.attempts:
            assert delivery.last_error == UNSEALABLE
            assert delivery.last_status is None
    said = [r for r in caplog.records if lost.id in r.getMessage()]
    assert len(said) == 1  # once, however many attempts
    assert said[0].levelno == logging.ERROR
    assert "APIKEYS_OLD_PEPPERS" in said[0].getMessage()
    assert "whsec_" not in caplog.text


async def test_a_clear_secret_of_an_earlier_release_signs_and_a_roll_takes_it_out(
    store: KeyStore,
    manager: KeyManager,
    receiver: Receiver,
    caplog: pytest.LogCaptureFixture,
) -> None:
    hooks = hooks_of(store)
    legacy = new_secret()
    # What the earlier release stored: the secret itself.
    await hooks.add_endpoint(
        Endpoint(
            id="wh_0123456789abcdef",
            url=receiver.url,
            events=(),
            workspace=None,
            secret=legacy,
            created_at=utcnow(),
        )
    )
    hasher = Hasher(pepper=OLD_PEPPER)
    deliverer = Deliverer(hooks, FAST, hasher=hasher)
    caplog.set_level(logging.WARNING, logger="apikeys.webhooks")
    try:
        await manager.create(name="a", full_access=True)
        await deliver_until(deliverer, lambda: len(receiver.received) == 1)
        assert "wh_0123456789abcdef keeps its signing secret in clear" in caplog.text
        rolled = await roll_endpoint_secret(hooks, "wh_0123456789abcdef", hasher=hasher)
        assert rolled is not None
        (stored,) = await hooks.endpoints()
        assert stored.secret.startswith(SEALED_PREFIX)
        assert stored.previous_secret == legacy  # it still signs, for the overlap
        await manager.create(name="b", full_access=True)
        await deliver_until(deliverer, lambda: len(receiver.received) == 2)
        # A roll with no overlap: the clear secret leaves the store at once.
        newest = await roll_endpoint_secret(
            hooks, "wh_0123456789abcdef", timedelta(0), hasher=hasher
        )
        assert newest is not None
        await assert_kept_sealed(store, legacy, rolled, newest)
    finally:
        await deliverer.aclose()
    first, second = receiver.received
    assert Webhook(legacy).verify(first.body, first.headers)["type"] == "key.created"
    assert len(second.headers["webhook-signature"].split()) == 2
    assert Webhook(legacy).verify(second.body, second.headers)["type"] == "key.created"
    assert Webhook(rolled).verify(second.body, second.headers)["type"] == "key.created"
    assert legacy not in caplog.text


async def test_a_previous_secret_is_erased_once_its_overlap_has_ended(
    store: KeyStore, manager: KeyManager
) -> None:
    hooks = hooks_of(store)
    legacy = new_secret()
    await hooks.add_endpoint(
        Endpoint(
            id="wh_fedcba9876543210",
            url="http://127.0.0.1:9/hooks",
            events=(),
            workspace=None,
            secret=legacy,
            created_at=utcnow(),
        )
    )
    hasher = Hasher(pepper=OLD_PEPPER)
    rolled = await roll_endpoint_secret(
        hooks, "wh_fedcba9876543210", timedelta(milliseconds=1), hasher=hasher
    )
    assert rolled is not None
    await asyncio.sleep(0.05)  # the overlap's millisecond is over
    deliverer = Deliverer(hooks, FAST, hasher=hasher)
    try:
        await deliverer.run_once()  # a round erases what no longer signs
    finally:
        await deliverer.aclose()
    (stored,) = await hooks.endpoints()
    assert stored.previous_secret is None
    assert stored.previous_until is None
    await assert_kept_sealed(store, legacy, rolled)
    # A roll made since keeps its own overlap.
    again = await roll_endpoint_secret(hooks, "wh_fedcba9876543210", hasher=hasher)
    assert again is not None
    assert await hooks.forget_previous_secrets(utcnow()) == 0
    (stored,) = await hooks.endpoints()
    assert stored.previous_secret is not None
    assert stored.previous_secret.startswith("sealed$")


async def test_without_a_pepper_the_secret_is_kept_as_it_is_with_one_warning(
    store: KeyStore, manager: KeyManager, caplog: pytest.LogCaptureFixture
) -> None:
    hooks = hooks_of(store)
    without = unpeppered()
    caplog.set_level(logging.WARNING, logger="apikeys.webhooks")
    first = await add_endpoint(hooks, "http://127.0.0.1:9/a", hasher=without)
    second = await add_endpoint(hooks, "http://127.0.0.1:9/b", hasher=without)
    assert await roll_endpoint_secret(hooks, first.id, hasher=without) is not None
    kept = {endpoint.id: endpoint.secret for endpoint in await hooks.endpoints()}
    assert kept[second.id] == second.secret
    assert all(secret.startswith("whsec_") for secret in kept.values())
    warnings = [r for r in caplog.records if "stored in clear" in r.getMessage()]
    assert len(warnings) == 1
    assert first.secret not in caplog.text


def cli(store: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--store", store, "webhooks", *args])


def test_the_command_line_seals_with_apikeys_pepper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APIKEYS_PEPPER", NEW_PEPPER)
    store = f"sqlite:///{tmp_path / 'keys.db'}"
    added = cli(store, "add", "https://example.com/hooks", "--json")
    assert added.exit_code == 0, added.output
    secret = json.loads(added.output)["secret"]
    rolled = cli(store, "roll", json.loads(added.output)["id"], "--overlap", "0", "--json")
    assert rolled.exit_code == 0, rolled.output
    new = json.loads(rolled.output)["secret"]
    files = b"".join(path.read_bytes() for path in tmp_path.glob("keys.db*"))
    assert b"whsec_" not in files
    for written in (secret, new):
        assert not any(encoded in files for encoded in encodings(written))
    listed = cli(store, "list", "--json")
    assert "whsec_" not in listed.output
    assert "sealed$" not in listed.output

    # The deliverers (here, a manager's) make the secret again with the same pepper.
    async def made_again() -> str:
        async with KeyManager(store, hasher=Hasher(pepper=NEW_PEPPER, old_peppers=[])) as made:
            (endpoint,) = await hooks_of(made.store).endpoints()
            return unseal_secret(made.hasher, endpoint.secret)

    assert asyncio.run(made_again()) == new


def test_the_command_line_refuses_to_seal_with_a_pepper_the_store_does_not_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = f"sqlite:///{tmp_path / 'keys.db'}"

    async def record_the_pepper() -> None:
        async with KeyManager(store, hasher=Hasher(pepper=OLD_PEPPER, old_peppers=[])):
            pass

    asyncio.run(record_the_pepper())
    monkeypatch.setenv("APIKEYS_PEPPER", NEW_PEPPER)
    added = cli(store, "add", "https://example.com/hooks")
    assert added.exit_code == 1
    assert "another pepper" in added.output
    assert "whsec_" not in added.output
    assert json.loads(cli(store, "list", "--json").output) == []


def test_the_command_line_without_a_pepper_keeps_the_secret_and_records_no_pepper(
    tmp_path: Path,
) -> None:
    store = f"sqlite:///{tmp_path / 'keys.db'}"
    added = cli(store, "add", "https://example.com/hooks", "--json")
    assert added.exit_code == 0, added.output
    secret = json.loads(added.output)["secret"]

    async def later_with_a_pepper() -> str:
        # A webhook added in development does not decide how keys are hashed.
        async with KeyManager(store, hasher=Hasher(pepper=NEW_PEPPER, old_peppers=[])) as made:
            (endpoint,) = await hooks_of(made.store).endpoints()
            return endpoint.secret

    assert asyncio.run(later_with_a_pepper()) == secret
