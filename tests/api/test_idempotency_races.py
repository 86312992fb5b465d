"""`Idempotency-Key` under concurrent requests, on every store: one request per key runs.

A retry that arrives while another request with the same `Idempotency-Key` runs answers 409,
one that arrives after it gets the first answer again; none runs the request a second time,
and none answers 500. The last cases, store-independent, run once, on memory. (The
single-request rules: tests/api/test_api.py.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from apikeys import KeyManager, MemoryStore
from apikeys.api import ManagementAPI
from apikeys.api.idempotency import Idempotency
from apikeys.errors import ConfigurationError, Conflict
from apikeys.stores import KeyStore
from tests.conftest import STORES

BASE = "http://test/v1/api-keys"
RETRIES = 12


@pytest.fixture(
    params=[*STORES, pytest.param("redis-cluster", marks=pytest.mark.redis, id="redis-cluster")]
)
def store_kind(request: pytest.FixtureRequest) -> str:
    """Every store of the table, and the Redis store on a cluster."""
    return str(request.param)


@pytest.fixture
async def client(manager: KeyManager) -> AsyncIterator[httpx.AsyncClient]:
    api = ManagementAPI(manager, rate_limit="100000/minute")
    app = Starlette(routes=[Mount("/v1/api-keys", app=api)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as c:
        yield c


async def writer(manager: KeyManager) -> dict[str, str]:
    created = await manager.create(
        name="caller", workspace="acme", scopes=["apikeys:read", "apikeys:write", "contacts:read"]
    )
    return {"Authorization": f"Bearer {created.key}"}


async def names(manager: KeyManager, name: str) -> int:
    return [record.name for record in await manager.list("acme")].count(name)


async def test_if_retries_of_a_completed_create_run_together_then_all_replay_its_answer(
    client: httpx.AsyncClient, manager: KeyManager
) -> None:
    headers = {**await writer(manager), "Idempotency-Key": "retry-zap"}
    body = {"name": "zap", "scopes": ["contacts:read"]}
    first = await client.post("/keys", json=body, headers=headers)
    assert first.status_code == 201, first.text
    retries = await asyncio.gather(
        *(client.post("/keys", json=body, headers=headers) for _ in range(RETRIES))
    )
    # The answer is kept before any retry starts: no retry finds a request running.
    assert [r.status_code for r in retries] == [201] * RETRIES, [r.text for r in retries]
    for retry in retries:
        assert retry.headers["idempotent-replayed"] == "true"
        assert retry.json() == first.json()  # the same key id and secret
    assert await names(manager, "zap") == 1


async def test_if_first_requests_with_one_key_run_together_then_one_key_is_made(
    client: httpx.AsyncClient, manager: KeyManager
) -> None:
    headers = {**await writer(manager), "Idempotency-Key": "first-zap"}
    body = {"name": "zap", "scopes": ["contacts:read"]}
    answers = await asyncio.gather(
        *(client.post("/keys", json=body, headers=headers) for _ in range(RETRIES))
    )
    assert {a.status_code for a in answers} <= {201, 409}, [a.text for a in answers]
    made = [a for a in answers if a.status_code == 201 and "idempotent-replayed" not in a.headers]
    assert len(made) == 1
    for answer in answers:
        if answer.status_code == 409:
            assert answer.json()["code"] == "conflict"
        else:
            assert answer.json() == made[0].json()
    assert await names(manager, "zap") == 1
    # Once it is done, a retry gets its answer.
    again = await client.post("/keys", json=body, headers=headers)
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == made[0].json()


async def test_if_a_create_fails_then_a_retry_runs_it_and_racing_retries_still_make_one_key(
    client: httpx.AsyncClient, manager: KeyManager
) -> None:
    headers = {**await writer(manager), "Idempotency-Key": "after-refusal"}
    refused = await client.post("/keys", json={"name": "zap", "scopes": []}, headers=headers)
    assert refused.status_code == 400, refused.text
    body = {"name": "zap", "scopes": ["contacts:read"]}
    answers = await asyncio.gather(
        *(client.post("/keys", json=body, headers=headers) for _ in range(RETRIES))
    )
    assert {a.status_code for a in answers} <= {201, 409}, [a.text for a in answers]
    assert await names(manager, "zap") == 1


async def test_a_request_whose_mark_is_gone_neither_removes_nor_overwrites_the_next_ones() -> None:
    store = MemoryStore()

    def guard() -> Idempotency:
        return Idempotency(
            store, caller_id="abc", caller_token="ak_token", idempotency_key="k", request=b"{}"
        )

    first = guard()
    assert await first.begin() is None
    store._once.clear()  # as when the first's mark expires: its request ran over a minute
    second = guard()
    assert await second.begin() is None
    await first.abandon()
    with pytest.raises(Conflict):
        await guard().begin()
    await first.keep(201, b'{"n": 1}')
    with pytest.raises(Conflict):
        await guard().begin()
    await second.keep(201, b'{"n": 2}')
    replay = await guard().begin()
    assert replay is not None
    assert replay.body == b'{"n": 2}'


async def test_after_a_failed_request_the_next_one_runs() -> None:
    store = MemoryStore()

    def guard() -> Idempotency:
        return Idempotency(
            store, caller_id="abc", caller_token="ak_token", idempotency_key="k", request=b"{}"
        )

    failed = guard()
    assert await failed.begin() is None
    await failed.abandon()
    assert await store.peek_once(failed._slot) is None
    assert await guard().begin() is None


def test_a_store_without_the_atomic_primitives_says_so() -> None:
    class OwnStore(MemoryStore):
        replace_once = KeyStore.replace_once

    assert OwnStore().keeps_one_time_values()
    assert not OwnStore().compares_one_time_values()
    assert MemoryStore().compares_one_time_values()
    # The management API refuses it when made, naming what it lacks (not a 500 per POST).
    with pytest.raises(ConfigurationError, match="replace_once"):
        ManagementAPI(KeyManager(OwnStore()))
