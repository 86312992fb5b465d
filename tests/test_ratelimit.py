"""Per-key rate limiting (CONTRACT §4): notation, counting, windows, Redis, failures."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from apikeys.errors import ConfigurationError, InvalidKeyParameters, LimiterUnavailable
from apikeys.ratelimit import (
    DEFAULT_RATE_LIMIT,
    RATE_LIMIT_ENV,
    FixedWindowMemoryStorage,
    RateLimiter,
    parse_rate_limit,
)


@pytest.fixture(autouse=True)
def _no_rate_limit_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RATE_LIMIT_ENV, raising=False)


@pytest.fixture
async def limiter() -> AsyncIterator[RateLimiter]:
    memory = RateLimiter("5/minute")
    try:
        yield memory
    finally:
        await memory.aclose()


# -- notation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "amount", "seconds"),
    [
        ("100/minute", 100, 60),
        ("3 per 2 seconds", 3, 2),
        ("10/second", 10, 1),
        ("1/hour", 1, 3600),
        ("5 per minute", 5, 60),
        ("1000/day", 1000, 86400),
    ],
)
def test_if_limit_in_limits_notation_then_parsed(text: str, amount: int, seconds: int) -> None:
    item = parse_rate_limit(text)
    assert item.amount == amount
    assert item.get_expiry() == seconds


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("garbage", id="garbage"),
        pytest.param("0/minute", id="zero"),
        pytest.param("-1/minute", id="negative"),
        pytest.param("", id="empty"),
        pytest.param("   ", id="blank"),
        pytest.param("100", id="no-period"),
        pytest.param("/minute", id="no-amount"),
        pytest.param("100/fortnight", id="unknown-period"),
        pytest.param("ten/minute", id="word-amount"),
        pytest.param(None, id="none"),
    ],
)
def test_if_limit_malformed_then_invalid_key_parameters(text: str) -> None:
    with pytest.raises(InvalidKeyParameters):
        parse_rate_limit(text)


def test_if_default_limit_malformed_then_limiter_refuses_it() -> None:
    with pytest.raises(InvalidKeyParameters):
        RateLimiter("0/minute")


def test_if_env_sets_malformed_default_then_limiter_refuses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(RATE_LIMIT_ENV, "lots")
    with pytest.raises(InvalidKeyParameters):
        RateLimiter()


# -- counting on memory -------------------------------------------------------------------


async def test_if_n_plus_k_hits_then_exactly_n_admitted(limiter: RateLimiter) -> None:
    decisions = [await limiter.hit("key-a") for _ in range(8)]
    assert [decision.allowed for decision in decisions] == [True] * 5 + [False] * 3


async def test_if_hits_counted_then_remaining_counts_down_to_zero(limiter: RateLimiter) -> None:
    decisions = [await limiter.hit("key-a") for _ in range(8)]
    assert [decision.remaining for decision in decisions] == [4, 3, 2, 1, 0, 0, 0, 0]
    for decision in decisions:
        assert decision.limit == 5
        assert decision.window == 60


async def test_if_hits_counted_then_reset_after_is_between_one_second_and_the_window(
    limiter: RateLimiter,
) -> None:
    decisions = [await limiter.hit("key-a") for _ in range(8)]
    for decision in decisions:
        assert isinstance(decision.reset_after, int)
        assert 1 <= decision.reset_after <= 60


async def test_if_window_passes_then_a_refused_key_is_admitted_again() -> None:
    # The Retry-After promise: a request sent reset_after seconds later is admitted.
    limiter = RateLimiter("2 per 1 second")
    try:
        assert (await limiter.hit("key-a")).allowed
        assert (await limiter.hit("key-a")).allowed
        refused = await limiter.hit("key-a")
        assert not refused.allowed
        assert 1 <= refused.reset_after <= 1
        await asyncio.sleep(refused.reset_after + 0.1)
        again = await limiter.hit("key-a")
        assert again.allowed
        assert again.remaining == 1
    finally:
        await limiter.aclose()


async def test_if_key_has_own_limit_then_it_is_counted_apart_from_the_default(
    limiter: RateLimiter,
) -> None:
    own = [await limiter.hit("key-a", "2/minute") for _ in range(3)]
    assert [decision.allowed for decision in own] == [True, True, False]
    assert own[0].limit == 2
    default = await limiter.hit("key-a")
    assert default.allowed
    assert default.limit == 5
    assert default.remaining == 4


async def test_if_key_has_own_limit_then_it_can_be_higher_than_the_default(
    limiter: RateLimiter,
) -> None:
    decisions = [await limiter.hit("key-a", "10/minute") for _ in range(10)]
    assert all(decision.allowed for decision in decisions)
    assert not (await limiter.hit("key-a", "10/minute")).allowed


async def test_if_keys_differ_then_counters_are_independent(limiter: RateLimiter) -> None:
    for _ in range(6):
        await limiter.hit("key-a")
    assert not (await limiter.hit("key-a")).allowed
    other = await limiter.hit("key-b")
    assert other.allowed
    assert other.remaining == 4


async def test_if_limiters_are_separate_memory_instances_then_counts_are_separate() -> None:
    first, second = RateLimiter("1/minute"), RateLimiter("1/minute")
    try:
        assert (await first.hit("key-a")).allowed
        assert (await second.hit("key-a")).allowed
        assert not (await first.hit("key-a")).allowed
    finally:
        await first.aclose()
        await second.aclose()


async def test_if_concurrent_hits_on_memory_then_never_more_than_the_limit() -> None:
    limiter = RateLimiter("10/minute")
    try:
        decisions = await asyncio.gather(*(limiter.hit("key-a") for _ in range(30)))
        assert sum(decision.allowed for decision in decisions) == 10
    finally:
        await limiter.aclose()


async def test_if_reset_then_counters_start_over(limiter: RateLimiter) -> None:
    for _ in range(5):
        await limiter.hit("key-a")
    await limiter.reset()
    assert (await limiter.hit("key-a")).remaining == 4


# -- configuration ------------------------------------------------------------------------


async def test_if_env_sets_default_then_limiter_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RATE_LIMIT_ENV, "3/hour")
    limiter = RateLimiter()
    try:
        assert limiter.default == "3/hour"
        decision = await limiter.hit("key-a")
        assert decision.limit == 3
        assert decision.window == 3600
    finally:
        await limiter.aclose()


def test_if_env_unset_then_default_is_100_per_minute() -> None:
    assert RateLimiter().default == DEFAULT_RATE_LIMIT == "100/minute"


def test_if_default_passed_then_it_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RATE_LIMIT_ENV, "3/hour")
    assert RateLimiter("7/second").default == "7/second"


@pytest.mark.parametrize(
    "url",
    [
        "mongodb://localhost:27017",
        "memcached://localhost:11211",
        "nosuch://x",
        "http://localhost",
        "",
        "redis",
        "async+nosuch://x",
    ],
)
def test_if_limiter_url_scheme_unknown_then_configuration_error(url: str) -> None:
    with pytest.raises(ConfigurationError):
        RateLimiter(storage_url=url)


def test_if_limiter_printed_then_no_url_credentials_shown() -> None:
    limiter = RateLimiter("5/minute", "redis://user:s3cret-password@127.0.0.1:1/0")
    assert "s3cret-password" not in repr(limiter)


# -- the memory storage sweeps expired counters -------------------------------------------


async def test_if_counters_expired_then_memory_storage_sweeps_them() -> None:
    storage = FixedWindowMemoryStorage(sweep_interval=0.01)
    await storage.incr("short-lived", 0.01)
    await storage.incr("long-lived", 3600)
    await asyncio.sleep(0.2)
    # A counter starting a new window triggers the sweep once the interval has passed.
    assert await storage.incr("trigger", 3600) == 1
    assert "short-lived" not in storage.storage
    assert "short-lived" not in storage.expirations
    assert storage.storage["long-lived"] == 1
    assert "long-lived" in storage.expirations


async def test_if_sweep_interval_not_passed_then_nothing_is_swept() -> None:
    storage = FixedWindowMemoryStorage(sweep_interval=3600)
    await storage.incr("short-lived", 0.01)
    await asyncio.sleep(0.05)
    await storage.incr("trigger", 3600)
    assert "short-lived" in storage.expirations  # kept until the next sweep ...
    assert await storage.incr("short-lived", 60) == 1  # ... but its window is over


async def test_if_memory_storage_window_open_then_counts_accumulate() -> None:
    storage = FixedWindowMemoryStorage()
    assert [await storage.incr("k", 60) for _ in range(3)] == [1, 2, 3]
    assert await storage.incr("k", 60, amount=5) == 8


# -- Redis: one limit across processes ----------------------------------------------------


async def _delete_keys(redis_url: str, pattern: str) -> None:
    from redis.asyncio import Redis

    client = Redis.from_url(redis_url)
    try:
        keys = [key async for key in client.scan_iter(match=pattern)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.fixture
async def redis_prefix(redis_url: str) -> AsyncIterator[str]:
    prefix = f"apikeys-ratelimit-test-{uuid.uuid4().hex[:12]}"
    try:
        yield prefix
    finally:
        await _delete_keys(redis_url, f"*{prefix}*")


@pytest.mark.redis
async def test_if_two_limiters_share_redis_then_exactly_n_admitted_in_total(
    redis_url: str, redis_prefix: str
) -> None:
    limit = 5
    first = RateLimiter(f"{limit}/minute", redis_url, key_prefix=redis_prefix)
    second = RateLimiter(f"{limit}/minute", redis_url, key_prefix=redis_prefix)
    try:
        hits = [(first if index % 2 else second).hit("key-a") for index in range(3 * limit)]
        decisions = await asyncio.gather(*hits)
        admitted = [decision for decision in decisions if decision.allowed]
        assert len(admitted) == limit
        assert sorted(decision.remaining for decision in admitted) == list(range(limit))
        for decision in decisions:
            assert decision.limit == limit
            # Redis reports whole seconds: Retry-After may round up by one, never down.
            assert 1 <= decision.reset_after <= 60 + 1
    finally:
        await first.aclose()
        await second.aclose()


@pytest.mark.redis
async def test_if_limiters_share_redis_then_a_per_key_limit_holds_across_them(
    redis_url: str, redis_prefix: str
) -> None:
    first = RateLimiter("100/minute", redis_url, key_prefix=redis_prefix)
    second = RateLimiter("100/minute", redis_url, key_prefix=redis_prefix)
    try:
        hits = [(first, second)[index % 2].hit("key-a", "3/minute") for index in range(9)]
        decisions = await asyncio.gather(*hits)
        assert sum(decision.allowed for decision in decisions) == 3
        # The default-limit counter of the same key is untouched.
        assert (await first.hit("key-a")).remaining == 99
        # Another key is counted apart.
        assert (await second.hit("key-b", "3/minute")).allowed
    finally:
        await first.aclose()
        await second.aclose()


@pytest.mark.redis
async def test_if_key_prefixes_differ_then_redis_counters_are_separate(
    redis_url: str, redis_prefix: str
) -> None:
    first = RateLimiter("1/minute", redis_url, key_prefix=f"{redis_prefix}-one")
    second = RateLimiter("1/minute", redis_url, key_prefix=f"{redis_prefix}-two")
    try:
        assert (await first.hit("key-a")).allowed
        assert (await second.hit("key-a")).allowed
        assert not (await first.hit("key-a")).allowed
    finally:
        await first.aclose()
        await second.aclose()


async def test_if_redis_unreachable_then_limiter_unavailable() -> None:
    pytest.importorskip("redis")
    limiter = RateLimiter("5/minute", "redis://127.0.0.1:1/0", key_prefix="unreachable")
    try:
        async with asyncio.timeout(15):  # a hang fails the test instead of the suite
            with pytest.raises(LimiterUnavailable) as caught:
                await limiter.hit("key-a")
        assert caught.value.status == 503
        assert caught.value.code == "auth_unavailable"
        assert caught.value.original is not None
    finally:
        await limiter.aclose()


@pytest.mark.parametrize(
    "limit", ["1 per 100000000000 years", "1 per 2 years", "10000000000000/second"]
)
def test_if_rate_limit_beyond_what_storages_hold_then_refused(limit: str) -> None:
    with pytest.raises(InvalidKeyParameters, match="at most a year"):
        parse_rate_limit(limit)


@pytest.mark.redis
async def test_if_shared_limit_exhausted_then_a_hit_after_retry_after_is_admitted(
    redis_url: str, redis_prefix: str
) -> None:
    # Contract §4: a request sent after Retry-After seconds is admitted, on Redis as well.
    first = RateLimiter("2/second", redis_url, key_prefix=redis_prefix)
    second = RateLimiter("2/second", redis_url, key_prefix=redis_prefix)
    try:
        assert (await first.hit("key")).allowed
        assert (await second.hit("key")).allowed
        refused = await second.hit("key")
        assert not refused.allowed
        assert refused.reset_after >= 1
        await asyncio.sleep(refused.reset_after)
        assert (await first.hit("key")).allowed
    finally:
        await first.aclose()
        await second.aclose()
