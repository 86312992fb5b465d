"""The Redis store, the limiter and the CLI on a real Redis Cluster and Sentinel set.

The deployments are local (`tests/redis_servers.py`): 3 masters and 3 replicas made with
`redis-cli --cluster create`, and a master, a replica and 3 sentinels. A test that kills a
master brings the node back before it ends.
"""

from __future__ import annotations

import asyncio
import gc
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar

import pytest
from click.testing import CliRunner, Result
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from apikeys import Hasher, KeyManager, store_from_url
from apikeys.cli import main
from apikeys.errors import (
    ChangeNotConfirmed,
    ConfigurationError,
    KeyDisabled,
    KeyRevoked,
    StoreUnavailable,
)
from apikeys.ratelimit import RateLimiter, ThresholdCrossing
from apikeys.stores.redis import RedisStore, parse_redis_url
from apikeys.types import UsageDelta
from tests import redis_servers
from tests.conftest import delete_redis_prefix

pytestmark = pytest.mark.redis

PEPPER = "JNT70i2QHhPS0Nyvpp0scbCIxsMsrlqHAqxCDohdvFg"
DEPLOYMENTS = ["cluster", "sentinel"]
_T = TypeVar("_T")


@pytest.fixture(params=DEPLOYMENTS)
def deployment(request: pytest.FixtureRequest) -> Any:
    if request.param == "cluster":
        return request.getfixturevalue("redis_cluster")
    return request.getfixturevalue("redis_sentinel")


@pytest.fixture
def prefix() -> str:
    return f"apikeys-dep-{uuid.uuid4().hex[:10]}:"


@pytest.fixture
async def cleanup(deployment: Any, prefix: str) -> AsyncIterator[None]:
    yield
    await delete_redis_prefix(deployment.url, prefix)
    await delete_redis_prefix(deployment.url, "LIMITS:" + prefix)


# -- URLs -------------------------------------------------------------------------------------


def test_the_url_forms_are_read_as_limits_reads_them() -> None:
    cluster = parse_redis_url("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001?wait_replicas=2")
    assert cluster.kind == "cluster"
    assert cluster.hosts == (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    assert cluster.wait_replicas == 2
    assert cluster.options == {"password": "pw"}

    sentinel = parse_redis_url("redis+sentinel://s1:26379,s2:26380/mymaster/3?wait_timeout=0.5")
    assert (sentinel.kind, sentinel.service_name, sentinel.db) == ("sentinel", "mymaster", 3)
    assert sentinel.hosts == (("s1", 26379), ("s2", 26380))
    assert sentinel.wait_timeout == 0.5
    assert sentinel.wait_replicas is None  # auto

    single = parse_redis_url("rediss://:pw@cache:6380/2?wait_replicas=0&socket_timeout=1")
    assert (single.kind, single.db, single.wait_replicas) == ("single", 2, 0)
    assert "wait_replicas" not in single.url


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://s1:26379",  # no service name
        "redis+cluster://c1:7000/3",  # a cluster has only db 0
        "redis+cluster://c1",  # no port
        "redis://localhost:6379/0?wait_replicas=-1",
        "redis://localhost:6379/0?wait_timeout=0",
    ],
)
def test_a_malformed_url_is_a_configuration_error(url: str) -> None:
    with pytest.raises(ConfigurationError):
        store_from_url(url)


@pytest.mark.parametrize(
    "base",
    ["redis://localhost:6379/0", "redis+sentinel://s1:26379/mymaster", "redis+cluster://c1:7000"],
    ids=["single", "sentinel", "cluster"],
)
def test_a_wait_longer_than_half_the_socket_timeout_is_refused_when_the_store_is_made(
    base: str,
) -> None:
    # The replicas' answer would come after the connection gave up: a 503, not the
    # `ChangeNotConfirmed` that says the change committed.
    with pytest.raises(ConfigurationError, match=r"wait_timeout \(2 s\).*socket_timeout \(2 s\)"):
        store_from_url(f"{base}?wait_timeout=2")
    with pytest.raises(ConfigurationError, match="at most half"):
        store_from_url(f"{base}?wait_timeout=1.5&socket_timeout=2")
    for fine in (f"{base}?wait_timeout=1", f"{base}?wait_timeout=2&socket_timeout=5"):
        store = store_from_url(fine)
        assert isinstance(store, RedisStore)


def test_the_store_repr_never_shows_the_password() -> None:
    store = store_from_url("redis+sentinel://:s3cret@127.0.0.1:1/svc")
    assert "s3cret" not in repr(store)
    assert "svc" in repr(store)


# -- one slot per API key -------------------------------------------------------------------


async def test_every_redis_key_of_one_api_key_is_in_its_slot(
    redis_cluster: redis_servers.LocalCluster, prefix: str
) -> None:
    url = redis_cluster.url
    manager = KeyManager(
        store_from_url(url, key_prefix=prefix),
        hasher=Hasher(pepper=PEPPER),
        usage_flush_interval=0.05,
    )
    limiter = RateLimiter(
        "burst=5/second, daily=100/day", storage_url=url, key_prefix=prefix + "limits"
    )
    try:
        created = await manager.create(name="one slot", workspace="w", full_access=True)
        key_id = created.record.id
        await manager.disable(key_id)
        await manager.enable(key_id)
        await manager.store.add_usage(
            {key_id: UsageDelta(2, datetime.now(UTC), daily={("2026-01-01", "admitted"): 2})},
            batch_id="b1",
        )
        assert (await limiter.hit_policies(key_id)).allowed
        store = manager.store
        assert isinstance(store, RedisStore)
        client = store.client
        names: list[str] = []
        for node in client.get_primaries():
            names += [
                name async for name in client.scan_iter(match=f"*{key_id}*", target_nodes=node)
            ]
        kinds = {name.split(":")[1] for name in names if name.startswith(prefix)}
        assert kinds >= {"key", "audit", "usage", "usage-batch"}
        assert any(name.startswith("LIMITS:") for name in names)  # the limiter's counters
        assert len(names) >= 6
        assert {key_slot(name.encode()) for name in names} == {key_slot(key_id.encode())}
    finally:
        await manager.aclose()
        await limiter.aclose()
        await delete_redis_prefix(url, prefix)
        await delete_redis_prefix(url, "LIMITS:" + prefix)


async def test_a_redis_cluster_client_is_taken_as_it_is(
    redis_cluster: redis_servers.LocalCluster, prefix: str
) -> None:
    host, port = parse_redis_url(redis_cluster.url).hosts[0]
    store = RedisStore(RedisCluster(host=host, port=port, decode_responses=True), key_prefix=prefix)
    manager = KeyManager(store, hasher=Hasher(pepper=PEPPER))
    try:
        created = await manager.create(name="own client", full_access=True)
        assert (await manager.verify(created.key)).id == created.record.id
        assert store.deployment == "cluster"
    finally:
        await manager.aclose()
        await delete_redis_prefix(redis_cluster.url, prefix)


async def test_on_a_cluster_the_first_calls_of_a_new_process_all_succeed_however_many_at_once(
    redis_cluster: redis_servers.LocalCluster, prefix: str
) -> None:
    # A cluster client that has not learnt the slot map routes a command as if it had no key
    # (redis-py 8.1): a new process's first requests, all at once, went to random masters,
    # and the MOVED replies made the client close itself under the others: 503s.
    url = redis_cluster.url
    try:
        for round_ in range(3):
            store = store_from_url(url, key_prefix=prefix)
            limiter = RateLimiter("1000/minute", storage_url=url, key_prefix=prefix + "limits")
            try:
                settings = [store.claim_setting(f"s{n % 3}", "x") for n in range(30)]
                leases = [
                    limiter.hit_policies(
                        f"key{round_}-{n}", identity=f"i{n % 7}", identity_policies="500/minute"
                    )
                    for n in range(60)
                ]
                answers = await asyncio.gather(*settings, *leases, return_exceptions=True)
                failed = [
                    f"{type(one).__name__} ({one.__cause__!r})"
                    for one in answers
                    if isinstance(one, BaseException)
                ]
                assert failed == []
            finally:
                await store.aclose()
                await limiter.aclose()
    finally:
        await delete_redis_prefix(url, prefix)
        await delete_redis_prefix(url, "LIMITS:" + prefix)


# -- the limiter ------------------------------------------------------------------------------


async def test_the_limiter_with_two_policies(deployment: Any, prefix: str, cleanup: None) -> None:
    limiter = RateLimiter(
        "burst=3/minute, daily=5/day", storage_url=deployment.url, key_prefix=prefix + "limits"
    )
    other = RateLimiter(
        "burst=3/minute, daily=5/day", storage_url=deployment.url, key_prefix=prefix + "limits"
    )
    try:
        decisions = [await limiter.hit_policies("key-a") for _ in range(2)]
        decisions += [await other.hit_policies("key-a") for _ in range(3)]
        # Three per minute across both processes, whichever asks.
        assert [decision.allowed for decision in decisions] == [True, True, True, False, False]
        refused = decisions[-1]
        assert [status.name for status in refused.policies] == ["burst", "daily"]
        assert refused.violated == ("burst",)
        assert (await limiter.hit("key-b", "2/minute")).allowed
    finally:
        await limiter.aclose()
        await other.aclose()


async def test_the_limiter_tells_each_threshold_once_across_processes(
    deployment: Any, prefix: str, cleanup: None
) -> None:
    limiters = [
        RateLimiter(storage_url=deployment.url, key_prefix=prefix + "limits") for _ in range(2)
    ]
    told: list[ThresholdCrossing] = []
    for limiter in limiters:
        limiter.on_threshold = told.append
    try:
        for turn in range(12):
            await limiters[turn % 2].hit_policies("3xK9pQ2mZ7aB", "burst=10/minute, daily=50/day")
    finally:
        for limiter in limiters:
            await limiter.aclose()
    # On a cluster the counters carry the key's id as a hash tag: read back without it.
    assert sorted((c.key_id, c.policy, c.threshold) for c in told) == [
        ("3xK9pQ2mZ7aB", "burst", threshold) for threshold in (80, 90, 100)
    ]


# -- durability -------------------------------------------------------------------------------


def _wait_calls(deployment: Any) -> int:
    """`WAIT` commands run by the deployment's masters."""
    if isinstance(deployment, redis_servers.LocalCluster):
        ports = [node.port for node in deployment.masters()]
    else:
        ports = [deployment.master_port()]
    total = 0
    for port in ports:
        stats = redis_servers.info(port, "commandstats").get("cmdstat_wait", "calls=0")
        total += int(dict(item.split("=", 1) for item in stats.split(","))["calls"])
    return total


async def test_changes_wait_for_a_replica_by_default(
    deployment: Any, prefix: str, cleanup: None
) -> None:
    manager = KeyManager(
        store_from_url(deployment.url, key_prefix=prefix), hasher=Hasher(pepper=PEPPER)
    )
    try:
        before = _wait_calls(deployment)
        created = await manager.create(name="waited for", full_access=True)
        await manager.revoke(created.record.id)
        assert _wait_calls(deployment) >= before + 2  # auto: the masters have replicas
    finally:
        await manager.aclose()


async def test_a_wait_that_times_out_says_the_change_committed(
    redis_url: str, redis_key_prefix: str
) -> None:
    # The shared test server has no replica: asking for one can never be confirmed.
    url = f"{redis_url}?wait_replicas=1&wait_timeout=0.05"
    manager = KeyManager(
        store_from_url(url, key_prefix=redis_key_prefix), hasher=Hasher(pepper=PEPPER)
    )
    plain = KeyManager(
        store_from_url(redis_url, key_prefix=redis_key_prefix), hasher=Hasher(pepper=PEPPER)
    )
    try:
        # A new key is returned all the same (it cannot be shown again), marked unconfirmed.
        created = await manager.create(name="unconfirmed", full_access=True)
        assert created.warning is not None
        assert "committed on the Redis master" in created.warning
        [record] = await plain.list()  # committed all the same
        with pytest.raises(ChangeNotConfirmed, match="committed on the Redis master") as caught:
            await manager.revoke(record.id)
        assert isinstance(caught.value, StoreUnavailable)  # 503, the CLI's exit 1
        assert (await plain.get(record.id)).status == "revoked"
    finally:
        await manager.aclose()
        await plain.aclose()
        await delete_redis_prefix(redis_url, redis_key_prefix)


# -- the CLI ----------------------------------------------------------------------------------


@pytest.fixture
def cli(deployment: Any, prefix: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("APIKEYS_PEPPER", PEPPER)
    monkeypatch.setenv("APIKEYS_STORE_URL", f"{deployment.url}")
    # The CLI builds its store from the URL alone: give it this test's prefix.
    original = RedisStore.from_url.__func__  # type: ignore[attr-defined]

    def from_url(cls: type[RedisStore], url: str, **options: Any) -> RedisStore:
        return original(cls, url, **{"key_prefix": prefix, **options})  # type: ignore[no-any-return]

    monkeypatch.setattr(RedisStore, "from_url", classmethod(from_url))
    runner = CliRunner()

    def run(*args: str, code: int = 0) -> Result:
        result = runner.invoke(main, list(args), catch_exceptions=False)
        assert result.exit_code == code, result.output + result.stderr
        return result

    try:
        yield run
    finally:
        asyncio.run(delete_redis_prefix(deployment.url, prefix))


def test_every_cli_command(cli: Any, tmp_path: Any) -> None:
    created = json.loads(
        cli("create", "--name", "cli", "--workspace", "w", "--scope", "a:read", "--json").stdout
    )
    key_id = created["id"]
    assert json.loads(cli("show", key_id, "--json").stdout)["status"] == "active"
    assert [row["id"] for row in json.loads(cli("list", "--workspace", "w", "--json").stdout)] == [
        key_id
    ]
    cli("update", key_id, "--name", "renamed", "--rate-limit", "10/minute", "--actor", "ops")
    cli("disable", key_id)
    assert json.loads(cli("list", "--status", "disabled", "--json").stdout)[0]["id"] == key_id
    cli("enable", key_id)
    rolled = json.loads(cli("roll", key_id, "--grace", "0s", "--json").stdout)
    new_id = rolled["id"]
    leaked = tmp_path / "leak.txt"
    leaked.write_text(f"token = {rolled['key']}\n")
    cli("scan", str(leaked), "--revoke", code=1)
    assert json.loads(cli("show", new_id, "--json").stdout)["status"] == "revoked"
    cli("revoke", key_id, "--yes")
    assert json.loads(cli("show", key_id, "--json").stdout)["status"] == "revoked"
    cli("enable", key_id, code=1)  # refused: revoked
    actions = [event["action"] for event in json.loads(cli("audit", "--json").stdout)]
    assert {"created", "disabled", "enabled", "revoked"} <= set(actions)
    assert json.loads(cli("audit", "--key", key_id, "--json").stdout)
    cli("usage", key_id, "--json")


def test_an_unreachable_cluster_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIKEYS_PEPPER", PEPPER)
    result = CliRunner().invoke(
        main, ["--store", "redis+cluster://:pw@127.0.0.1:1", "list"], catch_exceptions=False
    )
    assert result.exit_code == 1
    assert len(result.stderr.strip().splitlines()) == 1
    assert "unavailable" in result.stderr
    assert "pw" not in result.stderr


async def until_available(call: Callable[[], Awaitable[_T]], attempts: int = 50) -> _T:
    """`call()`, again after each StoreUnavailable, at most `attempts` times."""
    for _ in range(attempts - 1):
        try:
            return await call()
        except StoreUnavailable:
            await asyncio.sleep(0.1)
    return await call()


# redis-py's cluster client leaves sockets to a killed node unclosed when it learns the new
# slot map (they are collected after the test): not apikeys' connections to close.
_FAILOVER_SOCKETS = [
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


async def collect_failover_sockets() -> None:
    """Collect, while `_FAILOVER_SOCKETS` still applies, the sockets redis-py dropped
    without closing when their node died: left to the garbage collector, they would be
    reported in whichever later test it happens to run."""
    for _ in range(3):
        await asyncio.sleep(0.05)  # redis-py's own disconnect tasks finish first
        gc.collect()


# -- a master killed under load ---------------------------------------------------------------


@pytest.mark.slow
@_FAILOVER_SOCKETS[0]
@_FAILOVER_SOCKETS[1]
async def test_a_master_killed_under_load_gives_503s_then_recovery_and_no_stale_admit(
    deployment: Any, prefix: str, cleanup: None
) -> None:
    """Requests keep coming while the master of the key's slot is killed: they fail closed
    (StoreUnavailable, 503) while the failover lasts, then succeed again; a key revoked
    just before the kill (acknowledged by a replica) is refused after it."""
    url = deployment.url
    writer = KeyManager(store_from_url(url, key_prefix=prefix), hasher=Hasher(pepper=PEPPER))
    reader = KeyManager(store_from_url(url, key_prefix=prefix), hasher=Hasher(pepper=PEPPER))
    killed = None
    try:
        live = await writer.create(name="live", full_access=True)
        doomed = await writer.create(name="doomed", full_access=True)
        await reader.verify(live.key)
        await reader.verify(doomed.key)
        await writer.revoke(doomed.record.id)  # returns once a replica has it

        if isinstance(deployment, redis_servers.LocalCluster):
            store = writer.store
            assert isinstance(store, RedisStore)
            killed = deployment.kill_master(store.key_name(doomed.record.id))
        else:
            killed = deployment.kill_master()

        outcomes = {"ok": 0, "unavailable": 0}
        stale = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120  # a bound, not a timing
        recovered_after_failure = 0
        while loop.time() < deadline:
            try:
                await reader.verify(live.key)
            except StoreUnavailable:
                outcomes["unavailable"] += 1
                recovered_after_failure = 0
                await asyncio.sleep(0.05)
                continue
            outcomes["ok"] += 1
            try:
                await reader.verify(doomed.key)
                stale += 1
            except KeyRevoked:
                pass
            except StoreUnavailable:
                outcomes["unavailable"] += 1
            if outcomes["unavailable"]:
                recovered_after_failure += 1
                if recovered_after_failure >= 20:
                    break
            await asyncio.sleep(0.01)

        assert stale == 0
        assert outcomes["unavailable"] > 0  # the failover was seen, as 503s
        assert recovered_after_failure >= 20  # and it ended: requests pass again
        # Changes work again after the failover, usage flushes too. A process idle through
        # the failover may answer 503 once per connection to the dead node (nothing is
        # retried automatically), then follows the new master.
        await until_available(reader.usage_buffer.flush)
        await until_available(writer.usage_buffer.flush)
        # The promoted master has no replica until the killed node comes back; once it is
        # back, changes wait for it again (wait_replicas=auto is decided at each change).
        deployment.wait_failover(killed)
        deployment.restore(killed)
        killed = None
        after = await until_available(lambda: writer.create(name="after", full_access=True))
        # The old master's return changes what the sentinels say: the reader's calls are
        # held (503) until its channel is subscribed on the master they all name.
        verified = await until_available(lambda: reader.verify(after.key), attempts=200)
        assert verified.id == after.record.id
        with pytest.raises(KeyRevoked):
            await reader.verify(doomed.key)
    finally:
        await writer.aclose()
        await reader.aclose()
        if killed is not None:
            deployment.wait_failover(killed)
            deployment.restore(killed)
        await collect_failover_sockets()


# -- the key cache through Sentinel and on a cluster -----------------------------------------


async def cached_until_hit(manager: KeyManager, token: str, attempts: int = 200) -> None:
    """Verify `token` until the manager's cache serves it (its channel is up and proven)."""
    cache = manager.cache
    assert cache is not None
    for _ in range(attempts):
        before = cache.hits
        await until_available(lambda: manager.verify(token))
        if cache.hits > before:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the key cache never served the key")


async def test_the_cache_hears_every_writer(deployment: Any, prefix: str) -> None:
    url = deployment.url
    reader = KeyManager(store_from_url(url, key_prefix=prefix), hasher=Hasher(pepper=PEPPER))
    writer = KeyManager(
        store_from_url(url, key_prefix=prefix), hasher=Hasher(pepper=PEPPER), cache=False
    )
    try:
        revoked = await writer.create(name="revoked by a manager", full_access=True)
        raw = await writer.create(name="disabled by redis-cli", full_access=True)
        await cached_until_hit(reader, revoked.key)
        await cached_until_hit(reader, raw.key)

        await writer.revoke(revoked.record.id)
        with pytest.raises(KeyRevoked):
            await reader.verify(revoked.key)

        store = writer.store
        assert isinstance(store, RedisStore)
        await store.client.hset(store.key_name(raw.record.id), "state", "disabled")
        # A writer that is not apikeys waits for nobody: refused once a lease has passed.
        assert reader.cache is not None
        await asyncio.sleep(reader.cache.lease)
        with pytest.raises(KeyDisabled):
            await reader.verify(raw.key)
    finally:
        await reader.aclose()
        await writer.aclose()
        await delete_redis_prefix(url, prefix)


@pytest.mark.slow
@_FAILOVER_SOCKETS[0]
@_FAILOVER_SOCKETS[1]
async def test_a_failover_drops_the_cache_and_it_comes_back(deployment: Any, prefix: str) -> None:
    url = deployment.url
    reader = KeyManager(store_from_url(url, key_prefix=prefix), hasher=Hasher(pepper=PEPPER))
    writer = KeyManager(
        store_from_url(url, key_prefix=prefix), hasher=Hasher(pepper=PEPPER), cache=False
    )
    killed = None
    try:
        key = await writer.create(name="survivor", full_access=True)
        await cached_until_hit(reader, key.key)
        if isinstance(deployment, redis_servers.LocalCluster):
            store = writer.store
            assert isinstance(store, RedisStore)
            killed = deployment.kill_master(store.key_name(key.record.id))
        else:
            killed = deployment.kill_master()
        deployment.wait_failover(killed)
        deployment.restore(killed)
        killed = None
        # The cache follows the new master and serves again ...
        await cached_until_hit(reader, key.key)
        # ... and hears changes made there.
        await until_available(lambda: writer.revoke(key.record.id))
        with pytest.raises(KeyRevoked):
            await reader.verify(key.key)
    finally:
        await reader.aclose()
        await writer.aclose()
        if killed is not None:
            deployment.wait_failover(killed)
            deployment.restore(killed)
        await collect_failover_sockets()
        await delete_redis_prefix(url, prefix)


def sentinel_set_whose_master_stays_one() -> redis_servers.LocalSentinel:
    """A private Sentinel set whose first master cannot be demoted (its REPLICAOF and
    SLAVEOF are renamed): after a failover it goes on answering as a master, with its
    clients, as one whose links to the sentinels were cut does until Sentinel reaches it."""
    redis_servers.require_redis_binaries()
    deployment = redis_servers.LocalSentinel()
    hidden = f"hidden-{uuid.uuid4().hex}"
    deployment.data[0].args = [
        *("--rename-command", "REPLICAOF", f"{hidden}-replicaof"),
        *("--rename-command", "SLAVEOF", f"{hidden}-slaveof"),
    ]
    deployment.start()
    return deployment


@pytest.mark.slow
async def test_a_failover_that_leaves_the_old_master_up_admits_no_key_revoked_on_the_new_one(
    prefix: str,
) -> None:
    """Sentinel promotes the replica while the old master still answers as one: caching
    readers subscribed to (and reading from) the old master must stop admitting from it, so
    that a key revoked on the new master is never admitted once the revoke has returned."""
    deployment = await asyncio.to_thread(sentinel_set_whose_master_stays_one)
    url = deployment.url
    hasher = Hasher(pepper=PEPPER)
    readers = [KeyManager(store_from_url(url, key_prefix=prefix), hasher=hasher) for _ in range(2)]
    managers = list(readers)
    try:
        creator = KeyManager(store_from_url(url, key_prefix=prefix), hasher=hasher, cache=False)
        managers.append(creator)
        doomed = await creator.create(name="doomed", full_access=True)
        for reader in readers:
            await cached_until_hit(reader, doomed.key)

        old = deployment.master()
        sentinel_port = deployment.sentinels[0].port
        redis_servers.cli(sentinel_port, "SENTINEL", "FAILOVER", redis_servers.SERVICE_NAME)
        await asyncio.to_thread(deployment.wait_failover, old)
        assert redis_servers.info(old.port, "replication")["role"] == "master"

        # A writer that starts now finds the new master, and revokes the key there.
        writer = KeyManager(store_from_url(url, key_prefix=prefix), hasher=hasher, cache=False)
        managers.append(writer)
        await until_available(lambda: writer.revoke(doomed.record.id))

        admitted = 0
        refused = [0] * len(readers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120  # a bound for a hang, not a timing
        while min(refused) < 20 and loop.time() < deadline:
            for index, reader in enumerate(readers):
                try:
                    await reader.verify(doomed.key)
                    admitted += 1
                except KeyRevoked:
                    refused[index] += 1
                except StoreUnavailable:
                    pass  # while the readers find the new master: 503, never an admission
            await asyncio.sleep(0.01)
        assert admitted == 0
        assert min(refused) >= 20  # the readers follow the new master and refuse the key
        # The old master was up, and a master, all along.
        assert redis_servers.info(old.port, "replication")["role"] == "master"
    finally:
        for manager in managers:
            await manager.aclose()
        await asyncio.to_thread(deployment.close)


# -- the example service ----------------------------------------------------------------------


def test_the_example_service_serves_its_endpoints_and_refuses_a_revoked_key(
    deployment: Any, tmp_path: Any
) -> None:
    import httpx

    from apikeys.keys import parse_key
    from tests.examples.conftest import PEPPER as SERVICE_PEPPER
    from tests.examples.conftest import service_env, start_service, stop_service

    env = service_env(
        APIKEYS_STORE_URL=deployment.url,
        APIKEYS_LIMITER_URL=deployment.url,
        EXAMPLE_DATABASE_URL=f"sqlite:///{tmp_path / 'example.db'}",
    )
    hasher = Hasher(pepper=SERVICE_PEPPER)

    async def create() -> str:
        async with KeyManager(store_from_url(deployment.url), hasher=hasher) as manager:
            return (await manager.create(name="svc", workspace="demo", full_access=True)).key

    async def revoke(key: str) -> None:
        async with KeyManager(store_from_url(deployment.url), hasher=hasher) as manager:
            await manager.revoke(parse_key(key).id)

    log = tmp_path / "service.log"
    process, base_url = start_service(env, log)
    try:
        key = asyncio.run(create())
        with httpx.Client(
            base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=10
        ) as http:
            created = http.post("/api/v1/contacts", json={"name": "Ada", "email": "a@b.co"})
            assert created.status_code == 201, created.text
            assert http.get("/api/v1/contacts").status_code == 200
            contact = http.get(created.headers["location"])
            assert contact.status_code == 200, contact.text
            campaigns = http.get("/api/v1/campaigns")
            assert campaigns.status_code == 200, campaigns.text
            assert "ratelimit" in campaigns.headers
            campaign_id = campaigns.json()["data"][0]["id"]
            triggered = http.post(f"/api/v1/campaigns/{campaign_id}/trigger")
            assert triggered.status_code == 202, triggered.text
            asyncio.run(revoke(key))
            refused = http.get("/api/v1/contacts")
            assert refused.status_code == 401
            assert refused.json()["code"] == "key_revoked"
    finally:
        stop_service(process, log)
        # The service's own key prefix, on a deployment that only the tests use.
        asyncio.run(delete_redis_prefix(deployment.url, "apikeys:"))
        asyncio.run(delete_redis_prefix(deployment.url, "LIMITS:"))
