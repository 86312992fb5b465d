"""The Redis store while the deployment's shape changes under it: a Redis Cluster slot left
half-migrated to a new master, usage batches that one slot refuses, and a Sentinel set one
of whose sentinels is cut off or frozen.

Each test makes a private deployment (`tests/redis_servers.py`) on free loopback ports and
stops every process it started, SIGSTOPped ones included.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest

from apikeys import Hasher, KeyManager, store_from_url
from apikeys.errors import KeyDisabled, KeyRevoked, StoreUnavailable
from apikeys.stores.redis import RedisStore
from tests import redis_servers

pytestmark = [pytest.mark.redis, pytest.mark.slow]

PEPPER = "w7UF-rHPBQTJ4NJyxOdJPAKDr3uLLuSTMeizgDr8-QU"
_T = TypeVar("_T")


@pytest.fixture
def prefix() -> str:
    return f"apikeys-top-{uuid.uuid4().hex[:10]}:"


async def until_available(call: Callable[[], Awaitable[_T]], attempts: int = 100) -> _T:
    """`call()`, again after each StoreUnavailable (503), at most `attempts` times."""
    for _ in range(attempts - 1):
        try:
            return await call()
        except StoreUnavailable:
            await asyncio.sleep(0.1)
    return await call()


# -- a Redis Cluster slot left half-migrated to a new master ---------------------------------


@pytest.fixture
async def cluster() -> AsyncIterator[redis_servers.LocalCluster]:
    redis_servers.require_redis_binaries()
    deployment = redis_servers.LocalCluster()
    await asyncio.to_thread(deployment.start)
    try:
        yield deployment
    finally:
        await asyncio.to_thread(deployment.close)


def slot_of(deployment: redis_servers.LocalCluster, name: str) -> str:
    return redis_servers.cli(deployment.nodes[0].port, "CLUSTER", "KEYSLOT", name).strip()


def start_migration(
    deployment: redis_servers.LocalCluster, target: redis_servers.Node, name: str
) -> tuple[redis_servers.Node, str]:
    """Mark the slot of Redis key `name` as moving from its master to `target` (a master the
    slot map does not list), as a resharding does before it moves any key; return the source
    master and the slot."""
    source = deployment.master_of(name)
    slot = slot_of(deployment, name)
    source_id, target_id = redis_servers.node_id(source.port), redis_servers.node_id(target.port)
    redis_servers.cli(target.port, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    redis_servers.cli(source.port, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    return source, slot


def migrate_keys(source: redis_servers.Node, target: redis_servers.Node, tag: str) -> None:
    """MIGRATE every Redis key of `source` whose name holds `{tag}` to `target`, and stop
    there: the resharding is left interrupted."""
    names = [
        name
        for name in redis_servers.cli(source.port, "--scan", "--pattern", f"*{{{tag}}}*").split()
        if name
    ]
    assert names
    moved = redis_servers.cli(
        source.port, "MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *names
    )
    assert moved.strip() == "OK", moved  # redis-cli exits 0 on an error reply too


def finish_migration(
    deployment: redis_servers.LocalCluster,
    source: redis_servers.Node,
    target: redis_servers.Node,
    slot: str,
) -> None:
    """Move what is left of `slot` to `target` and give it the slot, as a resharding that
    resumes does."""
    left = redis_servers.cli(source.port, "CLUSTER", "GETKEYSINSLOT", slot, "1000").split()
    if left:
        redis_servers.cli(
            source.port, "MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *left
        )
    target_id = redis_servers.node_id(target.port)
    for node in [target, source, *deployment.masters()]:
        redis_servers.cli(node.port, "CLUSTER", "SETSLOT", slot, "NODE", target_id)
    deployment.wait_healthy()


async def collect_dropped_sockets() -> None:
    """Collect now, while the test's warning filters apply, the sockets redis-py's cluster
    client drops without closing when it learns a new slot map (as after a failover, see
    `tests/test_redis_deployments.py`): not apikeys' connections to close."""
    for _ in range(3):
        await asyncio.sleep(0.05)
        gc.collect()


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_an_interrupted_resharding_to_a_new_master_still_serves_and_revokes(
    cluster: redis_servers.LocalCluster, prefix: str
) -> None:
    """A slot half-moved to a master that redis-py's slot map does not list: its keys are
    served through ASK (as `redis-cli -c` serves them), a revoke there is heard by every
    reader, cached or not, and the key is refused; never a 500."""
    url = cluster.url
    hasher = Hasher(pepper=PEPPER)
    reader = KeyManager(store_from_url(url, key_prefix=prefix), hasher=hasher)
    writer = KeyManager(store_from_url(url, key_prefix=prefix), hasher=hasher, cache=False)
    moving: tuple[redis_servers.Node, redis_servers.Node, str] | None = None
    try:
        doomed = await writer.create(name="doomed", workspace="w", full_access=True)
        live = await writer.create(name="live", workspace="w", full_access=True)
        await reader.verify(doomed.key)
        await reader.verify(live.key)
        store = writer.store
        assert isinstance(store, RedisStore)

        target = await asyncio.to_thread(cluster.add_master)
        source, slot = await asyncio.to_thread(
            start_migration, cluster, target, store.key_name(doomed.record.id)
        )
        moving = (source, target, slot)
        await asyncio.to_thread(migrate_keys, source, target, doomed.record.id)

        assert (await until_available(lambda: reader.verify(doomed.key))).id == doomed.record.id
        assert (await until_available(lambda: reader.verify(live.key))).id == live.record.id
        # A write by another client, where the key now lives, reaches the readers' caches.
        await cached_until_hit(reader, doomed.key)
        name = store.key_name(doomed.record.id)
        redis_servers.cli(source.port, "-c", "HSET", name, "state", "disabled")
        assert reader.cache is not None
        await asyncio.sleep(reader.cache.lease)  # another client waits for nobody
        with pytest.raises(KeyDisabled):
            await until_available(lambda: reader.verify(doomed.key))
        listed = await until_available(lambda: writer.list(workspace="w"))
        assert {record.id for record in listed} == {doomed.record.id, live.record.id}

        revoked = await until_available(lambda: writer.revoke(doomed.record.id))
        assert revoked.status == "revoked"
        with pytest.raises(KeyRevoked):
            await until_available(lambda: reader.verify(doomed.key))
        fresh = KeyManager(store_from_url(url, key_prefix=prefix), hasher=hasher, cache=False)
        try:
            with pytest.raises(KeyRevoked):
                await until_available(lambda: fresh.verify(doomed.key))
            assert (await until_available(lambda: fresh.get(doomed.record.id))).status == (
                "revoked"
            )
        finally:
            await fresh.aclose()
        assert (await until_available(lambda: reader.verify(live.key))).id == live.record.id
        # The key's data lives on the new master, where `redis-cli -c` finds it too.
        assert redis_servers.cli(source.port, "EXISTS", name).strip().startswith("ASK")
        assert redis_servers.cli(source.port, "-c", "HGET", name, "state").strip() == "revoked"
        # The resharding resumes and ends: the counts held meanwhile are written.
        await asyncio.to_thread(finish_migration, cluster, *moving)
        moving = None
        await until_available(reader.usage_buffer.flush)
        assert (await writer.get(doomed.record.id)).request_count >= 1
    finally:
        if moving is not None:
            await asyncio.to_thread(finish_migration, cluster, *moving)
        await reader.aclose()
        await writer.aclose()
        await collect_dropped_sockets()


def other_master_id(deployment: redis_servers.LocalCluster, source: redis_servers.Node) -> str:
    other = next(node for node in deployment.masters() if node.port != source.port)
    return redis_servers.node_id(other.port)


async def test_a_slot_that_refuses_usage_holds_no_other_keys_counts(
    cluster: redis_servers.LocalCluster, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One key's slot is marked as migrating to a master that does not import it: every
    write of that key's usage fails (TRYAGAIN, then ASK and MOVED back and forth). The other
    key's counts are written all the same, each batch on its own; at close, what could not
    be written is logged with its counts; once the slot is back, it is written, once."""
    url = cluster.url
    hasher = Hasher(pepper=PEPPER)
    manager = KeyManager(
        store_from_url(url, key_prefix=prefix), hasher=hasher, usage_flush_interval=0.05
    )
    observer = KeyManager(store_from_url(url, key_prefix=prefix), hasher=hasher, cache=False)
    source: redis_servers.Node | None = None
    slot = ""
    try:
        stuck = await manager.create(name="stuck", full_access=True)
        store = manager.store
        assert isinstance(store, RedisStore)
        stuck_name = store.key_name(stuck.record.id)
        while True:  # another key, in another slot
            moving = await manager.create(name="moving", full_access=True)
            if slot_of(cluster, store.key_name(moving.record.id)) != slot_of(cluster, stuck_name):
                break
        # Both keys are counted together in one batch first ...
        await manager.verify(stuck.key)
        await manager.verify(moving.key)
        await manager.usage_buffer.flush()

        source = cluster.master_of(stuck_name)
        slot = slot_of(cluster, stuck_name)
        redis_servers.cli(
            source.port, "CLUSTER", "SETSLOT", slot, "MIGRATING", other_master_id(cluster, source)
        )
        # ... then the stuck key's slot refuses, and both are counted on.
        for _ in range(3):
            await manager.verify(stuck.key)
            await manager.verify(moving.key)
        for _ in range(200):  # a bound, not a timing
            if (await observer.get(moving.record.id)).request_count == 4:
                break
            await asyncio.sleep(0.05)
        assert (await observer.get(moving.record.id)).request_count == 4
        # And again: a key's kept batch never holds its own newer counts back for good.
        await manager.verify(moving.key)
        for _ in range(200):
            if (await observer.get(moving.record.id)).request_count == 5:
                break
            await asyncio.sleep(0.05)
        assert (await observer.get(moving.record.id)).request_count == 5
        assert (await observer.get(stuck.record.id)).request_count == 1
        assert manager.usage_buffer.unwritten() == 3

        with (
            caplog.at_level(logging.WARNING, logger="apikeys"),
            pytest.raises(StoreUnavailable),
        ):
            await manager.usage_buffer.aclose()
        [told] = [
            record.getMessage()
            for record in caplog.records
            if "not written at close" in record.getMessage()
        ]
        assert "3 request(s) of 1 key(s)" in told

        redis_servers.cli(source.port, "CLUSTER", "SETSLOT", slot, "STABLE")
        source = None
        await until_available(manager.usage_buffer.aclose)
        assert manager.usage_buffer.unwritten() == 0
        assert (await observer.get(stuck.record.id)).request_count == 4
        assert (await observer.get(moving.record.id)).request_count == 5
    finally:
        if source is not None:
            redis_servers.cli(source.port, "CLUSTER", "SETSLOT", slot, "STABLE")
        await manager.aclose()
        await observer.aclose()


# -- Sentinel: one sentinel of three cut off or frozen ---------------------------------------


@pytest.fixture
async def sentinels() -> AsyncIterator[redis_servers.LocalSentinel]:
    redis_servers.require_redis_binaries()
    deployment = redis_servers.LocalSentinel()
    await asyncio.to_thread(deployment.start)
    try:
        yield deployment
    finally:
        for node in deployment.sentinels:
            if node.process is not None and node.process.poll() is None:
                node.process.send_signal(signal.SIGCONT)
        await asyncio.to_thread(deployment.close)


async def cached_until_hit(manager: KeyManager, token: str, attempts: int = 200) -> None:
    """Verify `token` until the manager's cache serves it: its channel is up and proven
    fresh. Fails if that never happens (a bound, not a timing)."""
    cache = manager.cache
    assert cache is not None
    for _ in range(attempts):
        before = cache.hits
        await until_available(lambda: manager.verify(token))
        if cache.hits > before:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the key cache never served the key")


async def refused_everywhere(readers: list[KeyManager], token: str) -> None:
    """Every reader refuses `token` (revoked), 20 times in a row, and never admits it."""
    for reader in readers:
        refused = 0
        for _ in range(400):  # a bound for a hang, not a timing
            try:
                await reader.verify(token)
            except KeyRevoked:
                refused += 1
                if refused >= 20:
                    break
            except StoreUnavailable:
                refused = 0
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("a revoked key was admitted")
        assert refused >= 20


def cut_off(deployment: redis_servers.LocalSentinel, sentinel: redis_servers.Node) -> None:
    """Make `sentinel` lose the data nodes: it watches the service at an address where
    nothing answers (as one whose network to them is cut keeps an address it cannot reach)."""
    taken: set[int] = set()
    nowhere = redis_servers.free_port(taken)
    name = redis_servers.SERVICE_NAME
    redis_servers.cli(sentinel.port, "SENTINEL", "REMOVE", name)
    redis_servers.cli(sentinel.port, "SENTINEL", "MONITOR", name, "127.0.0.1", str(nowhere), "2")
    redis_servers.cli(sentinel.port, "SENTINEL", "SET", name, "down-after-milliseconds", "1000")


async def test_one_sentinel_cut_off_from_the_data_nodes_is_outvoted_not_a_veto(
    sentinels: redis_servers.LocalSentinel, prefix: str
) -> None:
    """One sentinel of three names an address it cannot reach: the other two are a
    majority. Caching workers keep admitting a valid key from their proven cache, and
    refuse a key once it is revoked."""
    url = sentinels.url
    hasher = Hasher(pepper=PEPPER)
    managers: list[KeyManager] = []
    try:
        writer = KeyManager(store_from_url(url, key_prefix=prefix), hasher=hasher, cache=False)
        managers.append(writer)
        valid = await writer.create(name="valid", full_access=True)
        doomed = await writer.create(name="doomed", full_access=True)
        await asyncio.to_thread(cut_off, sentinels, sentinels.sentinels[0])
        readers = [KeyManager(store_from_url(url, key_prefix=prefix), hasher=hasher)]
        readers.append(KeyManager(store_from_url(url, key_prefix=prefix), hasher=hasher))
        managers += readers
        for reader in readers:
            await cached_until_hit(reader, valid.key)
            await cached_until_hit(reader, doomed.key)
        await until_available(lambda: writer.revoke(doomed.record.id))
        await refused_everywhere(readers, doomed.key)
        for reader in readers:
            await cached_until_hit(reader, valid.key)
    finally:
        for manager in managers:
            await manager.aclose()


# A frozen sentinel answers nothing: each ask of it ends at the socket timeout. One second
# instead of the default two (and the WAIT within half of it) asks the same questions sooner.
FROZEN_WAIT = {"socket_timeout": 1.0, "wait_timeout": 0.5}


async def test_a_frozen_sentinel_neither_holds_requests_nor_keeps_the_cache_unproven(
    sentinels: redis_servers.LocalSentinel, prefix: str
) -> None:
    """The first sentinel of the list is frozen (SIGSTOP: it accepts connections and never
    answers): writers and readers ask the others, the cache is proven fresh, a revoke is
    refused everywhere."""
    url = sentinels.url
    hasher = Hasher(pepper=PEPPER)
    managers: list[KeyManager] = []
    frozen = sentinels.sentinels[0]
    try:
        writer = KeyManager(
            store_from_url(url, key_prefix=prefix, **FROZEN_WAIT), hasher=hasher, cache=False
        )
        managers.append(writer)
        valid = await writer.create(name="valid", full_access=True)
        doomed = await writer.create(name="doomed", full_access=True)
        assert frozen.process is not None
        frozen.process.send_signal(signal.SIGSTOP)
        readers = [KeyManager(store_from_url(url, key_prefix=prefix, **FROZEN_WAIT), hasher=hasher)]
        readers.append(
            KeyManager(store_from_url(url, key_prefix=prefix, **FROZEN_WAIT), hasher=hasher)
        )
        managers += readers
        for reader in readers:
            await cached_until_hit(reader, valid.key)
            await cached_until_hit(reader, doomed.key)
        late = KeyManager(
            store_from_url(url, key_prefix=prefix, **FROZEN_WAIT), hasher=hasher, cache=False
        )
        managers.append(late)
        await until_available(lambda: late.revoke(doomed.record.id))
        await refused_everywhere(readers, doomed.key)
        for reader in readers:
            await cached_until_hit(reader, valid.key)
    finally:
        if frozen.process is not None:
            frozen.process.send_signal(signal.SIGCONT)
        for manager in managers:
            await manager.aclose()


async def test_the_sentinel_connections_get_the_store_timeouts_and_no_retries() -> None:
    store = store_from_url(
        "redis+sentinel://127.0.0.1:1,127.0.0.1:2/svc?socket_timeout=3&socket_connect_timeout=0.5"
    )
    assert isinstance(store, RedisStore)
    try:
        assert store._sentinel is not None
        for sentinel in store._sentinel.sentinels:
            kwargs = sentinel.connection_pool.connection_kwargs
            assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (3.0, 0.5)
            assert kwargs["retry"].get_retries() == 0
    finally:
        await store.aclose()


# -- whatever a call to Redis raises is a 503 --------------------------------------------------


@pytest.mark.parametrize("kind", ["string", "list", "set", "zset"])
async def test_a_key_overwritten_with_another_type_fails_closed_with_503(
    redis_url: str, redis_key_prefix: str, kind: str
) -> None:
    """Another client replaces a key's hash with a value of another type: Redis answers
    WRONGTYPE to every read and change of it. Each is a 503 (StoreUnavailable), never an
    error the middleware would answer 500 to, and nothing admits the key."""
    hasher = Hasher(pepper=PEPPER)
    manager = KeyManager(
        store_from_url(redis_url, key_prefix=redis_key_prefix), hasher=hasher, cache=False
    )
    try:
        created = await manager.create(name="overwritten", full_access=True)
        store = manager.store
        assert isinstance(store, RedisStore)
        name = store.key_name(created.record.id)
        client = store.client
        await client.delete(name)
        if kind == "string":
            await client.set(name, "x")
        elif kind == "list":
            await client.rpush(name, "x")
        elif kind == "set":
            await client.sadd(name, "x")
        else:
            await client.zadd(name, {"x": 1})
        with pytest.raises(StoreUnavailable):
            await manager.verify(created.key)
        with pytest.raises(StoreUnavailable):
            await manager.revoke(created.record.id)
        with pytest.raises(StoreUnavailable):
            await manager.list()
    finally:
        await manager.aclose()
