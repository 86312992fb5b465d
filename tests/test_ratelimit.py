"""Per-key rate limiting (CONTRACT §4): notation, counting, windows, Redis, failures, and
several named policies per key, checked and charged all or nothing."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from limits.aio import storage as limits_storage

from apikeys.errors import ConfigurationError, InvalidKeyParameters, LimiterUnavailable
from apikeys.ratelimit import (
    DEFAULT_RATE_LIMIT,
    LEASE_THRESHOLD,
    RATE_LIMIT_ENV,
    FixedWindowMemoryStorage,
    Plan,
    Policy,
    PolicyDecision,
    RateLimiter,
    format_policies,
    parse_policies,
    parse_rate_limit,
)
from apikeys.ratelimit.decisions import decision as decision_of
from tests import services
from tests.conftest import redis_prefix as tagged_prefix


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


async def test_if_key_limit_changes_amount_then_its_window_keeps_counting(
    limiter: RateLimiter,
) -> None:
    # The counter is the window's (a minute), not the amount's: the 2 admitted under the
    # key's own 2/minute count against the default 5/minute of the same window.
    own = [await limiter.hit("key-a", "2/minute") for _ in range(3)]
    assert [decision.allowed for decision in own] == [True, True, False]
    assert own[0].limit == 2
    default = await limiter.hit("key-a")
    assert default.allowed
    assert default.limit == 5
    assert default.remaining == 2


async def test_if_key_limit_changes_window_then_it_is_counted_apart(
    limiter: RateLimiter,
) -> None:
    own = [await limiter.hit("key-a", "2/hour") for _ in range(3)]
    assert [decision.allowed for decision in own] == [True, True, False]
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


@pytest.mark.parametrize(
    "url", ["redis://:s3cret@127.0.0.1:6379/13", "rediss://cache.internal:6380/0"]
)
def test_if_redis_is_not_installed_then_the_redis_limiter_names_the_pip_line(url: str) -> None:
    # The redis extra missing, as in a fresh `pip install apikeys`: the error says what
    # to install, not which limits storage classes exist.
    code = (
        "import sys; sys.modules['redis'] = None\n"
        "from apikeys import RateLimiter\n"
        f"RateLimiter(storage_url={url!r})\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("apikeys.errors.ConfigurationError: ")
    assert "pip install 'apikeys[redis]'" in last
    assert "async+" not in last
    assert "s3cret" not in result.stderr


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
    prefix = tagged_prefix("ratelimit")
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
        # The default limit has the same window: it counts the 3 admitted (and this one).
        assert (await first.hit("key-a")).remaining == 96
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


# -- several named policies: notation ------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("100/minute", [("default", 100, 60, "100/minute")]),
        ("daily=1000/day", [("daily", 1000, 86400, "1000/day")]),
        (
            "burst=10/second, daily=10000/day",
            [("burst", 10, 1, "10/second"), ("daily", 10000, 86400, "10000/day")],
        ),
        (
            " burst = 3 per 2 seconds ;hourly=50/hour,daily=1000/day ",
            [
                ("burst", 3, 2, "3 per 2 seconds"),
                ("hourly", 50, 3600, "50/hour"),
                ("daily", 1000, 86400, "1000/day"),
            ],
        ),
        ("a-1=1/second, b_2=1/second", [("a-1", 1, 1, "1/second"), ("b_2", 1, 1, "1/second")]),
        ("default=5/minute", [("default", 5, 60, "5/minute")]),
        (
            ",".join(f"p{n}=1/second" for n in range(8)),
            [(f"p{n}", 1, 1, "1/second") for n in range(8)],
        ),
        (f"{'x' * 32}=1/second", [("x" * 32, 1, 1, "1/second")]),
    ],
)
def test_if_policies_well_written_then_parsed_in_order(
    text: str, expected: list[tuple[str, int, int, str]]
) -> None:
    policies = parse_policies(text)
    assert [(p.name, p.item.amount, p.item.get_expiry(), p.text) for p in policies] == expected
    assert all(isinstance(policy, Policy) for policy in policies)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        pytest.param("", "no limit", id="empty"),
        pytest.param("burst=10/second, burst=1/day", "used twice", id="duplicate"),
        pytest.param("10/second, 5/day", "has no name", id="unnamed-among-several"),
        pytest.param("burst=10/second, 5/day", "has no name", id="one-unnamed"),
        pytest.param("Burst=1/second", "not a policy name", id="upper-case"),
        pytest.param("1burst=1/second", "not a policy name", id="digit-first"),
        pytest.param(f"{'x' * 33}=1/second", "not a policy name", id="name-too-long"),
        pytest.param("bürst=1/second", "not a policy name", id="non-ascii"),
        pytest.param("=1/second", "not a policy name", id="no-name"),
        pytest.param("a=1/second,", "empty item", id="trailing-comma"),
        pytest.param("a=1/second;;b=1/day", "empty item", id="empty-item"),
        pytest.param("a=lots", "not one limit", id="bad-limit"),
        pytest.param("a=0/second", "not one limit", id="zero"),
        pytest.param("a=1 per 2 years", "at most a year", id="long-window"),
        pytest.param("a=1/second|2/minute", "not one limit", id="two-limits-in-one"),
        pytest.param("a=b=1/second", "not one limit", id="two-equals"),
        pytest.param(",".join(f"p{n}=1/second" for n in range(9)), "at most 8", id="nine"),
    ],
)
def test_if_policies_badly_written_then_one_line_error_quoting_the_input(
    text: str, reason: str
) -> None:
    with pytest.raises(InvalidKeyParameters, match="invalid rate limit") as caught:
        parse_policies(text)
    message = str(caught.value)
    assert reason in message
    assert repr(text) in message
    assert "\n" not in message


@pytest.mark.parametrize("text", ["burst=10/second", "a=1/second, b=1/day", "1/second;1/day"])
def test_if_named_or_several_limits_then_parse_rate_limit_still_refuses(text: str) -> None:
    # parse_rate_limit keeps reading one bare limit, as its callers expect.
    with pytest.raises(InvalidKeyParameters):
        parse_rate_limit(text)


@pytest.mark.parametrize(
    ("given", "text"),
    [
        ({"burst": "10/second", "daily": "10000/day"}, "burst=10/second, daily=10000/day"),
        ({"default": "100/minute"}, "100/minute"),
        ({"daily": " 1000/day "}, "daily=1000/day"),
        ({"default": "5/second", "daily": "9/day"}, "default=5/second, daily=9/day"),
        ("burst=10/second;daily=10000/day", "burst=10/second, daily=10000/day"),
        ("  100/minute ", "100/minute"),
    ],
)
def test_if_policies_formatted_then_canonical_text_that_parses_back(
    given: str | dict[str, str], text: str
) -> None:
    assert format_policies(given) == text
    assert format_policies(parse_policies(text)) == text
    names = list(given) if isinstance(given, dict) else [p.name for p in parse_policies(given)]
    assert [policy.name for policy in parse_policies(text)] == names


@pytest.mark.parametrize(
    "given",
    [
        pytest.param({}, id="empty"),
        pytest.param({"a": "1/second, b=2/second"}, id="smuggled-policy"),
        pytest.param({"a": "1/second; 2/day"}, id="two-limits"),
        pytest.param({"a": "b=1/second"}, id="name-in-limit"),
        pytest.param({"A": "1/second"}, id="bad-name"),
        pytest.param({"a": 10}, id="not-text"),
        pytest.param({f"p{n}": "1/second" for n in range(9)}, id="nine"),
        pytest.param(["1/second"], id="not-policies"),
    ],
)
def test_if_policies_to_format_are_invalid_then_invalid_key_parameters(given: Any) -> None:
    with pytest.raises(InvalidKeyParameters):
        format_policies(given)


def test_if_default_has_several_policies_then_limiter_takes_text_or_mapping() -> None:
    assert RateLimiter("burst=1/second, daily=9/day").default == "burst=1/second, daily=9/day"
    mapped = RateLimiter({"burst": "1/second", "daily": "9/day"})
    assert mapped.default == "burst=1/second, daily=9/day"
    assert [policy.name for policy in mapped.policies()] == ["burst", "daily"]
    assert [policy.name for policy in mapped.policies("5/minute")] == ["default"]
    with pytest.raises(InvalidKeyParameters):
        RateLimiter("burst=1/second, burst=9/day")


async def test_if_hit_is_asked_for_several_policies_then_it_points_to_hit_policies(
    limiter: RateLimiter,
) -> None:
    with pytest.raises(InvalidKeyParameters, match="hit_policies"):
        await limiter.hit("key-a", "burst=1/second, daily=9/day")


# -- several named policies: counting on memory and Redis ----------------------------------


LimiterFactory = Callable[..., RateLimiter]


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def make_limiter(
    request: pytest.FixtureRequest,
) -> AsyncIterator[LimiterFactory]:
    """Limiters on one shared storage: a memory storage, or a Redis database."""
    made: list[RateLimiter] = []
    prefix = tagged_prefix("policies")
    shared = FixedWindowMemoryStorage()
    url = request.getfixturevalue("redis_url") if request.param == "redis" else "memory://"

    def make(default: str | dict[str, str] = "100/minute") -> RateLimiter:
        if request.param == "memory":
            limiter = RateLimiter(default, storage=shared, key_prefix=prefix)
        else:
            limiter = RateLimiter(default, url, key_prefix=prefix)
        made.append(limiter)
        return limiter

    try:
        yield make
    finally:
        for limiter in made:
            await limiter.aclose()
        if request.param == "redis":
            await _delete_keys(url, f"*{prefix}*")


def remaining(decision: PolicyDecision) -> dict[str, int]:
    return {status.name: status.remaining for status in decision.policies}


async def test_if_one_policy_is_used_up_then_refused_and_charged_to_none(
    make_limiter: LimiterFactory,
) -> None:
    limiter = make_limiter("burst=3/minute, daily=5/hour")
    decisions = [await limiter.hit_policies("key-a") for _ in range(3)]
    assert [decision.allowed for decision in decisions] == [True] * 3
    assert [remaining(decision) for decision in decisions] == [
        {"burst": 2, "daily": 4},
        {"burst": 1, "daily": 3},
        {"burst": 0, "daily": 2},
    ]
    for _ in range(4):
        refused = await limiter.hit_policies("key-a")
        assert not refused.allowed
        assert refused.violated == ("burst",)
        # The refusal charged neither the policy that refused it nor the other one.
        assert remaining(refused) == {"burst": 0, "daily": 2}
        burst, daily = refused.policies
        assert (burst.allowed, daily.allowed) == (False, True)
        assert (burst.limit, burst.window, daily.limit, daily.window) == (3, 60, 5, 3600)
        assert refused.retry_after == burst.reset_after
        assert 1 <= burst.reset_after <= 60 + 1
        assert 60 < daily.reset_after <= 3600 + 1


async def test_if_several_policies_are_used_up_then_all_named_and_retry_after_the_longest(
    make_limiter: LimiterFactory,
) -> None:
    limiter = make_limiter("minute=2/minute, hour=2/hour, day=3/day")
    assert all([(await limiter.hit_policies("key-a")).allowed for _ in range(2)])
    refused = await limiter.hit_policies("key-a")
    assert refused.violated == ("minute", "hour")
    assert refused.retry_after == max(status.reset_after for status in refused.policies[:2])
    assert refused.retry_after > 60
    assert remaining(refused) == {"minute": 0, "hour": 0, "day": 1}


async def test_if_keys_or_policies_differ_then_counters_are_apart(
    make_limiter: LimiterFactory,
) -> None:
    limiter = make_limiter("a=1/minute, b=1/minute")
    assert (await limiter.hit_policies("key-a")).allowed
    assert not (await limiter.hit_policies("key-a")).allowed
    # Same limits under other names, or another key: counted apart.
    assert (await limiter.hit_policies("key-a", "c=1/minute, d=1/minute")).allowed
    assert (await limiter.hit_policies("key-b")).allowed


async def test_if_policies_given_as_policy_items_then_the_same_as_text(
    make_limiter: LimiterFactory,
) -> None:
    limiter = make_limiter()
    policies = parse_policies("burst=2/minute, daily=5/day")
    assert (await limiter.hit_policies("key-a", policies)).allowed
    decision = await limiter.hit_policies("key-a", "burst=2/minute, daily=5/day")
    assert remaining(decision) == {"burst": 0, "daily": 3}
    with pytest.raises(InvalidKeyParameters):
        await limiter.hit_policies("key-a", [policies[0], policies[0]])


async def test_if_one_policy_then_hit_policies_counts_what_hit_counts(
    make_limiter: LimiterFactory,
) -> None:
    limiter = make_limiter("3/minute")
    single = await limiter.hit("key-a")
    several = await limiter.hit_policies("key-a")
    assert several.allowed
    (status,) = several.policies
    assert (status.name, status.limit, status.window) == ("default", 3, 60)
    assert (single.remaining, status.remaining) == (2, 1)
    assert (await limiter.hit("key-a")).remaining == 0
    assert not (await limiter.hit_policies("key-a")).allowed
    assert not (await limiter.hit("key-a")).allowed


async def test_if_limiters_share_storage_then_several_policies_hold_across_them(
    make_limiter: LimiterFactory,
) -> None:
    limiters = [make_limiter("burst=4/minute, daily=6/hour") for _ in range(3)]
    decisions = await asyncio.gather(
        *(limiters[index % 3].hit_policies("key-a") for index in range(12))
    )
    assert sum(decision.allowed for decision in decisions) == 4
    for decision in decisions:
        if not decision.allowed:
            assert decision.violated == ("burst",)
    # daily was charged the admitted four only: two left, whoever asks.
    decision = await limiters[0].hit_policies("key-a", "other=9/minute, daily=6/hour")
    assert remaining(decision)["daily"] == 1


async def test_if_a_short_window_passes_then_the_refused_key_is_admitted_again(
    make_limiter: LimiterFactory,
) -> None:
    limiter = make_limiter("burst=2/second, daily=100/day")
    assert (await limiter.hit_policies("key-a")).allowed
    assert (await limiter.hit_policies("key-a")).allowed
    refused = await limiter.hit_policies("key-a")
    assert refused.violated == ("burst",)
    assert refused.retry_after == 1
    await asyncio.sleep(refused.retry_after + 0.05)
    again = await limiter.hit_policies("key-a")
    assert again.allowed
    assert remaining(again) == {"burst": 1, "daily": 97}


async def test_if_the_long_policy_is_used_up_then_retry_after_is_its_window_not_the_short_one(
    make_limiter: LimiterFactory,
) -> None:
    limiter = make_limiter("burst=5/second, hourly=2/hour")
    assert (await limiter.hit_policies("key-a")).allowed
    assert (await limiter.hit_policies("key-a")).allowed
    refused = await limiter.hit_policies("key-a")
    assert refused.violated == ("hourly",)
    burst, hourly = refused.policies
    assert refused.retry_after == hourly.reset_after > 3000
    assert burst.allowed
    assert burst.remaining == 3


# -- refunds -------------------------------------------------------------------------------


async def test_if_refunded_then_each_policy_gets_its_unit_back(
    make_limiter: LimiterFactory,
) -> None:
    limiter = make_limiter("burst=2/minute, daily=3/hour")
    assert (await limiter.hit_policies("key-a")).allowed
    assert (await limiter.hit_policies("key-a")).allowed
    assert not (await limiter.hit_policies("key-a")).allowed
    await limiter.refund("key-a")
    again = await limiter.hit_policies("key-a")
    assert again.allowed
    assert remaining(again) == {"burst": 0, "daily": 1}
    assert not (await limiter.hit_policies("key-a")).allowed


async def test_if_a_one_limit_request_is_refunded_then_hit_admits_one_more(
    make_limiter: LimiterFactory,
) -> None:
    limiter = make_limiter("2/minute")
    assert (await limiter.hit("key-a")).allowed
    assert (await limiter.hit("key-a")).allowed
    for _ in range(3):  # refusals are charged to nothing: the refund is not lost in them
        assert not (await limiter.hit("key-a")).allowed
    await limiter.refund("key-a")
    assert (await limiter.hit("key-a")).remaining == 0
    assert not (await limiter.hit("key-a")).allowed


async def test_if_refunded_after_the_window_ended_then_nothing_is_given(
    make_limiter: LimiterFactory,
) -> None:
    limiter = make_limiter("burst=1 per 1 second, daily=5/hour")
    assert (await limiter.hit_policies("key-a")).allowed
    await asyncio.sleep(1.1)
    assert (await limiter.hit_policies("key-a")).allowed  # the next burst window
    await limiter.refund("key-a")  # the unit charged in this window comes back
    assert (await limiter.hit_policies("key-a")).allowed
    assert not (await limiter.hit_policies("key-a")).allowed


async def test_if_nothing_was_charged_then_a_refund_gives_nothing() -> None:
    limiter = RateLimiter("burst=1/minute, daily=2/hour")
    try:
        await limiter.refund("key-a")  # no window open: nothing to give back
        assert (await limiter.hit_policies("key-a")).allowed
        assert not (await limiter.hit_policies("key-a")).allowed
    finally:
        await limiter.aclose()


@pytest.mark.redis
async def test_if_a_leased_unit_is_refunded_then_it_returns_to_the_lease_without_a_round_trip(
    redis_url: str, redis_prefix: str
) -> None:
    # A large limit leases slices: the refund goes back into this process's slice.
    limiter = RateLimiter("burst=1000/minute, daily=100000/day", redis_url, key_prefix=redis_prefix)
    other = RateLimiter("burst=1000/minute, daily=100000/day", redis_url, key_prefix=redis_prefix)
    try:
        first = await limiter.hit_policies("key-a")
        second = await limiter.hit_policies("key-a")
        calls = 0
        assert limiter._leases is not None
        script = limiter._leases.script

        async def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return await script(*args, **kwargs)

        limiter._leases.script = counting
        await limiter.refund("key-a")
        after = await limiter.hit_policies("key-a")
        assert calls == 0
        assert remaining(after) == remaining(second)
        assert remaining(second) == {name: count - 1 for name, count in remaining(first).items()}
        # Another process sees the units leased (never more than what is left).
        seen = await other.hit_policies("key-a")
        assert seen.allowed
        assert seen.policies[0].remaining <= 1000 - 2
    finally:
        await limiter.aclose()
        await other.aclose()


@pytest.mark.redis
async def test_if_a_small_limit_is_refunded_on_redis_then_the_process_admits_one_more(
    redis_url: str, redis_prefix: str
) -> None:
    limiter = RateLimiter("burst=2/minute, daily=3/hour", redis_url, key_prefix=redis_prefix)
    other = RateLimiter("burst=2/minute, daily=3/hour", redis_url, key_prefix=redis_prefix)
    try:
        assert (await limiter.hit_policies("key-a")).allowed
        assert (await other.hit_policies("key-a")).allowed
        assert not (await other.hit_policies("key-a")).allowed
        await limiter.refund("key-a")
        # The unit is back in this process's slice: here it admits, there it does not.
        assert not (await other.hit_policies("key-a")).allowed
        assert (await limiter.hit_policies("key-a")).allowed
        assert not (await limiter.hit_policies("key-a")).allowed
    finally:
        await limiter.aclose()
        await other.aclose()


async def test_if_the_storage_is_another_limits_storage_then_several_policies_still_hold() -> None:
    from limits.aio.storage import MemoryStorage

    limiter = RateLimiter("burst=2/minute, daily=3/hour", storage=MemoryStorage())
    try:
        decisions = [await limiter.hit_policies("key-a") for _ in range(4)]
        assert [decision.allowed for decision in decisions] == [True, True, False, False]
        assert remaining(decisions[-1]) == {"burst": 0, "daily": 1}
        assert decisions[-1].violated == ("burst",)
        await limiter.refund("key-a")
        assert (await limiter.hit_policies("key-a")).allowed
        concurrent = await asyncio.gather(*(limiter.hit_policies("key-b") for _ in range(6)))
        assert sum(decision.allowed for decision in concurrent) == 2
    finally:
        await limiter.aclose()


# -- several policies: any limits, any interleaving ----------------------------------------

_UNITS = {"minute": 60, "hour": 3600, "day": 86400}


@st.composite
def policy_sets(draw: st.DrawFn, leased: bool = False) -> tuple[str, dict[str, int]]:
    """A key's policies as text, and each policy's amount: windows no test outlives.

    With `leased`, some amounts are large enough for Redis to lease them in slices.
    """
    names = draw(
        st.lists(
            st.from_regex(r"[a-z][a-z0-9_-]{0,5}", fullmatch=True),
            min_size=1,
            max_size=4,
            unique=True,
        )
    )
    amount = st.integers(1, 8)
    if leased:
        amount = st.one_of(amount, st.integers(LEASE_THRESHOLD, 5 * LEASE_THRESHOLD))
    amounts = {name: draw(amount) for name in names}
    units = [draw(st.sampled_from(sorted(_UNITS))) for _ in names]
    text = ", ".join(
        f"{name}={amount}/{unit}"
        for (name, amount), unit in zip(amounts.items(), units, strict=True)
    )
    return text, amounts


@given(
    policies=policy_sets(),
    plan=st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=60),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_if_memory_requests_interleave_then_exactly_what_every_policy_admits(
    policies: tuple[str, dict[str, int]], plan: list[tuple[int, bool]]
) -> None:
    text, amounts = policies

    async def scenario() -> None:
        storage = FixedWindowMemoryStorage()
        limiters = [RateLimiter(text, storage=storage) for _ in range(3)]
        used = dict.fromkeys(amounts, 0)
        for index, refund in plan:
            decision = await limiters[index].hit_policies("k")
            full = tuple(name for name in amounts if used[name] >= amounts[name])
            # The model: admitted iff no policy is used up; refused ones charge nothing.
            assert decision.allowed == (not full)
            assert decision.violated == full
            if decision.allowed:
                for name in used:
                    used[name] += 1
                if refund:
                    await limiters[index].refund("k")
                    for name in used:
                        used[name] -= 1
            assert remaining(decision) == {
                name: amounts[name] - used[name] - (1 if decision.allowed and refund else 0)
                for name in amounts
            }
            assert max(used[name] - amounts[name] for name in amounts) <= 0

    asyncio.run(scenario())


def _redis_counts(url: str, counters: list[str]) -> list[int]:
    from redis import Redis

    client = Redis.from_url(url)
    try:
        return [int(client.get(f"LIMITS:{counter}") or 0) for counter in counters]
    finally:
        client.close()


@pytest.mark.redis
@given(
    policies=policy_sets(leased=True),
    plan=st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=80),
    concurrent=st.booleans(),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_if_redis_requests_interleave_then_no_policy_exceeded_and_no_refusal_charged(
    policies: tuple[str, dict[str, int]], plan: list[tuple[int, bool]], concurrent: bool
) -> None:
    services.require(services.REDIS_URL, "Redis", "APIKEYS_TEST_REDIS_URL")
    url = services.REDIS_URL
    text, amounts = policies
    prefix = tagged_prefix("policies")

    async def scenario() -> None:
        limiters = [RateLimiter(text, url, key_prefix=prefix) for _ in range(3)]
        admitted = refunded = 0
        try:

            async def one(index: int, refund: bool) -> None:
                nonlocal admitted, refunded
                decision = await limiters[index].hit_policies("k")
                if decision.allowed:
                    admitted += 1
                    if refund:
                        await limiters[index].refund("k")
                        refunded += 1
                else:
                    assert decision.violated
                    assert decision.retry_after >= max(
                        status.reset_after for status in decision.policies if not status.allowed
                    )
                for status in decision.policies:
                    assert 0 <= status.remaining <= status.limit

            if concurrent:
                await asyncio.gather(*(one(index, refund) for index, refund in plan))
            else:
                for index, refund in plan:
                    await one(index, refund)
            plans = limiters[0].plan("k", None)
            counts = _redis_counts(url, [counter for counter, *_ in plans])
            for (counter, amount, _, name), count in zip(plans, counts, strict=True):
                held = sum(
                    limiter._leases.slices[counter].left
                    for limiter in limiters
                    if limiter._leases is not None and counter in limiter._leases.slices
                )
                # Every unit counted in Redis was spent by an admitted request (and not
                # given back) or is still held by a process: none by a refused request.
                assert count == admitted - refunded + held, name
                assert admitted - refunded <= amount, name
            if (
                max(amounts.values()) < LEASE_THRESHOLD
                and not concurrent
                and not any(refund for _, refund in plan)
            ):
                # Units leased one at a time: exactly as strict as one count per request.
                assert admitted == min(len(plan), *amounts.values())
        finally:
            for limiter in limiters:
                await limiter.aclose()
            await _delete_keys(url, f"*{prefix}*")

    asyncio.run(scenario())


# -- one charge: a cost, one policy or several -------------------------------------------------


async def _charged(limiter: RateLimiter, plan: Plan, cost: int) -> PolicyDecision:
    answer = limiter.charge(plan, cost)
    return decision_of(plan, answer if isinstance(answer, tuple) else await answer)


@pytest.mark.parametrize("text", ["10/minute", "burst=10/minute, daily=12/hour"])
async def test_if_a_charge_costs_several_units_then_all_are_taken_or_none(
    make_limiter: LimiterFactory, text: str
) -> None:
    limiter = make_limiter(text)
    plan = limiter.plan("key-a", text)
    first = await _charged(limiter, plan, 4)
    assert first.allowed
    assert remaining(first)[plan[0][3]] == 6
    assert (await _charged(limiter, plan, 6)).allowed  # exactly what is left of the first
    refused = await _charged(limiter, plan, 1)
    assert not refused.allowed
    assert refused.violated == (plan[0][3],)
    # A refused charge took nothing: a refund of 3 admits a charge of 3, and no more.
    await limiter.refund("key-a", text, cost=3)
    assert (await _charged(limiter, plan, 3)).allowed
    assert not (await _charged(limiter, plan, 1)).allowed


async def test_if_a_charge_costs_more_than_the_limit_then_refused_and_nothing_is_charged(
    limiter: RateLimiter,
) -> None:
    plan = limiter.plan("key-a", "5/minute")
    too_much = await _charged(limiter, plan, 6)
    assert not too_much.allowed
    assert too_much.policies[0].remaining == 5
    assert (await _charged(limiter, plan, 5)).allowed


async def test_if_the_storage_is_another_then_a_cost_is_taken_or_given_back() -> None:
    limiter = RateLimiter(
        "5/minute", storage=limits_storage.MemoryStorage()
    )  # limits' own: the generic path
    try:
        plan = limiter.plan("key-a")
        assert remaining(await _charged(limiter, plan, 3)) == {"default": 2}
        refused = await _charged(limiter, plan, 3)
        assert not refused.allowed
        assert remaining(refused) == {"default": 2}
        assert (await _charged(limiter, plan, 2)).allowed
    finally:
        await limiter.aclose()
