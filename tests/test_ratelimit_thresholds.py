"""The limiter tells `on_threshold` when a key's window reaches 80, 90 and 100 % of a limit:
once per key, policy, threshold and window, in memory and on Redis, whichever process
charges the units."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from limits.aio.storage import MemoryStorage

from apikeys.ratelimit import (
    DEFAULT_POLICY,
    THRESHOLDS,
    FixedWindowMemoryStorage,
    RateLimiter,
    ThresholdCrossing,
    parse_policies,
)
from tests import services
from tests.conftest import delete_redis_keys
from tests.conftest import redis_prefix as tagged_prefix
from tests.test_ratelimit import _redis_counts, policy_sets

LimiterFactory = Callable[..., RateLimiter]


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis), "generic"])
async def make_limiter(request: pytest.FixtureRequest) -> AsyncIterator[LimiterFactory]:
    """Limiters that share their counters: one memory storage, one Redis database (each
    limiter is then a process of its own, with its own leases), or limits' own memory
    storage, which the limiter counts in with its generic path."""
    made: list[RateLimiter] = []
    prefix = tagged_prefix("thresholds")
    shared = MemoryStorage() if request.param == "generic" else None
    url = request.getfixturevalue("redis_url") if request.param == "redis" else "memory://"

    def make(default: str = "10/minute") -> RateLimiter:
        if request.param == "redis":
            limiter = RateLimiter(default, url, key_prefix=prefix)
        elif shared is not None:
            limiter = RateLimiter(default, storage=shared, key_prefix=prefix)
        elif made:
            limiter = RateLimiter(default, storage=made[0].storage, key_prefix=prefix)
        else:
            limiter = RateLimiter(default, key_prefix=prefix)
        made.append(limiter)
        return limiter

    try:
        yield make
    finally:
        for limiter in made:
            await limiter.aclose()
        if request.param == "redis":
            await delete_redis_keys(url, f"*{prefix}*")


def observed(*limiters: RateLimiter) -> list[ThresholdCrossing]:
    told: list[ThresholdCrossing] = []
    for limiter in limiters:
        limiter.on_threshold = told.append
    return told


def marks(told: list[ThresholdCrossing]) -> list[tuple[str, str, int, int]]:
    return sorted((c.key_id, c.policy, c.threshold, c.used) for c in told)


async def test_each_threshold_is_told_once_by_the_request_that_reaches_it(
    make_limiter: LimiterFactory,
) -> None:
    limiter = make_limiter("10/minute")
    told = observed(limiter)
    for number in range(1, 11):
        assert (await limiter.hit("key-a")).allowed
        assert [c.threshold for c in told if c.used == number] == {
            8: [80],
            9: [90],
            10: [100],
        }.get(number, [])
    assert not (await limiter.hit("key-a")).allowed  # refused: charged nothing, told nothing
    assert marks(told) == [
        ("key-a", DEFAULT_POLICY, 80, 8),
        ("key-a", DEFAULT_POLICY, 90, 9),
        ("key-a", DEFAULT_POLICY, 100, 10),
    ]
    (first, *others) = told
    assert all((c.limit, c.window) == (10, 60) for c in told)
    # One window: the same end, whoever tells it (Redis' is measured per lease: a second).
    assert all(abs(c.window_end - first.window_end) <= 1 for c in others)
    assert first.at < first.window_end <= first.at + 61


async def test_a_limit_reached_at_once_tells_every_threshold(make_limiter: LimiterFactory) -> None:
    limiter = make_limiter("1/minute")
    told = observed(limiter)
    assert (await limiter.hit("key-a")).allowed
    assert [(c.threshold, c.used) for c in told] == [(80, 1), (90, 1), (100, 1)]
    assert not (await limiter.hit("key-a")).allowed
    assert len(told) == 3


@pytest.mark.parametrize(
    ("limit", "expected"), [(3, [3, 3, 3]), (7, [6, 7, 7]), (20, [16, 18, 20])]
)
async def test_a_mark_is_the_least_count_at_or_above_its_share(
    make_limiter: LimiterFactory, limit: int, expected: list[int]
) -> None:
    limiter = make_limiter(f"{limit}/minute")
    told = observed(limiter)
    for _ in range(limit + 2):
        await limiter.hit("key-a")
    assert [c.used for c in told] == expected
    assert [c.threshold for c in told] == list(THRESHOLDS)


async def test_two_processes_sharing_the_counters_tell_each_threshold_once(
    make_limiter: LimiterFactory,
) -> None:
    first, second = make_limiter("10/minute"), make_limiter("10/minute")
    told = observed(first, second)
    decisions = [await (first, second)[turn % 2].hit("key-a") for turn in range(14)]
    assert sum(decision.allowed for decision in decisions) == 10
    assert [(c.threshold, c.used) for c in sorted(told)] == [(80, 8), (90, 9), (100, 10)]


async def test_named_policies_are_told_each_of_their_own(make_limiter: LimiterFactory) -> None:
    first, second = make_limiter(), make_limiter()
    told = observed(first, second)
    policies = "burst=5/minute, daily=20/hour"
    for turn in range(12):
        await (first, second)[turn % 2].hit_policies("key-a", policies)
    # burst admits 5: 4 and 5 are its marks; the 7 refused requests charge daily nothing.
    assert marks(told) == [
        ("key-a", "burst", 80, 4),
        ("key-a", "burst", 90, 5),
        ("key-a", "burst", 100, 5),
    ]
    told.clear()
    other = "burst=20/minute, daily=5/hour"  # other counters' names: another key's
    for turn in range(6):
        await (first, second)[turn % 2].hit_policies("key-b", other)
    assert marks(told) == [
        ("key-b", "daily", 80, 4),
        ("key-b", "daily", 90, 5),
        ("key-b", "daily", 100, 5),
    ]
    assert {c.window for c in told} == {3600}


async def test_on_redis_a_mark_is_told_by_the_lease_that_reaches_it(
    make_limiter: LimiterFactory,
) -> None:
    """Leased units count as used: with 1,000 a minute a slice is 62 units, and a mark is
    told when the units that reach it are leased, by the process they were leased to."""
    first, second = make_limiter("1000/minute"), make_limiter("1000/minute")
    told = observed(first, second)
    for turn in range(1000):
        assert (await (first, second)[turn % 2].hit("key-a")).allowed
    assert not (await first.hit("key-a")).allowed
    assert not (await second.hit("key-a")).allowed
    assert sorted(c.threshold for c in told) == list(THRESHOLDS)
    for crossing in told:
        assert crossing.used >= crossing.threshold * 10
    assert max(c.used for c in told) == 1000


async def test_a_refused_request_of_several_policies_tells_nothing(
    make_limiter: LimiterFactory,
) -> None:
    limiter = make_limiter()
    told = observed(limiter)
    policies = "burst=1/minute, daily=5/hour"
    assert (await limiter.hit_policies("key-a", policies)).allowed
    burst = [c.threshold for c in told if c.policy == "burst"]
    assert burst == list(THRESHOLDS)
    for _ in range(5):
        assert not (await limiter.hit_policies("key-a", policies)).allowed
    assert [c.policy for c in told] == ["burst"] * 3  # daily stays at 1 of 5


async def test_without_an_observer_nothing_is_told_and_the_counts_are_the_same(
    make_limiter: LimiterFactory,
) -> None:
    quiet, watched = make_limiter("10/minute"), make_limiter("10/minute")
    told = observed(watched)
    quiet_answers = [await quiet.hit("key-a") for _ in range(11)]
    watched_answers = [await watched.hit("key-b") for _ in range(11)]
    assert [d.allowed for d in quiet_answers] == [d.allowed for d in watched_answers]
    assert [d.remaining for d in quiet_answers] == [d.remaining for d in watched_answers]
    assert {c.key_id for c in told} == {"key-b"}


async def test_an_observer_that_raises_never_fails_the_request(
    make_limiter: LimiterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    limiter = make_limiter("1/minute")

    def broken(crossing: ThresholdCrossing) -> None:
        raise RuntimeError("the observer's own bug")

    limiter.on_threshold = broken
    with caplog.at_level(logging.WARNING, logger="apikeys"):
        assert (await limiter.hit("key-a")).allowed
    assert "threshold observer failed: RuntimeError" in caplog.text
    assert not (await limiter.hit("key-a")).allowed


async def test_the_memory_fast_path_tells_what_hit_tells() -> None:
    """`charge` answered at once (the gate's path without an await) is observed."""
    limiter = RateLimiter("10/minute")
    told = observed(limiter)
    one = limiter.plan("key-a", "4/minute")
    for _ in range(5):
        assert isinstance(limiter.charge(one), tuple)
    several = limiter.plan("key-b", "one=2/minute, two=3/minute")
    for _ in range(3):
        assert isinstance(limiter.charge(several), tuple)
    assert marks(told) == [
        ("key-a", DEFAULT_POLICY, 80, 4),
        ("key-a", DEFAULT_POLICY, 90, 4),
        ("key-a", DEFAULT_POLICY, 100, 4),
        ("key-b", "one", 80, 2),
        ("key-b", "one", 90, 2),
        ("key-b", "one", 100, 2),
    ]
    await limiter.aclose()


@pytest.mark.parametrize("tag", [False, True], ids=["plain", "cluster-tag"])
def test_a_counter_names_its_key_and_policy(tag: bool) -> None:
    limiter = RateLimiter(key_prefix="app/limits")
    limiter._tag = tag  # as on a Redis Cluster: the key's id is the counter's hash tag
    for policy in parse_policies("100/minute") + parse_policies("burst=5/second, day=9/day"):
        counter = limiter.plan("3xK9pQ2mZ7aB", [policy])[0][0]
        assert limiter._counter_owner(counter) == ("3xK9pQ2mZ7aB", policy.name, None)
    assert limiter._counter_owner("elsewhere/3xK9pQ2mZ7aB/60") is None


# -- any limits, any interleaving --------------------------------------------------------------


def _expected(amounts: dict[str, int], used: dict[str, int]) -> list[tuple[str, int]]:
    """Each threshold whose mark a policy's count reached, once."""
    return sorted(
        (name, threshold)
        for name, amount in amounts.items()
        for threshold in THRESHOLDS
        if -(-amount * threshold // 100) <= used[name]
    )


@given(
    policies=policy_sets(),
    plan=st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=60),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_if_memory_requests_interleave_then_each_mark_reached_is_told(
    policies: tuple[str, dict[str, int]], plan: list[tuple[int, bool]]
) -> None:
    text, amounts = policies

    async def scenario() -> None:
        storage = FixedWindowMemoryStorage()
        limiters = [RateLimiter(text, storage=storage) for _ in range(3)]
        told = observed(*limiters)
        used = dict.fromkeys(amounts, 0)
        peak = dict(used)
        for index, refund in plan:
            if (await limiters[index].hit_policies("k")).allowed:
                used = {name: count + 1 for name, count in used.items()}
                peak = {name: max(peak[name], used[name]) for name in used}
                if refund:
                    await limiters[index].refund("k")
                    used = {name: count - 1 for name, count in used.items()}
        reached = sorted((c.policy, c.threshold) for c in told)
        if any(refund for _, refund in plan):
            # A unit given back is charged again: its mark is told again (in the same
            # window, the same delivery, which the store keeps once).
            assert sorted(set(reached)) == _expected(amounts, peak)
        else:
            assert reached == _expected(amounts, peak)
        for crossing in told:
            assert crossing.key_id == "k"
            assert crossing.limit == amounts[crossing.policy]
            assert crossing.used <= crossing.limit
        for limiter in limiters:
            await limiter.aclose()

    asyncio.run(scenario())


@pytest.mark.redis
@given(
    policies=policy_sets(leased=True),
    plan=st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=80),
    concurrent=st.booleans(),
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_if_redis_requests_interleave_then_each_mark_leased_is_told_once(
    policies: tuple[str, dict[str, int]], plan: list[tuple[int, bool]], concurrent: bool
) -> None:
    """Across processes, concurrent or not, with units given back or not: each mark the
    window's count in Redis (leased units included) reached is told once, by one process."""
    services.require(services.REDIS_URL, "Redis", "APIKEYS_TEST_REDIS_URL")
    url = services.REDIS_URL
    text, amounts = policies
    prefix = tagged_prefix("thresholds")

    async def scenario() -> None:
        limiters = [RateLimiter(text, url, key_prefix=prefix) for _ in range(3)]
        told = observed(*limiters)
        try:

            async def one(index: int, refund: bool) -> None:
                if (await limiters[index].hit_policies("k")).allowed and refund:
                    await limiters[index].refund("k")

            if concurrent:
                await asyncio.gather(*(one(index, refund) for index, refund in plan))
            else:
                for index, refund in plan:
                    await one(index, refund)
            plans = limiters[0].plan("k", None)
            counts = _redis_counts(url, [counter for counter, *_ in plans])
            used = {name: count for (_, _, _, name), count in zip(plans, counts, strict=True)}
            assert sorted((c.policy, c.threshold) for c in told) == _expected(amounts, used)
        finally:
            for limiter in limiters:
                await limiter.aclose()
            await delete_redis_keys(url, f"*{prefix}*")

    asyncio.run(scenario())
