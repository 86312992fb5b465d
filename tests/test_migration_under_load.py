"""A djangorestframework-api-key project (made by that package) migrated to apikeys while its
clients keep calling with `Authorization: Api-Key <key>`: no request fails across the switch,
and a key revoked in apikeys afterwards is refused by both services."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from apikeys import APIKeyMiddleware, KeyManager
from apikeys.hashing import Hasher
from apikeys.importing import ForeignKey, import_keys, read_drf, write_revocations
from apikeys.stores.memory import MemoryStore
from apikeys.types import Receive, Scope, Send
from tests.conftest import TEST_PEPPER
from tests.drf_databases import (
    drf_accepts,
    drf_database,  # noqa: F401 - the `drf` fixture
)

CLIENTS = 8


async def _answer(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body})


class OldService:
    """The old service's check of `Api-Key <key>`, as drf-api-key makes it for its current
    hashes (`sha512$$`, a SHA-512 of the whole key): the row of the key's prefix, not
    revoked, its hash matching. Rows read once, at start (the real check, on the table as
    it is then, is `drf_accepts`)."""

    def __init__(self, rows: list[Any]) -> None:
        self.rows = {row.prefix: row for row in rows if isinstance(row, ForeignKey)}
        self.served = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        value = dict(scope["headers"]).get(b"authorization", b"").decode()
        scheme, _, key = value.partition(" ")
        row = self.rows.get(key.partition(".")[0])
        digest = "sha512$$" + hashlib.sha512(key.encode()).hexdigest()
        if scheme != "Api-Key" or row is None or row.revoked:
            await _answer(send, 403, b"old: refused")
            return
        if not hmac.compare_digest(row.hashed, digest):
            await _answer(send, 403, b"old: refused")
            return
        self.served += 1
        await _answer(send, 200, b"old")


class Switch:
    """The load balancer: every request goes to `target`, which the migration flips."""

    def __init__(self, target: Any) -> None:
        self.target = target

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.target(scope, receive, send)


class NewApp:
    def __init__(self) -> None:
        self.served = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.served += 1
        await _answer(send, 200, b"new")


@pytest.fixture
async def manager() -> AsyncIterator[KeyManager]:
    async with KeyManager(MemoryStore(), hasher=Hasher(TEST_PEPPER)) as key_manager:
        yield key_manager


async def test_migrated_under_load_without_a_failed_request_then_revoke_reaches_both(
    manager: KeyManager, drf: tuple[str, dict[str, str]]
) -> None:
    url, keys = drf
    key = keys["active"]
    old = OldService(await read_drf(url))
    new_app = NewApp()
    # drf-api-key limits nothing: the new service's default limit is set for the load.
    new = APIKeyMiddleware(
        new_app, manager=manager, legacy_schemes=("Api-Key",), rate_limit="1000000/minute"
    )
    switch = Switch(old)
    failures: list[tuple[int, bytes]] = []
    stop = asyncio.Event()

    async def client() -> None:
        transport = httpx.ASGITransport(app=switch)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            while not stop.is_set():
                answer = await http.get("/contacts", headers={"Authorization": f"Api-Key {key}"})
                if answer.status_code != 200:
                    failures.append((answer.status_code, answer.content))
                # A breath between requests: clients that never wait for a timer starve
                # the import's database reads of the event loop (46 s instead of 1 on SQLite).
                await asyncio.sleep(0.001)

    clients = [asyncio.create_task(client()) for _ in range(CLIENTS)]
    try:
        await asyncio.sleep(0.2)
        # Step 1 while the old service serves; step 2: the traffic moves.
        report = await import_keys(
            manager, await read_drf(url), source="drf-api-key", workspace="acme", full_access=True
        )
        assert report.refused == []
        switch.target = new
        await asyncio.sleep(0.3)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert failures == []
    assert old.served > 0
    assert new_app.served > 0

    # A revoke in apikeys, written back: both services refuse the key.
    record = await manager.verify(key)
    await manager.revoke(record.id)
    assert (await write_revocations(manager, url, workspace="acme")).revoked == [record.id]
    transport = httpx.ASGITransport(app=new)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
        refused = await http.get("/contacts", headers={"Authorization": f"Api-Key {key}"})
    assert refused.status_code == 401
    assert refused.json()["code"] == "key_revoked"
    assert drf_accepts(url, [key]) == [False]
    await manager.flush()
    today = (await manager.usage(record.id, days=1))[-1]
    assert today.legacy_scheme == new_app.served
