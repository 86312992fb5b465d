"""Keys of an identity on the request path (`Gate`): their identity's limits and credits are
charged with theirs in one decision, refused requests are charged to nothing, a disabled or
revoked identity refuses its keys at the next request in every process, and the headers
show the identity's policies beside the key's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apikeys import KeyManager, store_from_url
from apikeys.errors import (
    AuthenticationError,
    CreditsExhausted,
    KeyDisabled,
    KeyRevoked,
    RateLimited,
)
from apikeys.gate import Gate
from apikeys.hashing import Hasher
from apikeys.ratelimit import RateLimiter
from apikeys.stores.contract import KeyStore
from apikeys.stores.memory import MemoryStore
from tests.conftest import TEST_PEPPER, delete_redis_keys, delete_redis_prefix, redis_prefix

ROUTES = {"/api/one": 1, "/api/two": 2, "/api/three": 3}
COSTS = {f"GET {path}": cost for path, cost in ROUTES.items() if cost > 1}


def _scope(token: str, path: str = "/api/one") -> dict[str, Any]:
    return {
        "type": "http",
        "method": "GET",
        "path": path,
        "headers": [(b"authorization", f"Bearer {token}".encode())],
        "client": ("127.0.0.1", 5000),
    }


async def _admit(gate: Gate, token: str, path: str = "/api/one") -> list[tuple[bytes, bytes]]:
    return await gate.admit(_scope(token, path), path)


def _manager(store: KeyStore) -> KeyManager:
    return KeyManager(store, hasher=Hasher(pepper=TEST_PEPPER), webhooks=False)


# -- the model ---------------------------------------------------------------------------------


class Scenario:
    """Three keys of one identity (one of them maybe a test key), the limits and credits of
    each and of the identity, and requests `(key index, path)`."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.identity_limit = draw(st.integers(1, 8))
        self.identity_daily = draw(st.none() | st.integers(1, 10))
        self.identity_credits = draw(st.none() | st.integers(0, 12))
        self.key_limits = [draw(st.integers(1, 9)) for _ in range(3)]
        self.key_credits = [draw(st.none() | st.integers(0, 8)) for _ in range(3)]
        self.test_key = draw(st.sampled_from([None, 0, 1, 2]))
        self.requests = draw(
            st.lists(
                st.tuples(st.integers(0, 2), st.sampled_from(sorted(ROUTES))),
                min_size=1,
                max_size=30,
            )
        )

    def __repr__(self) -> str:
        return repr(vars(self))

    @property
    def identity_rate_limit(self) -> str:
        text = f"hourly={self.identity_limit}/hour"
        if self.identity_daily is not None:
            text += f", daily={self.identity_daily}/day"
        return text

    def expected(self) -> tuple[list[str], list[int], int | None, list[int | None]]:
        """Each request's outcome (`ok`, `rate_limited`, `credits_exhausted`), and then what
        is left: of each key's limit, of the identity's hourly limit, of each one's credits."""
        key_left = list(self.key_limits)
        hourly, daily = self.identity_limit, self.identity_daily
        credits = list(self.key_credits)
        shared = self.identity_credits
        outcomes = []
        for index, path in self.requests:
            cost = ROUTES[path]
            spends_identity = shared is not None and index != self.test_key
            if key_left[index] < 1 or hourly < 1 or (daily is not None and daily < 1):
                outcomes.append("rate_limited")
                continue
            own = credits[index]
            if (own is not None and own < cost) or (
                spends_identity and shared is not None and shared < cost
            ):
                outcomes.append("credits_exhausted")
                continue
            outcomes.append("ok")
            key_left[index] -= 1
            hourly -= 1
            if daily is not None:
                daily -= 1
            if own is not None:
                credits[index] = own - cost
            if spends_identity and shared is not None:
                shared -= cost
        return outcomes, key_left, shared, credits


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    return Scenario(draw)


async def _play(scenario: Scenario, limiter: RateLimiter, tag: str) -> None:
    store = MemoryStore()
    manager = _manager(store)
    try:
        await manager.create_identity(
            tag,
            workspace="w",
            rate_limit=scenario.identity_rate_limit,
            credits=scenario.identity_credits,
        )
        keys = []
        for index in range(3):
            created = await manager.create(
                name=f"k{index}",
                workspace="w",
                full_access=True,
                identity=tag,
                rate_limit=f"{scenario.key_limits[index]}/hour",
                credits=scenario.key_credits[index],
                environment="test" if index == scenario.test_key else "live",
            )
            keys.append(created)
        gate = Gate(manager, limiter=limiter, costs=COSTS)
        outcomes = []
        for index, path in scenario.requests:
            try:
                await _admit(gate, keys[index].key, path)
                outcomes.append("ok")
            except AuthenticationError as exc:
                outcomes.append(exc.code)
        expected, key_left, shared, credits = scenario.expected()
        assert outcomes == expected, scenario

        # What is left, read without charging: a refused request took nothing anywhere.
        identity = await manager.get_identity(tag)
        assert identity.credits == shared
        for index, created in enumerate(keys):
            assert (await manager.get(created.record.id)).credits == credits[index]
        if limiter.storage.__class__.__name__ == "FixedWindowMemoryStorage":
            for index, created in enumerate(keys):
                decided = await limiter.hit_policies(
                    created.record.id,
                    created.record.rate_limit,
                    identity=tag,
                    identity_policies=scenario.identity_rate_limit,
                    cost=0,
                )
                left = {policy.name: policy.remaining for policy in decided.policies}
                assert left["default"] == key_left[index]
                assert left["identity.hourly"] == scenario.identity_limit - expected.count("ok")
    finally:
        await manager.aclose()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_if_keys_of_an_identity_interleave_then_the_gate_admits_what_the_model_does(
    scenario: Scenario,
) -> None:
    asyncio.run(_play(scenario, RateLimiter("1000/hour"), "acme"))


@pytest.mark.redis
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(scenario=scenarios())
def test_if_keys_of_an_identity_interleave_on_redis_then_the_gate_admits_what_the_model_does(
    redis_url: str, scenario: Scenario
) -> None:
    prefix = redis_prefix("path")

    async def run() -> None:
        limiter = RateLimiter("1000/hour", redis_url, key_prefix=prefix)
        try:
            await _play(scenario, limiter, "acme")
        finally:
            await limiter.aclose()
            await delete_redis_keys(redis_url, f"*{prefix}*")

    asyncio.run(run())


# -- validity ----------------------------------------------------------------------------------


async def test_if_the_identity_is_disabled_then_verify_refuses_its_keys_until_enabled() -> None:
    async with _manager(MemoryStore()) as manager:
        await manager.create_identity("acme", workspace="w")
        created = await manager.create(name="k", workspace="w", full_access=True, identity="acme")
        other = await manager.create(name="o", workspace="w", full_access=True)
        await manager.verify(created.key)

        await manager.disable_identity("acme")
        with pytest.raises(KeyDisabled, match="identity is disabled"):
            await manager.verify(created.key)
        assert manager.verify_now(other.key) is not None  # a key of no identity: untouched

        await manager.enable_identity("acme")
        assert (await manager.verify(created.key)).id == created.record.id

        await manager.revoke(created.record.id)  # revoked on its own: stays revoked
        await manager.disable_identity("acme")
        await manager.enable_identity("acme")
        with pytest.raises(KeyRevoked):
            await manager.verify(created.key)


async def test_if_the_identity_is_gone_then_its_keys_are_refused_as_revoked() -> None:
    store = MemoryStore()
    async with _manager(store) as manager:
        await manager.create_identity("acme", workspace="w")
        created = await manager.create(name="k", workspace="w", full_access=True, identity="acme")
        store.identities()._identities.clear()  # a row deleted by hand
        with pytest.raises(KeyRevoked, match="identity no longer exists"):
            await manager.verify(created.key)
        gate = Gate(manager)
        with pytest.raises(KeyRevoked):
            await _admit(gate, created.key)


@pytest.fixture
async def second_store(store_url: str, store_options: dict[str, str]) -> AsyncIterator[KeyStore]:
    """Another store object on the data of `store` (the same object for memory://)."""
    made = store_from_url(store_url, **store_options)
    await made.setup()
    yield made
    await made.aclose()


async def test_if_an_identity_is_disabled_revoked_or_enabled_then_the_next_request_sees_it(
    store: KeyStore, second_store: KeyStore, store_url: str
) -> None:
    writer = _manager(store)
    # A caching reader in "another process": its own manager and store on the same data.
    reader = _manager(store if store_url == "memory://" else second_store)
    try:
        await writer.create_identity("acme", workspace="w", rate_limit="1000/hour")
        first = await writer.create(name="a", workspace="w", full_access=True, identity="acme")
        second = await writer.create(name="b", workspace="w", full_access=True, identity="acme")
        gate = Gate(reader, limiter=RateLimiter("1000/hour"))
        for _ in range(3):  # held by the reader's cache now, where it has one
            await _admit(gate, first.key)
            await _admit(gate, second.key)

        await writer.disable_identity("acme")
        for token in (first.key, second.key):
            with pytest.raises(KeyDisabled):
                await _admit(gate, token)

        await writer.enable_identity("acme")
        await _admit(gate, first.key)
        await _admit(gate, second.key)

        await writer.revoke_identity("acme")
        for token in (first.key, second.key):
            with pytest.raises(KeyRevoked):
                await _admit(gate, token)
            with pytest.raises(KeyRevoked):
                await reader.verify(token)
    finally:
        await reader.aclose()
        await writer.aclose()


# -- headers -----------------------------------------------------------------------------------


async def test_a_key_of_an_identity_shows_both_policy_sets_and_the_longest_wait() -> None:
    async with _manager(MemoryStore()) as manager:
        await manager.create_identity(
            "acme", workspace="w", rate_limit="burst=2/minute, daily=100/day"
        )
        created = await manager.create(
            name="k", workspace="w", full_access=True, identity="acme", rate_limit="2/hour"
        )
        gate = Gate(manager, limiter=RateLimiter("1000/hour"))
        headers = dict(await _admit(gate, created.key))
        assert headers[b"ratelimit-policy"] == (
            b'"default";q=2;w=3600, "identity.burst";q=2;w=60, "identity.daily";q=100;w=86400'
        )
        assert headers[b"ratelimit"].startswith(b'"default";r=1;t=')
        assert b'"identity.burst";r=1;t=' in headers[b"ratelimit"]
        await _admit(gate, created.key)
        with pytest.raises(RateLimited) as refused:
            await _admit(gate, created.key)
        assert refused.value.violated_policies == ("default", "identity.burst")
        # The key's hour outlasts the identity's minute: the longest wait is the answer.
        assert refused.value.retry_after > 60


async def test_identity_credits_show_as_identity_credits_and_refuse_with_its_refill() -> None:
    async with _manager(MemoryStore()) as manager:
        await manager.create_identity("acme", workspace="w", credit_refill="2/day")
        created = await manager.create(
            name="k", workspace="w", full_access=True, identity="acme", credits=10
        )
        gate = Gate(manager)
        headers = dict(await _admit(gate, created.key))
        value = headers[b"ratelimit"]
        assert b'"credits";r=9' in value
        assert b'"identity.credits";r=1;t=' in value
        assert b'"identity.credits";q=2;w=86400' in headers[b"ratelimit-policy"]
        await _admit(gate, created.key)
        with pytest.raises(CreditsExhausted) as refused:
            await _admit(gate, created.key)
        assert refused.value.retry_after is not None
        assert 0 < refused.value.retry_after <= 86400
        # Refused: the key's own credits were not taken either.
        assert (await manager.get(created.record.id)).credits == 8


async def test_a_test_key_never_spends_its_identitys_credits() -> None:
    async with _manager(MemoryStore()) as manager:
        await manager.create_identity("acme", workspace="w", credits=1)
        live = await manager.create(name="l", workspace="w", full_access=True, identity="acme")
        test = await manager.create(
            name="t", workspace="w", full_access=True, identity="acme", environment="test"
        )
        gate = Gate(manager)
        for _ in range(3):
            headers = dict(await _admit(gate, test.key))
            assert b"credits" not in headers[b"ratelimit"]
        await _admit(gate, live.key)
        with pytest.raises(CreditsExhausted):
            await _admit(gate, live.key)
        await _admit(gate, test.key)
        assert (await manager.get_identity("acme")).credits == 0


# -- credits on every store --------------------------------------------------------------------


async def _spend_exactly(manager: KeyManager) -> None:
    """Two keys of one identity with 5 credits, one key with 2 of its own: costs of 2 are
    admitted while both sides have them; a refusal takes nothing from either."""
    identity = await manager.create_identity("acme", workspace="w", credits=5)
    own = await manager.create(
        name="own", workspace="w", full_access=True, identity="acme", credits=2
    )
    free = await manager.create(name="free", workspace="w", full_access=True, identity="acme")
    spend = manager.spend_request_credits
    assert identity.credits == 5
    first = await spend(own.record, identity, 2)
    assert (first.identity_left, first.key_left, first.refused) == (3, 0, None)
    refused = await spend(own.record, identity, 2)
    assert refused.refused == "key"  # the key has none left: the identity keeps its 3
    admitted = await spend(free.record, identity, 2)
    assert (admitted.identity_left, admitted.key_left) == (1, None)
    refused = await spend(free.record, identity, 2)
    assert refused.refused == "identity"
    assert (await manager.get_identity("acme")).credits == 1
    assert (await manager.get(own.record.id)).credits == 0


async def test_identity_and_key_credits_are_spent_exactly_on_every_store(
    manager: KeyManager,
) -> None:
    await _spend_exactly(manager)


async def test_a_rolled_key_of_an_identity_spends_its_pairs_balance_on_every_store(
    manager: KeyManager,
) -> None:
    await _spend_rolled(manager)


async def _spend_rolled(manager: KeyManager) -> None:
    """A rolled key of an identity spends its successor's balance with the identity's."""
    identity = await manager.create_identity("acme-rolled", workspace="w", credits=10)
    old = await manager.create(
        name="k", workspace="w", full_access=True, identity="acme-rolled", credits=4
    )
    new = await manager.roll(old.record.id)
    assert new.record.identity == "acme-rolled"
    spent = await manager.spend_request_credits(old.record, identity, 3)
    assert (spent.identity_left, spent.key_left) == (7, 1)  # the successor's balance
    refused = await manager.spend_request_credits(new.record, identity, 2)
    assert refused.refused == "key"
    assert (await manager.get_identity("acme-rolled")).credits == 7
    assert (await manager.get(new.record.id)).credits == 1


async def test_concurrent_spends_of_one_identity_never_overspend_on_every_store(
    manager: KeyManager,
) -> None:
    identity = await manager.create_identity("acme", workspace="w", credits=7)
    keys = [
        await manager.create(name=f"k{n}", workspace="w", full_access=True, identity="acme")
        for n in range(3)
    ]
    spent = await asyncio.gather(
        *(manager.spend_request_credits(keys[n % 3].record, identity, 1) for n in range(12))
    )
    assert sum(1 for one in spent if one.refused is None) == 7
    assert (await manager.get_identity("acme")).credits == 0


@pytest.mark.redis
async def test_on_a_cluster_a_key_refusal_gives_the_identity_its_credits_back(
    request: pytest.FixtureRequest,
) -> None:
    url = request.getfixturevalue("redis_cluster").url
    prefix = redis_prefix("split")
    store = store_from_url(url, key_prefix=f"{prefix}:")
    await store.setup()
    manager = _manager(store)
    try:
        await _spend_exactly(manager)
        await _spend_rolled(manager)
    finally:
        await manager.aclose()
        await delete_redis_prefix(url, f"{prefix}:")


# -- the key cache's identity entries ----------------------------------------------------------


async def _proven(cache: Any, channel: Any) -> None:
    cache._serving = True
    round_ = asyncio.ensure_future(cache.refresh())
    await asyncio.sleep(0)
    channel.deliver(1)
    await round_


async def test_an_identity_is_cached_as_i_id_and_dropped_by_its_notice() -> None:
    from apikeys.cache import KeyCache
    from tests.test_cache import Bus, BusChannel, FakeClock

    store = MemoryStore()
    async with _manager(store) as manager:
        await manager.create_identity("acme", workspace="w")
    clock = FakeClock()
    channel = BusChannel(Bus(clock))
    cache = KeyCache(store, channel, clock=clock, autostart=False)
    await cache.connect()
    assert (await cache.load_identity("acme")) is not None
    assert await cache.load_identity("gone") is None
    assert cache.hit_identity("acme") is None  # not proven fresh yet
    await _proven(cache, channel)
    held = cache.hit_identity("acme")
    assert held is not None
    assert held.id == "acme"
    assert cache.missing_identity("gone")
    assert cache.hit("i:acme") is not None  # one cache: the entry is named i:<id>
    cache.on_notice("writer:1:i:acme")
    assert cache.hit_identity("acme") is None
    cache.on_notice("writer:2:i:gone")
    assert not cache.missing_identity("gone")
    await cache.aclose()


async def test_if_an_identity_read_races_with_its_notice_then_it_is_not_kept() -> None:
    from apikeys.cache import KeyCache
    from tests.test_cache import Bus, BusChannel, FakeClock

    store = MemoryStore()
    async with _manager(store) as manager:
        await manager.create_identity("acme", workspace="w")
    clock = FakeClock()
    channel = BusChannel(Bus(clock))
    cache = KeyCache(store, channel, clock=clock, autostart=False)
    await cache.connect()
    reading = asyncio.Event()
    identities = store.identities()
    original = identities.get_to_cache

    async def slow(identity_id: str) -> Any:
        found = await original(identity_id)
        await reading.wait()
        return found

    identities.get_to_cache = slow  # type: ignore[method-assign]
    load = asyncio.ensure_future(cache.load_identity("acme"))
    await asyncio.sleep(0)
    cache.on_notice("writer:1:i:acme")
    reading.set()
    assert await load is not None  # answered
    await _proven(cache, channel)
    assert cache.hit_identity("acme") is None  # but not kept
    await cache.aclose()


async def _write_state_by_hand(store: KeyStore, identity_id: str, state: str) -> None:
    """Set an identity's state as another program would: a plain SQL UPDATE of its row, or
    an HSET of its Redis hash (no apikeys change, no notice but what the store's own log
    or Redis' tracking makes of it)."""
    import sqlalchemy as sa

    identities: Any = store.identities()
    if hasattr(identities, "hash_name"):
        await store.client.hset(identities.hash_name(identity_id), "state", state)  # type: ignore[attr-defined]
        return
    table = identities._table

    async def work(conn: Any) -> None:
        await conn.execute(sa.update(table).where(table.c.id == identity_id).values(state=state))

    await identities._run(work)


async def _refused_within(gate: Gate, token: str, seconds: float) -> None:
    """Poll until `token` is refused (a writer that is not apikeys waits for no reader: its
    change is seen within a lease), then check it stays refused."""
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        try:
            await _admit(gate, token)
        except KeyDisabled:
            break
        assert asyncio.get_running_loop().time() < deadline, "still admitted"
        await asyncio.sleep(0.02)
    for _ in range(5):
        with pytest.raises(KeyDisabled):
            await _admit(gate, token)


@pytest.mark.parametrize("store_kind", ["sqlite", "postgres", "redis"], indirect=True)
async def test_if_an_identity_row_or_hash_is_disabled_by_hand_then_caching_readers_refuse(
    store: KeyStore, second_store: KeyStore
) -> None:
    writer = _manager(store)
    reader = _manager(second_store)
    try:
        await writer.create_identity("acme", workspace="w")
        created = await writer.create(name="a", workspace="w", full_access=True, identity="acme")
        gate = Gate(reader, limiter=RateLimiter("1000/hour"))
        for _ in range(3):
            await _admit(gate, created.key)
        await _write_state_by_hand(store, "acme", "disabled")
        await _refused_within(gate, created.key, 3 * reader.cache.lease)  # type: ignore[union-attr]
    finally:
        await reader.aclose()
        await writer.aclose()


async def test_the_helpers_for_code_of_its_own_charge_a_key_with_its_identity() -> None:
    from apikeys.errors import ConfigurationError, CreditsExhausted
    from apikeys.gate import check_rate_limits, spend_credit

    async with _manager(MemoryStore()) as manager:
        await manager.create_identity("cust", workspace="default", rate_limit="2/minute", credits=3)
        created = await manager.create(name="k", scopes=["a:b"], identity="cust")
        record = await manager.verify(created.key)
        limiter = manager.limiter
        # Without its identity's record, the key would be charged alone: refused plainly.
        with pytest.raises(ConfigurationError, match="identity"):
            await check_rate_limits(limiter, record)
        identity = await manager.usable_identity("cust")
        headers, refusal = await check_rate_limits(limiter, record, identity=identity)
        assert refusal is None
        assert any(b'"identity.default";r=1' in value for _, value in headers)
        headers = await spend_credit(manager, limiter, record, headers)  # reads the identity
        assert any(b'"identity.credits";r=2' in value for _, value in headers)
        _, refusal = await check_rate_limits(limiter, record, identity=identity)
        _, refused = await check_rate_limits(limiter, record, identity=identity)
        assert refusal is None
        assert refused is not None
        assert tuple(refused.violated_policies) == ("identity.default",)
        await manager.update_identity("cust", credits=0)
        with pytest.raises(CreditsExhausted):
            await spend_credit(manager, limiter, record, [])
