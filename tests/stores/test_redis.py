"""Redis-specific behaviour of `RedisStore`, against a real Redis server.

The behaviour every store shares is in `test_store_conformance.py`; here: the key layout,
isolation by prefix, several clients at once, scripts surviving `SCRIPT FLUSH`, and what
happens when the server is unreachable or comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import re
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from apikeys.errors import ConfigurationError, DuplicateKeyId, KeyNotFound, StoreUnavailable
from apikeys.stores import MemoryStore, store_from_url
from apikeys.stores.redis import RedisStore
from apikeys.types import AuditEvent, KeyRecord, StoredKey, StoredState, UsageDelta
from tests.redis_servers import LocalCluster
from tests.tcpproxy import TcpProxy

pytestmark = pytest.mark.redis

T0 = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)

StoreFactory = Callable[..., RedisStore]


def make_key(
    key_id: str,
    *,
    workspace: str = "ws",
    created_at: datetime = T0,
    digest: str = "hash-1",
) -> StoredKey:
    record = KeyRecord(
        id=key_id,
        name=f"key {key_id}",
        workspace=workspace,
        prefix=f"ak_{key_id}_…",
        access="restricted",
        scopes=("orders:read", "orders:write"),
        state="active",
        rate_limit="100/minute",
        created_at=created_at,
    )
    return StoredKey(record=record, secret_hash=digest)


def _glob_escape(text: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


@pytest.fixture
async def admin(redis_url: str, redis_key_prefix: str) -> AsyncIterator[Redis]:
    """A plain client on the test server; deletes every key under the test's prefix after."""
    client = Redis.from_url(redis_url, decode_responses=True)
    try:
        yield client
    finally:
        names = [name async for name in client.scan_iter(_glob_escape(redis_key_prefix) + "*")]
        if names:
            await client.delete(*names)
        await client.aclose()


@pytest.fixture
async def make_store(
    redis_url: str, redis_key_prefix: str, admin: Redis
) -> AsyncIterator[StoreFactory]:
    """Build stores on their own clients (prefix: the test's, unless given); closes them."""
    stores: list[RedisStore] = []

    def factory(url: str = redis_url, **options: Any) -> RedisStore:
        options.setdefault("key_prefix", redis_key_prefix)
        store = RedisStore.from_url(url, **options)
        stores.append(store)
        return store

    try:
        yield factory
    finally:
        for store in stores:
            await store.aclose()


async def test_store_from_url_builds_a_redis_store_for_redis_urls(
    redis_url: str, redis_key_prefix: str
) -> None:
    for url in (redis_url, redis_url.replace("redis://", "rediss://", 1)):
        store = store_from_url(url, key_prefix=redis_key_prefix)
        try:
            assert isinstance(store, RedisStore)
            assert store.key_prefix == redis_key_prefix
        finally:
            await store.aclose()


async def test_key_hash_name_carries_the_id_as_its_hash_tag(
    make_store: StoreFactory, admin: Redis, redis_key_prefix: str
) -> None:
    store = make_store()
    await store.insert(make_key("Abc123XYZ789", workspace="team-a"))

    name = f"{redis_key_prefix}key:{{Abc123XYZ789}}"
    assert store.key_name("Abc123XYZ789") == name
    assert await admin.type(name) == "hash"
    assert key_slot(name.encode()) == key_slot(b"Abc123XYZ789")
    assert await admin.zrange(f"{redis_key_prefix}ws:team-a", 0, -1) == ["Abc123XYZ789"]
    assert await admin.zrange(f"{redis_key_prefix}all", 0, -1) == ["Abc123XYZ789"]


async def test_every_redis_key_of_the_store_starts_with_its_prefix(
    make_store: StoreFactory, admin: Redis, redis_key_prefix: str
) -> None:
    store = make_store()
    await store.insert(make_key("k1", workspace="a"))
    await store.insert(make_key("k2", workspace="b"))
    await store.add_usage({"k1": UsageDelta(1, T0)}, batch_id="b1")

    names = {name async for name in admin.scan_iter(_glob_escape(redis_key_prefix) + "*")}
    assert names == {
        f"{redis_key_prefix}key:{{k1}}",
        f"{redis_key_prefix}key:{{k2}}",
        f"{redis_key_prefix}used:{{k1}}",
        f"{redis_key_prefix}ws:a",
        f"{redis_key_prefix}ws:b",
        f"{redis_key_prefix}all",
        f"{redis_key_prefix}usage-batch:b1",
    }


async def test_key_prefix_isolates_stores_on_one_server(
    make_store: StoreFactory, redis_key_prefix: str
) -> None:
    first = make_store(key_prefix=redis_key_prefix + "one:")
    second = make_store(key_prefix=redis_key_prefix + "two:")
    await first.insert(make_key("same-id"))

    assert await second.get("same-id") is None
    assert await second.list() == []
    assert await second.list("ws") == []
    await second.insert(make_key("same-id", digest="other"))  # no DuplicateKeyId

    stored = await first.get("same-id")
    assert stored is not None
    assert stored.secret_hash == "hash-1"


async def test_key_prefix_with_braces_is_refused(make_store: StoreFactory) -> None:
    with pytest.raises(ConfigurationError, match="hash tag"):
        make_store(key_prefix="apikeys:{tenant}:")


async def test_client_without_decode_responses_is_refused(redis_url: str) -> None:
    client = Redis.from_url(redis_url)
    try:
        with pytest.raises(ConfigurationError, match="decode_responses"):
            RedisStore(client)
    finally:
        await client.aclose()


async def test_datetimes_come_back_as_utc_with_microseconds(make_store: StoreFactory) -> None:
    store = make_store()
    plus_two = timezone(timedelta(hours=2))
    created = datetime(2026, 5, 6, 9, 8, 7, 654321, tzinfo=plus_two)
    await store.insert(make_key("tz", created_at=created))
    await store.add_usage(
        {"tz": UsageDelta(1, datetime(2026, 5, 6, 8, 0, 0, 1, tzinfo=UTC))},
        batch_id=uuid.uuid4().hex,
    )

    stored = await store.get("tz")
    assert stored is not None
    assert stored.record.created_at == created
    assert stored.record.created_at.tzinfo == UTC
    assert stored.record.created_at.microsecond == 654321
    assert stored.record.last_used_at == datetime(2026, 5, 6, 8, 0, 0, 1, tzinfo=UTC)


async def test_two_clients_see_each_others_changes_immediately(make_store: StoreFactory) -> None:
    writer, reader = make_store(), make_store()
    await writer.insert(make_key("shared"))
    assert await reader.get("shared") is not None

    await writer.set_state("shared", "disabled", allowed_from={"active"}, at=T0)
    seen = await reader.get("shared")
    assert seen is not None
    assert seen.record.state == "disabled"

    await reader.add_usage({"shared": UsageDelta(5, T0)}, batch_id=uuid.uuid4().hex)
    seen = await writer.get("shared")
    assert seen is not None
    assert seen.record.request_count == 5

    await writer.shorten_expiry("shared", T0 + timedelta(days=1))
    assert await reader.replace_hash("shared", "hash-1", "hash-2")
    seen = await writer.get("shared")
    assert seen is not None
    assert seen.record.expires_at == T0 + timedelta(days=1)
    assert seen.secret_hash == "hash-2"

    revoked = await reader.set_state("shared", "revoked", allowed_from={"disabled"}, at=T0)
    assert revoked.state == "revoked"
    seen = await writer.get("shared")
    assert seen is not None
    assert seen.record.state == "revoked"
    assert seen.record.revoked_at == T0


async def test_add_usage_is_exact_under_concurrent_batches_from_two_clients(
    make_store: StoreFactory,
) -> None:
    first, second = make_store(), make_store()
    ids = ["hot-a", "hot-b", "hot-c"]
    for key_id in ids:
        await first.insert(make_key(key_id))

    def batch(n: int) -> dict[str, UsageDelta]:
        moment = T0 + timedelta(microseconds=n)
        return {key_id: UsageDelta(i + 1, moment) for i, key_id in enumerate(ids)}

    batches = 200
    await asyncio.gather(
        *(first.add_usage(batch(n), batch_id=uuid.uuid4().hex) for n in range(batches)),
        *(second.add_usage(batch(batches + n), batch_id=uuid.uuid4().hex) for n in range(batches)),
    )

    for i, key_id in enumerate(ids):
        stored = await second.get(key_id)
        assert stored is not None
        assert stored.record.request_count == 2 * batches * (i + 1)
        assert stored.record.last_used_at == T0 + timedelta(microseconds=2 * batches - 1)


async def test_add_usage_never_moves_last_used_at_back(make_store: StoreFactory) -> None:
    store = make_store()
    await store.insert(make_key("k"))
    await store.add_usage(
        {"k": UsageDelta(1, T0 + timedelta(seconds=10))}, batch_id=uuid.uuid4().hex
    )
    await store.add_usage({"k": UsageDelta(1, T0)}, batch_id=uuid.uuid4().hex)

    stored = await store.get("k")
    assert stored is not None
    assert stored.record.request_count == 2
    assert stored.record.last_used_at == T0 + timedelta(seconds=10)


async def test_add_usage_for_an_unknown_id_creates_no_hash(
    make_store: StoreFactory, admin: Redis
) -> None:
    store = make_store()
    await store.insert(make_key("known"))
    await store.add_usage(
        {"ghost": UsageDelta(3, T0), "known": UsageDelta(2, T0)}, batch_id=uuid.uuid4().hex
    )

    assert await admin.exists(store.key_name("ghost")) == 0
    assert await store.get("ghost") is None
    known = await store.get("known")
    assert known is not None
    assert known.record.request_count == 2


async def test_a_key_cache_keeps_a_hash_only_while_it_has_no_ttl(
    make_store: StoreFactory, admin: Redis
) -> None:
    # Redis announces a TTL's end only once it deletes the hash: a key cache must not keep it.
    store = make_store()
    await store.insert(make_key("k"))
    stored, keep = await store.get_to_cache("k")
    assert stored == await store.get("k")
    assert keep
    await admin.expire(store.key_name("k"), 3600)
    stored, keep = await store.get_to_cache("k")
    assert stored == await store.get("k")
    assert not keep
    await admin.persist(store.key_name("k"))
    assert (await store.get_to_cache("k"))[1]
    assert await store.get_to_cache("missing") == (None, True)


async def cut_disconnects_short(store: RedisStore) -> list[str]:
    """Connect `store`'s channel and cancel its disconnect after 1 to 40 turns of the loop,
    each time; the ResourceWarnings of connections left open meanwhile."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for turns in range(1, 41):
            channel = store.channel()
            assert channel is not None
            channel.bind()
            await channel.connect("reader", lambda notice: None)
            await channel.register(3.0)
            await channel.probe()
            closing = asyncio.ensure_future(channel.disconnect())
            for _ in range(turns):
                await asyncio.sleep(0)
            closing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await closing
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


async def test_a_channel_disconnect_cut_short_still_closes_every_connection(
    make_store: StoreFactory,
) -> None:
    # A key cache bounds its channel's disconnect with a timeout. Cut short at any point,
    # it must still close every connection: one left open is found by the garbage
    # collector, later, as a ResourceWarning in whatever runs then (redis-py's `aclose`,
    # cancelled, leaves the connections it has not reached).
    assert await cut_disconnects_short(make_store()) == []


async def test_a_cluster_channel_disconnect_cut_short_still_closes_every_connection(
    redis_cluster: LocalCluster, redis_key_prefix: str
) -> None:
    # The same on a cluster: one subscription per master, then the command client.
    store = store_from_url(redis_cluster.url, key_prefix=redis_key_prefix)
    assert isinstance(store, RedisStore)
    try:
        assert await cut_disconnects_short(store) == []
    finally:
        await store.aclose()


@pytest.mark.parametrize("damage", ["hdel", "garble"])
@pytest.mark.parametrize(
    "field",
    [
        "id",
        "name",
        "workspace",
        "prefix",
        "access",
        "scopes",
        "state",
        "created_at",
        "secret_hash",
        "request_count",
        "credits",
        "expires_at",
    ],
)
async def test_a_hash_damaged_by_another_client_fails_closed_as_store_unavailable(
    make_store: StoreFactory, admin: Redis, field: str, damage: str
) -> None:
    # Another client deleted or garbled a field: every read answers 503, never a KeyError.
    store = make_store()
    await store.insert(make_key("k"))
    if damage == "hdel":
        await admin.hdel(store.key_name("k"), field)
    else:
        await admin.hset(store.key_name("k"), field, "[not-a-value")
    try:
        stored = await store.get("k")
    except StoreUnavailable:
        return
    # A field read as free text (a name, say) may hold anything, and one that may be absent
    # (no expiry, no credits, never used) may be deleted: the record reads as such.
    assert stored is not None
    free_text = {"id", "name", "workspace", "prefix", "secret_hash", "access", "state"}
    optional = {"request_count", "credits", "expires_at"}
    assert field in (free_text if damage == "garble" else optional)


@pytest.mark.parametrize("hash_of", ["key", "counts"])
@pytest.mark.parametrize("value", ["99999999999999999999", "-99999999999999999999", "x"])
async def test_a_time_damaged_by_another_client_fails_closed_as_store_unavailable(
    make_store: StoreFactory, admin: Redis, hash_of: str, value: str
) -> None:
    # A time out of datetime's range is damage like any other: 503, never an OverflowError.
    store = make_store()
    await store.insert(make_key("k"))
    name = store.key_name("k")
    if hash_of == "counts":
        await store.add_usage({"k": UsageDelta(1, T0)}, batch_id=uuid.uuid4().hex)
        name = store.use_name("k")
    await admin.hset(name, "last_used_at", value)
    with pytest.raises(StoreUnavailable):
        await store.get("k")
    with pytest.raises(StoreUnavailable):
        await store.list()


async def test_an_insert_starts_from_its_own_counts_whatever_a_deleted_key_left(
    make_store: StoreFactory, admin: Redis
) -> None:
    # A key's hash deleted by hand leaves its counts: a key inserted again under that id
    # does not take them over.
    store = make_store()
    await store.insert(make_key("k"))
    await store.add_usage({"k": UsageDelta(3, T0)}, batch_id=uuid.uuid4().hex)
    await admin.delete(store.key_name("k"))
    await store.insert(make_key("k"))
    stored = await store.get("k")
    assert stored is not None
    assert (stored.record.request_count, stored.record.last_used_at) == (0, None)


async def test_scripts_survive_script_flush(make_store: StoreFactory, admin: Redis) -> None:
    store = make_store()
    await store.setup()
    await store.setup()  # idempotent

    await admin.script_flush()
    await store.insert(make_key("k"))
    await admin.script_flush()
    with pytest.raises(DuplicateKeyId):
        await store.insert(make_key("k"))
    await admin.script_flush()
    await store.add_usage({"k": UsageDelta(4, T0)}, batch_id=uuid.uuid4().hex)
    await admin.script_flush()
    assert (await store.set_state("k", "disabled", allowed_from={"active"}, at=T0)).state == (
        "disabled"
    )
    await admin.script_flush()
    shortened = await store.shorten_expiry("k", T0 + timedelta(hours=1))
    assert shortened.expires_at == T0 + timedelta(hours=1)
    await admin.script_flush()
    assert await store.replace_hash("k", "hash-1", "hash-2")

    stored = await store.get("k")
    assert stored is not None
    assert stored.record.request_count == 4
    assert stored.secret_hash == "hash-2"


async def test_state_changes_on_a_missing_key_raise_key_not_found_and_create_nothing(
    make_store: StoreFactory, admin: Redis
) -> None:
    store = make_store()
    with pytest.raises(KeyNotFound):
        await store.set_state("missing", "revoked", allowed_from={"active"}, at=T0)
    with pytest.raises(KeyNotFound):
        await store.shorten_expiry("missing", T0)
    assert not await store.replace_hash("missing", "a", "b")
    assert await admin.exists(store.key_name("missing")) == 0


async def test_list_skips_index_entries_without_a_matching_hash(
    make_store: StoreFactory, admin: Redis
) -> None:
    store = make_store()
    await store.insert(make_key("real", workspace="a"))
    # An entry left by an insert that failed between its two steps.
    await admin.zadd(store.workspace_index_name("a"), {"dangling": 1})
    await admin.zadd(store.all_index_name, {"dangling": 1})
    # A refused duplicate in another workspace leaves an entry in that workspace's index.
    with pytest.raises(DuplicateKeyId):
        await store.insert(make_key("real", workspace="b"))

    assert [record.id for record in await store.list("a")] == ["real"]
    assert [record.id for record in await store.list()] == ["real"]
    assert await store.list("b") == []


async def _outcome(call: Awaitable[object]) -> object:
    try:
        return await call
    except (DuplicateKeyId, KeyNotFound) as exc:
        return type(exc)


@pytest.mark.parametrize("seed", range(5))
async def test_every_method_answers_exactly_as_the_memory_store(
    make_store: StoreFactory, seed: int
) -> None:
    rng = random.Random(seed)
    redis_store, memory = make_store(), MemoryStore()
    ids = [f"id{n}" for n in range(6)]
    workspaces = ["a", "b"]
    states: list[StoredState] = ["active", "disabled", "revoked"]

    def moment() -> datetime:
        return T0 + timedelta(seconds=rng.randrange(-50, 50), microseconds=rng.randrange(10**6))

    for _ in range(300):
        key_id = rng.choice(ids)
        op = rng.randrange(7)
        calls: list[Awaitable[object]]
        if op == 0:
            stored = make_key(key_id, workspace=rng.choice(workspaces), created_at=moment())
            calls = [store.insert(stored) for store in (redis_store, memory)]
        elif op == 1:
            state, allowed, at = rng.choice(states), set(rng.sample(states, 2)), moment()
            calls = [
                store.set_state(key_id, state, allowed_from=allowed, at=at)
                for store in (redis_store, memory)
            ]
        elif op == 2:
            expires = moment()
            calls = [store.shorten_expiry(key_id, expires) for store in (redis_store, memory)]
        elif op == 3:
            old, new = rng.choice(["hash-1", "hash-2"]), rng.choice(["hash-1", "hash-2"])
            calls = [store.replace_hash(key_id, old, new) for store in (redis_store, memory)]
        elif op == 4:
            usage = {rng.choice(ids): UsageDelta(rng.randrange(-1, 4), moment()) for _ in range(3)}
            calls = [
                store.add_usage(usage, batch_id=uuid.uuid4().hex) for store in (redis_store, memory)
            ]
        elif op == 5:
            workspace = rng.choice([None, *workspaces])
            calls = [store.list(workspace) for store in (redis_store, memory)]
        else:
            calls = [store.get(key_id) for store in (redis_store, memory)]
        from_redis, from_memory = [await _outcome(call) for call in calls]
        assert from_redis == from_memory, f"op {op} on {key_id}"

    assert await redis_store.list() == await memory.list()


async def test_unreachable_server_raises_store_unavailable_quickly(
    make_store: StoreFactory,
) -> None:
    store = make_store("redis://127.0.0.1:1/0")
    calls: list[Callable[[], Awaitable[object]]] = [
        store.setup,
        lambda: store.get("k"),
        lambda: store.insert(make_key("k")),
        lambda: store.list(),
        lambda: store.list("ws"),
        lambda: store.set_state("k", "revoked", allowed_from={"active"}, at=T0),
        lambda: store.shorten_expiry("k", T0),
        lambda: store.replace_hash("k", "a", "b"),
        lambda: store.add_usage({"k": UsageDelta(1, T0)}, batch_id=uuid.uuid4().hex),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as caught:
            await call()
        assert time.monotonic() - started < 1.0
        assert isinstance(caught.value.original, RedisConnectionError | OSError)


async def test_repr_hides_the_password(make_store: StoreFactory) -> None:
    store = make_store("redis://apps:s3cret-pa55@127.0.0.1:6379/3")
    text = repr(store)
    assert "s3cret-pa55" not in text
    assert "127.0.0.1" in text
    assert "db=3" in text


@pytest.fixture
def proxy(redis_url: str) -> Iterator[TcpProxy]:
    """A TCP proxy to Redis that a test can sever and restore, to play an outage."""
    with TcpProxy.to_url(redis_url) as forwarder:
        yield forwarder


async def test_outage_raises_store_unavailable_and_the_next_call_after_it_works(
    make_store: StoreFactory, proxy: TcpProxy, redis_url: str
) -> None:
    store = make_store(proxy.url(redis_url))
    await store.insert(make_key("k"))
    assert await store.get("k") is not None

    proxy.sever()
    with pytest.raises(StoreUnavailable):
        await store.get("k")
    with pytest.raises(StoreUnavailable):
        await store.add_usage({"k": UsageDelta(1, T0)}, batch_id=uuid.uuid4().hex)

    proxy.restore()
    assert await store.get("k") is not None
    await store.add_usage({"k": UsageDelta(1, T0)}, batch_id=uuid.uuid4().hex)
    stored = await store.get("k")
    assert stored is not None
    assert stored.record.request_count == 1


async def test_pooled_connections_cut_while_idle_are_replaced_without_an_error(
    make_store: StoreFactory, proxy: TcpProxy, redis_url: str
) -> None:
    store = make_store(proxy.url(redis_url))
    await store.insert(make_key("k"))
    proxy.sever()  # Redis "restarts" while the store sits idle
    proxy.restore()
    await asyncio.sleep(0.05)  # let the client's transport see the close

    assert await store.get("k") is not None


async def test_only_the_per_key_audit_lists_and_tagged_daily_usage_are_read(
    make_store: StoreFactory, admin: Redis, redis_key_prefix: str
) -> None:
    """0.1.0 is the first layout: a single audit list or untagged daily usage (names only
    pre-release code wrote) is not part of the store, and is never read."""
    store = make_store()
    await store.insert(make_key("old1", workspace="a"))
    stray = AuditEvent(
        time=datetime.now(UTC) - timedelta(days=1),
        key_id="old1",
        workspace="a",
        action="created",
        actor="alice",
    )
    await admin.rpush(f"{redis_key_prefix}audit", stray.encode())
    today = datetime.now(UTC).date()
    await admin.hset(f"{redis_key_prefix}usage:old1:{today.isoformat()}", "admitted", 3)
    await store.set_state(
        "old1",
        "disabled",
        allowed_from=["active"],
        at=datetime.now(UTC),
        event=AuditEvent(
            time=datetime.now(UTC), key_id="old1", workspace="a", action="disabled", actor="bob"
        ),
    )

    for events in (await store.audit(key_id="old1"), await store.audit(workspace="a")):
        assert [(event.action, event.actor) for event in events] == [("disabled", "bob")]
    assert await store.usage_history("old1", today) == []
    now = datetime.now(UTC)
    usage = UsageDelta(1, now, {(now.date().isoformat(), "admitted"): 1})
    await store.add_usage({"old1": usage}, batch_id=uuid.uuid4().hex)
    [day] = await store.usage_history("old1", now.date())
    assert day.admitted == 1


async def test_the_key_prefix_is_read_from_the_url_query() -> None:
    store = store_from_url("redis://127.0.0.1:6379/13?key_prefix=contacts:&socket_timeout=3")
    try:
        assert isinstance(store, RedisStore)
        assert store.key_prefix == "contacts:"
        assert store.key_name("k") == "contacts:key:{k}"
    finally:
        await store.aclose()


async def test_a_damaged_hash_is_refused_503_and_logged_once_a_second_naming_the_damage(
    make_store: StoreFactory, admin: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # The request path logs why it answers 503 (docs/deploying.md, "Failing closed"), in a
    # line a second at most, the secret nowhere.
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from apikeys import APIKeyMiddleware, Hasher, KeyManager

    store = make_store()
    async with KeyManager(store, hasher=Hasher(), cache=False) as manager:
        created = await manager.create(name="n", full_access=True)
        await admin.hdel(store.key_name(created.record.id), "secret_hash")

        async def ok(request: Any) -> PlainTextResponse:
            return PlainTextResponse("ok")

        app = APIKeyMiddleware(Starlette(routes=[Route("/", ok)]), manager=manager)
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {created.key}"}
        with caplog.at_level("WARNING", logger="apikeys"):
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                answers = [(await client.get("/", headers=headers)).status_code for _ in range(5)]
    assert answers == [503] * 5
    lines = [r.getMessage() for r in caplog.records if "answering 503" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "damaged" in lines[0]
    assert created.key not in caplog.text
    assert created.key.split("_")[-1] not in caplog.text
