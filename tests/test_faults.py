"""Outages of PostgreSQL and Redis, played with a TCP proxy, through the middleware.

While the key store (or the Redis limiter) cannot be reached, every request under `protect`
gets 503 `auth_unavailable` with `Retry-After`: never a 500, never a 200, not even for a
request that was mid-flight when the connection was cut. Once the server is back, requests
succeed again without a restart, and usage counted before the outage reaches the store
exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from apikeys import APIKeyMiddleware, Hasher, KeyManager, KeyRecord, RateLimiter, store_from_url
from apikeys.errors import StoreUnavailable
from tests.conftest import delete_redis_prefix
from tests.tcpproxy import TcpProxy
from tests.test_middleware import assert_problem, bearer, build_app

# The usage flush interval of the app's manager (the default): long enough that the first
# requests of a test are still buffered when the test cuts the connection.
FLUSH_INTERVAL = 1.0
VISIBLE_WITHIN = 2.5

KINDS = [
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
]


@dataclass
class Rig:
    """An app whose key store (and, on Redis, limiter) sits behind `proxy`."""

    proxy: TcpProxy
    app: APIKeyMiddleware
    manager: KeyManager
    """The app's manager: its store connects through the proxy."""
    admin: KeyManager
    """A manager straight on the store, never cut off: creates keys and reads counts."""
    client: httpx.AsyncClient
    key_id: str
    token: str

    async def call(self) -> httpx.Response:
        return await self.client.get("/api/v1/contacts", headers=bearer(self.token))

    async def calls(self, count: int) -> list[httpx.Response]:
        return list(await asyncio.gather(*(self.call() for _ in range(count))))

    async def count(self) -> KeyRecord:
        return await self.admin.get(self.key_id)


def assert_unavailable(response: httpx.Response) -> None:
    assert_problem(response, 503, "auth_unavailable")
    retry_after = response.headers["retry-after"]
    assert retry_after.isdigit()
    assert int(retry_after) >= 1
    assert "ratelimit" not in response.headers


def statuses(responses: list[httpx.Response]) -> list[int]:
    return [response.status_code for response in responses]


async def wait_for_count(rig: Rig, expected: int, within: float = VISIBLE_WITHIN) -> KeyRecord:
    """The record once its count is `expected`; fails if it passes it or is late."""
    deadline = time.monotonic() + within
    while True:
        record = await rig.count()
        assert record.request_count <= expected, "a request was counted twice"
        if record.request_count == expected:
            return record
        if time.monotonic() > deadline:
            pytest.fail(f"request_count {record.request_count}, expected {expected}")
        await asyncio.sleep(0.05)


async def held(proxy: TcpProxy) -> None:
    """Wait (without blocking the loop that must send it) until the proxy holds data."""
    assert await asyncio.to_thread(proxy.wait_for_held_data, 5.0), "nothing reached the proxy"


@pytest.fixture
def proxies() -> Iterator[dict[str, TcpProxy]]:
    """Proxies started by a test (by target URL), closed after it."""
    started: dict[str, TcpProxy] = {}
    try:
        yield started
    finally:
        for proxy in started.values():
            proxy.close()


def start_proxy(proxies: dict[str, TcpProxy], url: str) -> TcpProxy:
    proxy = proxies[url] = TcpProxy.to_url(url).start()
    return proxy


async def build_rig(
    *,
    store_url: str,
    store_options: dict[str, Any],
    proxy: TcpProxy,
    proxied_store: bool,
    limiter_url: str,
    hasher: Hasher,
    rate_limit: str | None = None,
) -> Rig:
    admin = KeyManager(store_from_url(store_url, **store_options), hasher=hasher)
    await admin.store.setup()
    app_store_url = proxy.url(store_url) if proxied_store else store_url
    # Shorter PostgreSQL timeouts than the defaults (5 s): a hang fails the test sooner.
    timeouts = {"connect_timeout": 2.0, "command_timeout": 2.0}
    if not store_url.startswith("postgres"):
        timeouts = {}
    manager = KeyManager(
        store_from_url(app_store_url, **store_options, **timeouts),
        hasher=hasher,
        usage_flush_interval=FLUSH_INTERVAL,
        webhooks=False,  # its own transactions would be held in place of the flush's
    )
    # The limiter's counters go under the store's Redis prefix, which the test deletes.
    limiter = RateLimiter(
        "1000/minute",
        limiter_url,
        key_prefix=str(store_options.get("key_prefix", "apikeys")).rstrip(":"),
    )
    app = build_app(manager, limiter=limiter)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
    created = await admin.create(
        name="faults", workspace="faults", scopes=["contacts:read"], rate_limit=rate_limit
    )
    return Rig(proxy, app, manager, admin, client, created.record.id, created.key)


async def close_rig(rig: Rig) -> None:
    rig.proxy.restore()
    try:
        await rig.client.aclose()
        await rig.manager.aclose()
        await rig.app.limiter.aclose()
    finally:
        await rig.admin.aclose()


@dataclass
class Target:
    """A server of the store table and the options that give a test its own data on it."""

    kind: str
    url: str
    options: dict[str, Any]


@pytest.fixture(params=KINDS)
def target(request: pytest.FixtureRequest) -> Target:
    # A plain fixture: `postgres_url` may only be set up outside the test's event loop.
    if request.param == "postgres":
        url = str(request.getfixturevalue("postgres_url"))
        return Target("postgres", url, {"table_name": f"faults_{uuid.uuid4().hex[:10]}"})
    url = str(request.getfixturevalue("redis_url"))
    return Target("redis", url, {"key_prefix": request.getfixturevalue("redis_key_prefix")})


@pytest.fixture
async def rig(target: Target, hasher: Hasher, proxies: dict[str, TcpProxy]) -> AsyncIterator[Rig]:
    """Key store behind the proxy; on Redis the limiter shares the proxied server."""
    proxy = start_proxy(proxies, target.url)
    built = await build_rig(
        store_url=target.url,
        store_options=target.options,
        proxy=proxy,
        proxied_store=True,
        limiter_url=proxy.url(target.url) if target.kind == "redis" else "memory://",
        hasher=hasher,
    )
    try:
        yield built
    finally:
        await close_rig(built)
        if target.kind == "redis":
            await delete_redis_prefix(target.url, target.options["key_prefix"])


async def test_if_store_severed_then_503_until_restored_and_usage_is_exact(
    rig: Rig, target: Target, caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest
) -> None:
    caplog.set_level(logging.WARNING, logger="apikeys")
    before = await rig.calls(10)
    assert statuses(before) == [200] * 10

    rig.proxy.sever()
    # Nothing flushed yet (the first flush is FLUSH_INTERVAL after the first request).
    assert rig.manager.usage_buffer.pending(rig.key_id)[0] == 10

    for _ in range(3):
        for response in await rig.calls(10):
            assert_unavailable(response)
    with pytest.raises(StoreUnavailable):
        await rig.manager.flush()
    assert rig.manager.usage_buffer.pending(rig.key_id)[0] == 10
    # The background flush fails too, and keeps the counts for its next attempt.
    deadline = time.monotonic() + 3 * FLUSH_INTERVAL
    while "usage flush failed" not in caplog.text:
        assert time.monotonic() < deadline, "the background flush never ran during the outage"
        await asyncio.sleep(0.05)
    assert (await rig.count()).request_count == 0

    rig.proxy.restore()
    after = await rig.calls(10)
    assert statuses(after) == [200] * 10

    # The background task retries on its own: no explicit flush here.
    record = await wait_for_count(rig, 20, within=2 * FLUSH_INTERVAL + VISIBLE_WITHIN)
    assert record.last_used_at is not None
    # The store may show the batch before the task has its answer: wait for that (closing
    # now would cancel it mid-flush, which the next test is about), then nothing is left.
    await rig.manager.flush()
    assert (await rig.count()).request_count == 20


async def test_if_severed_while_a_request_is_in_flight_then_that_request_gets_503(
    rig: Rig, target: Target, request: pytest.FixtureRequest
) -> None:
    assert statuses(await rig.calls(3)) == [200] * 3

    rig.proxy.pause()
    in_flight = asyncio.create_task(rig.call())
    await held(rig.proxy)
    assert not in_flight.done()
    rig.proxy.sever()
    assert_unavailable(await in_flight)

    rig.proxy.restore()
    assert statuses(await rig.calls(3)) == [200] * 3
    await rig.manager.flush()
    assert (await rig.count()).request_count == 6


async def test_if_store_is_slow_to_answer_then_requests_wait_not_fail(rig: Rig) -> None:
    # Held for a moment, then forwarded: a hiccup shorter than the timeouts is no outage.
    assert statuses(await rig.calls(2)) == [200] * 2
    rig.proxy.pause()
    waiting = asyncio.create_task(rig.call())
    await held(rig.proxy)
    await asyncio.sleep(0.2)
    assert not waiting.done()
    rig.proxy.resume()
    assert (await waiting).status_code == 200


async def test_if_usage_flush_loses_its_answer_then_counts_are_not_applied_twice(
    rig: Rig, target: Target
) -> None:
    # The server applies the flush's transaction, then the connection drops before the
    # client hears back: the buffer cannot tell "applied" from "not applied".
    # asyncpg commits with "COMMIT;" (not to be taken for "READ COMMITTED;" in a BEGIN).
    marker = b"COMMIT;" if target.kind == "postgres" else b"EXEC"
    assert statuses(await rig.calls(5)) == [200] * 5
    rig.proxy.hold_replies_after(marker)
    flush = asyncio.create_task(rig.manager.flush())
    await held(rig.proxy)
    await wait_for_count(rig, 5)  # the server has applied the whole batch
    rig.proxy.sever()
    with pytest.raises(StoreUnavailable):
        await flush
    # The batch stays queued under its id; this process still counts it (as well as the
    # store, until the retry confirms it).
    assert rig.manager.usage_buffer.pending(rig.key_id)[0] == 5
    rig.proxy.restore()
    await rig.manager.flush()
    assert rig.manager.usage_buffer.pending(rig.key_id)[0] == 0
    assert (await rig.count()).request_count == 5
    assert (await rig.manager.get(rig.key_id)).request_count == 5


async def test_if_manager_closes_while_a_usage_flush_is_in_flight_then_counts_are_not_applied_twice(
    rig: Rig, target: Target
) -> None:
    # No outage at all: `aclose()` comes while the background flush's transaction is
    # applied but unanswered. It must neither cancel that flush and write the batch again
    # with "what is left", nor lose it.
    # asyncpg commits with "COMMIT;" (not to be taken for "READ COMMITTED;" in a BEGIN).
    marker = b"COMMIT;" if target.kind == "postgres" else b"EXEC"
    assert statuses(await rig.calls(5)) == [200] * 5
    rig.proxy.hold_replies_after(marker)
    await held(rig.proxy)  # the background flush, FLUSH_INTERVAL after the first request
    await wait_for_count(rig, 5)
    closing = asyncio.create_task(rig.manager.aclose())
    await asyncio.sleep(0.2)
    rig.proxy.resume()
    await asyncio.wait_for(closing, 10)
    assert rig.manager.usage_buffer.pending(rig.key_id)[0] == 0
    assert (await rig.count()).request_count == 5


@pytest.mark.redis
async def test_if_only_the_redis_limiter_is_severed_then_503_and_back_after_restore(
    redis_url: str,
    redis_key_prefix: str,
    hasher: Hasher,
    proxies: dict[str, TcpProxy],
    request: pytest.FixtureRequest,
) -> None:
    proxy = start_proxy(proxies, redis_url)
    rig = await build_rig(
        store_url=redis_url,
        store_options={"key_prefix": redis_key_prefix},
        proxy=proxy,
        proxied_store=False,
        limiter_url=proxy.url(redis_url),
        hasher=hasher,
        # Below the leasing threshold: every request asks Redis, none is spent from a slice
        # leased before the outage.
        rate_limit="60/minute",
    )
    try:
        ok = await rig.calls(5)
        assert statuses(ok) == [200] * 5

        proxy.sever()
        refused = await rig.calls(3)
        for response in refused:
            assert_unavailable(response)

        proxy.restore()
        back = await rig.calls(5)
        assert statuses(back) == [200] * 5

        proxy.pause()  # the next limiter call is mid-flight when the connection is cut
        in_flight = asyncio.create_task(rig.call())
        await held(proxy)
        proxy.sever()
        assert_unavailable(await in_flight)
        refused.append(in_flight.result())

        proxy.restore()
        back += await rig.calls(5)
        assert statuses(back) == [200] * 10

        # The key store never failed: every request was authenticated by the key, and the
        # contract counts those, including the ones the limiter could not admit.
        await rig.manager.flush()
        assert (await rig.count()).request_count == len(ok) + len(refused) + len(back)
    finally:
        await close_rig(rig)
        await delete_redis_prefix(redis_url, redis_key_prefix)
