"""The Redis limiter leases slices of a window: never more admitted than the limit, across
processes, and Retry-After still a promise (real Redis, real processes)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apikeys.ratelimit import LEASE_THRESHOLD, RateLimiter
from tests import services
from tests.conftest import delete_redis_keys, redis_prefix

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parent.parent

WORKER = """
import asyncio, json, sys
from apikeys.ratelimit import RateLimiter

async def main(url, prefix, limit, hits):
    limiter = RateLimiter(limit, url, key_prefix=prefix)
    admitted = refused = 0
    async def one():
        nonlocal admitted, refused
        if (await limiter.hit("shared")).allowed:
            admitted += 1
        else:
            refused += 1
    # Demand goes on until this process is refused: it has spent every unit it leased, and
    # the window has none left (a process that stopped early would strand its slice).
    sent = 0
    while sent < hits and not refused:
        await asyncio.gather(*(one() for _ in range(min(50, hits - sent))))
        sent += 50
    await limiter.aclose()
    print(json.dumps({"admitted": admitted}))

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
"""


@pytest.fixture
async def prefix(redis_url: str) -> AsyncIterator[str]:
    name = redis_prefix("lease")
    try:
        yield name
    finally:
        await delete_redis_keys(redis_url, f"*{name}*")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("limit", "hits"), [("1/minute", 40), ("10/minute", 40), ("100000/minute", 200_000)]
)
async def test_if_processes_lease_from_one_window_then_exactly_the_limit_is_admitted(
    redis_url: str, prefix: str, limit: str, hits: int
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", WORKER, redis_url, prefix, limit, str(hits)]
    processes = [
        subprocess.Popen(  # noqa: ASYNC220 - started together, then awaited in threads
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        for _ in range(4)
    ]
    admitted = 0
    for process in processes:
        out, err = await asyncio.to_thread(process.communicate, timeout=120)
        assert process.returncode == 0, err.decode()
        admitted += json.loads(out)["admitted"]
    amount = int(limit.split("/")[0])
    # Each process asks until refused, far past the limit: exactly the limit, never more.
    assert admitted == amount


async def test_if_another_process_opens_the_next_window_then_retry_after_still_holds(
    redis_url: str, prefix: str
) -> None:
    # Finding 5: a process kept the window's end as Redis' whole-second TTL plus one, so
    # after the window rolled over and another process exhausted the next one, it answered
    # a Retry-After that ran out before that next window did.
    first = RateLimiter("2 per 3 seconds", redis_url, key_prefix=prefix)
    second = RateLimiter("2 per 3 seconds", redis_url, key_prefix=prefix)
    try:
        assert (await second.hit("k")).allowed  # the other process opens the window
        assert (await first.hit("k")).allowed  # this one finds it open, and uses it up
        deadline = time.monotonic() + 10
        while not (await second.hit("k")).allowed:  # the other process, at once when the
            assert time.monotonic() < deadline  # window rolls over, opens the next one
            await asyncio.sleep(0.02)
        assert (await second.hit("k")).allowed  # and uses it up
        refused = await first.hit("k")
        assert not refused.allowed
        await asyncio.sleep(refused.reset_after)
        assert (await first.hit("k")).allowed, "refused after waiting Retry-After"
    finally:
        await first.aclose()
        await second.aclose()


async def test_if_the_limit_is_large_then_far_fewer_commands_than_requests(
    redis_url: str, prefix: str
) -> None:
    limiter = RateLimiter("1000000/minute", redis_url, key_prefix=prefix)
    calls = 0
    assert limiter._leases is not None
    script = limiter._leases.script

    async def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return await script(*args, **kwargs)

    limiter._leases.script = counting
    try:
        for _ in range(5000):
            assert (await limiter.hit("busy")).allowed
    finally:
        await limiter.aclose()
    assert calls / 5000 <= 0.2, calls


async def test_if_little_is_left_then_one_unit_per_request() -> None:
    # Below the threshold a slice is one unit: a small limit is as strict as increments.
    assert LEASE_THRESHOLD > 10


@given(
    limit=st.sampled_from([1, 3, 10, 70, 200]),
    plan=st.lists(st.integers(0, 2), min_size=1, max_size=300),
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_if_hits_interleave_across_limiters_then_never_more_than_the_limit(
    limit: int, plan: list[int]
) -> None:
    services.require(services.REDIS_URL, "Redis", "APIKEYS_TEST_REDIS_URL")
    url = services.REDIS_URL
    name = redis_prefix("lease")

    async def scenario() -> None:
        limiters = [RateLimiter(f"{limit}/minute", url, key_prefix=name) for _ in range(3)]
        try:
            admitted = 0
            for index in plan:
                decision = await limiters[index].hit("k")
                admitted += decision.allowed
                assert decision.remaining >= 0
                if not decision.allowed:
                    assert decision.reset_after >= 1
            assert admitted <= limit
            if limit < LEASE_THRESHOLD:
                assert admitted == min(limit, len(plan))  # exactly as strict as increments
        finally:
            for limiter in limiters:
                await limiter.aclose()
            await delete_redis_keys(url, f"*{name}*")

    asyncio.run(scenario())


POLICIES_WORKER = """
import asyncio, json, sys, time
from apikeys.ratelimit import RateLimiter

async def main(url, prefix, policies, start_at, seconds):
    limiter = RateLimiter(policies, url, key_prefix=prefix)
    admitted, violated = [], set()
    async def one():
        decision = await limiter.hit_policies("shared")
        if decision.allowed:
            admitted.append(time.time())
        else:
            violated.update(decision.violated)
    await asyncio.sleep(max(0.0, start_at - time.time()))
    while time.time() < start_at + seconds:
        await asyncio.gather(*(one() for _ in range(5)))
        await asyncio.sleep(0.01)
    await limiter.aclose()
    print(json.dumps({"admitted": admitted, "violated": sorted(violated)}))

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])))
"""


@pytest.mark.slow
async def test_if_processes_share_several_policies_then_exactly_what_each_admits(
    redis_url: str, prefix: str
) -> None:
    # 4 processes want far more than burst=5/second and daily=20/minute allow: daily admits
    # exactly 20, and burst spreads them over at least four one-second windows.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start_at = time.time() + 2.0
    command = [
        sys.executable,
        "-c",
        POLICIES_WORKER,
        redis_url,
        prefix,
        "burst=5/second, daily=20/minute",
        str(start_at),
        "6",
    ]
    processes = [
        subprocess.Popen(  # noqa: ASYNC220 - started together, then awaited in threads
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        for _ in range(4)
    ]
    admitted: list[float] = []
    violated: set[str] = set()
    for process in processes:
        out, err = await asyncio.to_thread(process.communicate, timeout=120)
        assert process.returncode == 0, err.decode()
        report = json.loads(out)
        admitted += report["admitted"]
        violated.update(report["violated"])
    admitted.sort()
    assert len(admitted) == 20
    assert violated == {"burst", "daily"}
    # At most 5 in any burst window: 11 admissions in a row span a whole window (1 s).
    for first, last in zip(admitted, admitted[10:], strict=False):
        assert last - first > 0.9
    assert admitted[-1] - admitted[0] > 1.9
