"""A key of an identity is charged to its own policies and its identity's in one charge: all
or nothing, in memory, on Redis and on a Redis Cluster (where the key's counters and the
identity's share the identity's slot), and across processes nothing is over-admitted."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from limits.aio.storage import MemoryStorage
from redis.crc import key_slot

from apikeys.errors import InvalidKeyParameters
from apikeys.ratelimit import (
    IDENTITY_POLICY_PREFIX,
    Plan,
    RateLimiter,
    ThresholdCrossing,
)
from tests import redis_servers, services
from tests.conftest import redis_prefix

ROOT = Path(__file__).resolve().parent.parent

# -- the model ---------------------------------------------------------------------------------


class Scenario:
    """Keys of one identity, each with its own limits, and requests `(key index, cost)`."""

    def __init__(
        self,
        identity_limits: dict[str, int],
        key_limits: list[dict[str, int]],
        requests: list[tuple[int, int]],
    ) -> None:
        self.identity_limits = identity_limits
        self.key_limits = key_limits
        self.requests = requests

    def __repr__(self) -> str:
        return f"Scenario({self.identity_limits!r}, {self.key_limits!r}, {self.requests!r})"


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """An identity limited to a few units (one or two policies), 1 to 4 keys each limited
    below or above it, and requests of costs 1 to 3 interleaved over the keys."""
    small = draw(st.integers(1, 12))
    identity_limits = {"hourly": small}
    if draw(st.booleans()):
        identity_limits["daily"] = draw(st.integers(small, 2 * small + 2))
    keys = draw(st.integers(1, 4))
    key_limits = []
    for _ in range(keys):
        limits = {"burst": draw(st.integers(1, 2 * small + 3))}
        if draw(st.booleans()):
            limits["daily"] = draw(st.sampled_from([1, small, 70, 1000]))
        key_limits.append(limits)
    requests = draw(
        st.lists(st.tuples(st.integers(0, keys - 1), st.integers(1, 3)), min_size=1, max_size=40)
    )
    return Scenario(identity_limits, key_limits, requests)


Counts = dict[str, tuple[int, int]]
"""Each counter's count in the limiter's storage, and the units of it this process holds
unspent (leased on Redis: counted as used there, and free for this process to spend)."""
Snapshot = Callable[[RateLimiter, list[Plan]], Awaitable[Counts]]


async def play(limiter: RateLimiter, scenario: Scenario, tag: str, charged: Snapshot) -> None:
    """Run `scenario` on `limiter` and check each decision against a model that charges
    every counter of a request or none: what is admitted, what each policy has left, which
    policies refused and Retry-After; that a refused request changes no counter; and at the
    end, that every counter holds what the model says was charged to it (and on Redis, no
    more than this process holds unspent besides)."""
    identity = f"acme-{tag}"
    hourly = scenario.identity_limits["hourly"]
    identity_text = f"{hourly}/hour"
    if "daily" in scenario.identity_limits:
        identity_text = f"hourly={hourly}/hour, daily={scenario.identity_limits['daily']}/day"
    keys = [f"key{index}{tag}" for index in range(len(scenario.key_limits))]
    key_texts = [
        ", ".join(
            f"{name}={amount}/{'minute' if name == 'burst' else 'day'}"
            for name, amount in limits.items()
        )
        for limits in scenario.key_limits
    ]
    plans = [
        limiter.plan(key, text, identity=identity, identity_policies=identity_text)
        for key, text in zip(keys, key_texts, strict=True)
    ]
    used: dict[str, int] = {}  # the model: counter -> units charged
    admitted = 0
    for index, cost in scenario.requests:
        plan = plans[index]
        before = await charged(limiter, plans)
        decision = await limiter.hit_policies(
            keys[index],
            key_texts[index],
            identity=identity,
            identity_policies=identity_text,
            cost=cost,
        )
        fits = [used.get(counter, 0) + cost <= amount for counter, amount, _, _ in plan]
        assert decision.allowed == all(fits), (index, cost, decision)
        names = [name for *_, name in plan]
        assert [status.name for status in decision.policies] == names
        assert decision.violated == tuple(
            name for name, fit in zip(names, fits, strict=True) if not fit
        )
        if decision.allowed:
            admitted += cost
            for counter, *_ in plan:
                used[counter] = used.get(counter, 0) + cost
            assert decision.retry_after == 0
        else:
            assert await charged(limiter, plans) == before, "a refused request was charged"
            longest = max(status.reset_after for status in decision.policies if not status.allowed)
            assert decision.retry_after == longest >= 1
        for (counter, amount, _, _), status in zip(plan, decision.policies, strict=True):
            assert status.remaining == amount - used.get(counter, 0)
    after = {
        counter: count - held for counter, (count, held) in (await charged(limiter, plans)).items()
    }
    assert {counter: count for counter, count in after.items() if count} == {
        counter: count for counter, count in used.items() if count
    }
    # Every admitted unit was charged to the identity's policies, shared by every key.
    for counter, amount, _, name in plans[0]:
        if name.startswith(IDENTITY_POLICY_PREFIX):
            assert after.get(counter, 0) == admitted <= amount


def _counters(plans: list[Plan]) -> list[str]:
    return sorted({counter for plan in plans for counter, *_ in plan})


async def in_process(limiter: RateLimiter, plans: list[Plan]) -> Counts:
    """Each counter's count in the limiter's in-process windows (nothing held)."""
    return {counter: (await limiter.storage.get(counter), 0) for counter in _counters(plans)}


async def on_redis(limiter: RateLimiter, plans: list[Plan]) -> Counts:
    """Each counter's count in Redis, and the units of it this process's slice holds."""
    leases = limiter._leases
    assert leases is not None
    client = limiter.storage.bridge.storage  # type: ignore[attr-defined]
    counts = {}
    for counter in _counters(plans):
        raw = await client.get(leases.prefixed(counter))
        held = leases.slices.get(counter)
        counts[counter] = (int(raw or 0), held.left if held is not None else 0)
    return counts


# -- the plan -----------------------------------------------------------------------------------


def test_a_key_without_an_identity_has_the_plan_it_had() -> None:
    limiter = RateLimiter(key_prefix="app")
    plan = limiter.plan("3xK9pQ2mZ7aB", "burst=5/second, daily=9/day")
    assert plan == (
        ("app/3xK9pQ2mZ7aB/burst/1", 5, 1, "burst"),
        ("app/3xK9pQ2mZ7aB/daily/86400", 9, 86400, "daily"),
    )
    assert limiter.plan("3xK9pQ2mZ7aB", "burst=5/second, daily=9/day") is plan


def test_the_keys_of_an_identity_share_its_counters_named_by_it() -> None:
    limiter = RateLimiter(key_prefix="app")
    first = limiter.plan("keyA", "10/minute", identity="acme", identity_policies="5/minute")
    second = limiter.plan("keyB", "10/minute", identity="acme", identity_policies="5/minute")
    assert first == (
        ("app/keyA/60", 10, 60, "default"),
        ("app/i:acme/60", 5, 60, "identity.default"),
    )
    assert second[1] == first[1]
    named = limiter.plan("keyA", "9/day", identity="acme", identity_policies="burst=2/second")
    assert named[1] == ("app/i:acme/burst/1", 2, 1, "identity.burst")
    assert limiter.plan("keyA", "9/day", identity="acme", identity_policies=None) == (
        ("app/keyA/86400", 9, 86400, "default"),
    )


def test_on_a_cluster_every_counter_of_a_key_of_an_identity_is_in_the_identity_slot() -> None:
    limiter = RateLimiter(key_prefix="app")
    limiter._tag = True  # as on a Redis Cluster
    plan = limiter.plan(
        "keyA", "burst=5/second, daily=9/day", identity="acme", identity_policies="5/minute"
    )
    assert [counter for counter, *_ in plan] == [
        "app/{i:acme}keyA/burst/1",
        "app/{i:acme}keyA/daily/86400",
        "app/{i:acme}/60",
    ]
    assert {key_slot(("LIMITS:" + counter).encode()) for counter, *_ in plan} == {
        key_slot(b"i:acme")
    }
    # Read back: the key's counters name the key, the identity's the identity.
    assert [limiter._counter_owner(counter) for counter, *_ in plan] == [
        ("keyA", "burst", None),
        ("keyA", "daily", None),
        ("", "default", "acme"),
    ]
    # A key of no identity keeps its own slot.
    assert limiter.plan("keyA", "5/second")[0][0] == "app/{keyA}/1"
    assert limiter._counter_owner("app/{keyA}/1") == ("keyA", "default", None)


@pytest.mark.parametrize("cluster", [False, True], ids=["single", "cluster"])
def test_a_key_moved_to_another_identity_starts_afresh_only_on_a_cluster(cluster: bool) -> None:
    limiter = RateLimiter(key_prefix="app")
    limiter._tag = cluster
    alone = limiter.plan("keyA", "5/second")[0][0]
    acme = limiter.plan("keyA", "5/second", identity="acme", identity_policies="9/day")[0][0]
    umbrella = limiter.plan("keyA", "5/second", identity="umbrella")[0][0]
    if cluster:
        assert len({alone, acme, umbrella}) == 3
    else:
        assert alone == acme == umbrella == "app/keyA/1"


@pytest.mark.parametrize("identity", ["", "a/b", "a{b", "a}b", "a\nb"])
def test_an_identity_that_cannot_name_a_counter_is_refused(identity: str) -> None:
    with pytest.raises(InvalidKeyParameters):
        RateLimiter().plan("keyA", "5/second", identity=identity, identity_policies="1/minute")


@pytest.mark.parametrize("tagged", [False, True], ids=["single node", "cluster"])
@pytest.mark.parametrize("key_id", ["i:acme", "i:acme/daily", "/daily", ""])
def test_a_key_id_that_could_name_an_identitys_counters_is_refused(
    key_id: str, tagged: bool
) -> None:
    # Else key `i:acme` would spend identity acme's window, and key `i:y` of identity y
    # would charge one counter twice.
    limiter = RateLimiter()
    limiter._tag = tagged
    with pytest.raises(InvalidKeyParameters, match="key id"):
        limiter.plan(key_id, "100/minute")
    with pytest.raises(InvalidKeyParameters, match="key id"):
        limiter.plan(key_id, "100/minute", identity="acme", identity_policies="daily=4/day")
    owned = limiter.plan("keyA", "100/minute", identity="acme", identity_policies="daily=4/day")
    assert len({counter for counter, *_ in owned}) == len(owned)


# -- one charge, all or nothing ---------------------------------------------------------------


async def test_a_request_the_identity_refuses_is_charged_to_no_key() -> None:
    limiter = RateLimiter()
    hits = [
        await limiter.hit_policies(key, "3/minute", identity="acme", identity_policies="2/minute")
        for key in ("keyA", "keyB", "keyA")
    ]
    assert [hit.allowed for hit in hits] == [True, True, False]
    assert hits[2].violated == ("identity.default",)
    assert [status.remaining for status in hits[2].policies] == [2, 0]  # keyA: 3 - 1
    # keyA alone still has two: only the identity stands in the way.
    alone = await limiter.hit_policies("keyA", "3/minute")
    assert alone.allowed
    assert alone.policies[0].remaining == 1


async def test_retry_after_is_the_longest_wait_among_the_violated_policies() -> None:
    limiter = RateLimiter()
    kwargs: dict[str, Any] = {"identity": "acme", "identity_policies": "1/hour"}
    assert (await limiter.hit_policies("keyA", "1/minute", **kwargs)).allowed
    refused = await limiter.hit_policies("keyA", "1/minute", **kwargs)
    assert refused.violated == ("default", "identity.default")
    assert refused.retry_after == refused.policies[1].reset_after > 3000
    assert refused.policies[0].reset_after <= 60


async def test_a_refund_gives_back_to_the_key_and_its_identity() -> None:
    limiter = RateLimiter()
    kwargs: dict[str, Any] = {"identity": "acme", "identity_policies": "1/minute"}
    assert (await limiter.hit_policies("keyA", "5/minute", **kwargs)).allowed
    await limiter.refund("keyA", "5/minute", **kwargs)
    again = await limiter.hit_policies("keyB", "5/minute", **kwargs)
    assert again.allowed
    assert [status.remaining for status in again.policies] == [4, 0]


async def test_a_threshold_of_the_identity_names_the_identity() -> None:
    limiter = RateLimiter()
    told: list[ThresholdCrossing] = []
    limiter.on_threshold = told.append
    for key in ("keyA", "keyB", "keyA", "keyB", "keyA"):
        await limiter.hit_policies(key, "100/minute", identity="acme", identity_policies="5/minute")
    # The identity's window reached 4 of 5 (80 %), then 5 (90 and 100 %); the keys' none.
    assert [(c.key_id, c.policy, c.threshold, c.identity, c.used) for c in told] == [
        ("", "default", 80, "acme", 4),
        ("", "default", 90, "acme", 5),
        ("", "default", 100, "acme", 5),
    ]


@given(scenario=scenarios())
@settings(suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.parametrize("storage", ["memory", "generic"])
def test_if_keys_of_an_identity_interleave_then_exactly_what_the_model_admits(
    storage: str, scenario: Scenario
) -> None:
    # `generic`: limits' own memory storage, which the limiter checks, then charges.
    limiter = RateLimiter(storage=MemoryStorage() if storage == "generic" else None)
    asyncio.run(play(limiter, scenario, "", in_process))


# -- Redis and a Redis Cluster ----------------------------------------------------------------


async def _names(url: str, pattern: str, *, delete: bool = False) -> list[str]:
    """The Redis keys matching `pattern` on a single node or on every master of a cluster
    (deleted, with `delete`)."""
    from apikeys.stores.redis.client import parse_redis_url, redis_client

    target = parse_redis_url(url)
    client, _ = redis_client(target)
    try:
        if target.kind != "cluster":
            names = [name async for name in client.scan_iter(match=pattern, count=500)]
        else:
            await client.initialize()  # type: ignore[union-attr] - else it knows no node
            names = []
            for node in client.get_primaries():  # type: ignore[union-attr]
                names += [
                    name
                    async for name in client.scan_iter(match=pattern, count=500, target_nodes=node)
                ]
        for name in names if delete else []:
            await client.delete(name)  # one by one: they may be in several slots
        return names
    finally:
        await client.aclose()


async def _on_server(url: str, scenario: Scenario) -> None:
    prefix = redis_prefix("identity")
    limiter = RateLimiter(storage_url=url, key_prefix=prefix)
    try:
        await play(limiter, scenario, uuid.uuid4().hex[:8], on_redis)
    finally:
        await limiter.aclose()
        await _names(url, f"*{prefix}*", delete=True)


@pytest.mark.redis
@given(scenario=scenarios())
@settings(max_examples=15, suppress_health_check=[HealthCheck.too_slow])
def test_if_keys_of_an_identity_interleave_on_redis_then_exactly_what_the_model_admits(
    scenario: Scenario,
) -> None:
    services.require(services.REDIS_URL, "Redis", "APIKEYS_TEST_REDIS_URL")
    asyncio.run(_on_server(services.REDIS_URL, scenario))


@pytest.mark.redis
@given(scenario=scenarios())
@settings(
    max_examples=10,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
def test_if_keys_of_an_identity_interleave_on_a_cluster_then_exactly_what_the_model_admits(
    redis_cluster: redis_servers.LocalCluster, scenario: Scenario
) -> None:
    # One script leases the key's counters and the identity's: were they in two slots, the
    # cluster would refuse it (CROSSSLOT) and the limiter answer 503 (LimiterUnavailable).
    asyncio.run(_on_server(redis_cluster.url, scenario))


async def test_on_a_cluster_the_keys_of_an_identity_lease_in_its_slot(
    redis_cluster: redis_servers.LocalCluster,
) -> None:
    prefix = redis_prefix("identity")
    url = redis_cluster.url
    limiter = RateLimiter(storage_url=url, key_prefix=prefix)
    try:
        for key in ("keyA", "keyB", "keyC"):
            decision = await limiter.hit_policies(
                key, "burst=5/second, daily=50/day", identity="acme", identity_policies="9/minute"
            )
            assert decision.allowed
        names = await _names(url, f"*{prefix}*")
        assert len(names) == 7  # two of each key, one of the identity
        assert {key_slot(name.encode()) for name in names} == {key_slot(b"i:acme")}
    finally:
        await limiter.aclose()
        await _names(url, f"*{prefix}*", delete=True)


# -- across processes ------------------------------------------------------------------------

WORKER = """
import asyncio, json, sys, time
from apikeys.ratelimit import RateLimiter

async def main(url, prefix, identity_limit, key_limit, start_at, hits):
    limiter = RateLimiter(storage_url=url, key_prefix=prefix)
    keys = ["keyA", "keyB", "keyC"]
    admitted, violated, sent = 0, set(), 0
    async def one(index):
        nonlocal admitted
        decision = await limiter.hit_policies(
            keys[index % 3], key_limit, identity="acme", identity_policies=identity_limit
        )
        admitted += decision.allowed
        violated.update(decision.violated)
    await asyncio.sleep(max(0.0, start_at - time.time()))  # start together
    # Demand goes on until this process is refused (it then holds no unit of the identity).
    while sent < hits and not violated:
        await asyncio.gather(*(one(sent + turn) for turn in range(5)))
        sent += 5
    await limiter.aclose()
    print(json.dumps({"admitted": admitted, "violated": sorted(violated)}))

asyncio.run(main(*sys.argv[1:5], float(sys.argv[5]), int(sys.argv[6])))
"""


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.parametrize("deployment", ["redis", "cluster"])
async def test_if_processes_charge_keys_of_one_identity_then_exactly_its_limit_is_admitted(
    deployment: str, request: pytest.FixtureRequest
) -> None:
    # 3 processes, 3 keys each limited above the identity's 12 a minute: exactly 12 admitted
    # in all, whichever keys and processes they came through.
    if deployment == "redis":
        services.require(services.REDIS_URL, "Redis", "APIKEYS_TEST_REDIS_URL")
        url = services.REDIS_URL
    else:
        url = request.getfixturevalue("redis_cluster").url
    prefix = redis_prefix("identity-mp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    start_at = str(time.time() + 3.0)
    command = [sys.executable, "-c", WORKER, url, prefix, "12/minute", "50/minute", start_at]
    processes = [
        subprocess.Popen(  # noqa: ASYNC220 - started together, then awaited in threads
            [*command, "200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        for _ in range(3)
    ]
    try:
        admitted = 0
        violated: set[str] = set()
        for process in processes:
            out, err = await asyncio.to_thread(process.communicate, timeout=120)
            assert process.returncode == 0, err.decode()
            report = json.loads(out)
            admitted += report["admitted"]
            violated.update(report["violated"])
        assert admitted == 12
        assert violated == {"identity.default"}
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        await _names(url, f"*{prefix}*", delete=True)
