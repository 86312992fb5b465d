"""One endpoint's slow receiver holds none of another endpoint's deliveries.

Each endpoint has at most `DeliveryOptions.per_endpoint` deliveries in flight; a claim
takes the endpoints round robin (each one's first in line, then each one's second, ...),
and a round never waits for one endpoint's answers before serving the next's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta

import pytest

from apikeys import Hasher, KeyManager
from apikeys.stores import KeyStore
from apikeys.stores.contract import WebhookStore
from apikeys.testing import TEST_PEPPER
from apikeys.types import utcnow
from apikeys.webhooks import Deliverer, DeliveryOptions
from apikeys.webhooks.admin import add_endpoint
from tests.conftest import STORES
from tests.listeners import close_server
from tests.pgbouncer import free_port
from tests.webhooks.receiver import Receiver


@pytest.fixture(
    params=[
        STORES[0],
        pytest.param("sqlite", marks=pytest.mark.sqlite, id="sqlite"),
        pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
        *STORES[3:4],
    ]
)
def store_kind(request: pytest.FixtureRequest) -> str:
    """Memory, SQLite, PostgreSQL and Redis (`store` in tests/conftest.py makes each)."""
    return str(request.param)


@pytest.fixture
async def manager(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(store, hasher=Hasher(pepper=TEST_PEPPER), webhooks=False) as made:
        yield made


def hooks_of(store: KeyStore) -> WebhookStore:
    hooks = store.webhooks()
    assert hooks is not None
    return hooks


@dataclass
class HeldReceiver:
    """Reads each request and answers none until `release` is set."""

    port: int
    release: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: int = 0
    open: int = 0
    most_open: int = 0
    _server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def stop(self) -> None:
        self.release.set()
        server, self._server = self._server, None
        if server is not None:
            await close_server(server)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                self.arrived += 1
                self.open += 1
                self.most_open = max(self.most_open, self.open)
                try:
                    await self.release.wait()
                finally:
                    self.open -= 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


@pytest.fixture
async def held() -> AsyncIterator[HeldReceiver]:
    started = HeldReceiver(free_port())
    await started.start()
    try:
        yield started
    finally:
        await started.stop()


async def test_a_receiver_that_never_answers_holds_up_no_other_workspaces_deliveries(
    store: KeyStore, manager: KeyManager, held: HeldReceiver, receiver: Receiver
) -> None:
    hooks = hooks_of(store)
    await add_endpoint(hooks, held.url, workspace="slow")
    await add_endpoint(hooks, receiver.url, workspace="fast")
    for number in range(30):
        await manager.create(name=f"slow{number}", full_access=True, workspace="slow")
    for number in range(3):
        await manager.create(name=f"fast{number}", full_access=True, workspace="fast")
    assert DeliveryOptions().per_endpoint == 4  # the default docs/webhooks.md states
    options = DeliveryOptions(poll_interval=0.02, timeout=300, lease=600, per_endpoint=4)
    deliverer = Deliverer(hooks, options)
    try:
        deliverer.start()
        async with asyncio.timeout(30):
            await receiver.wait_for(3)
        # The slow receiver has answered nothing yet, and holds no more than its share.
        assert not held.release.is_set()
        assert 1 <= held.arrived <= 4
        assert held.most_open <= 4
        held.release.set()
        async with asyncio.timeout(60):
            while await hooks.deliveries(status="pending"):  # noqa: ASYNC110 - polls
                await asyncio.sleep(0.05)
        assert held.arrived == 30
        assert held.most_open <= 4
        names = [json.loads(item.body)["data"]["key"]["name"] for item in receiver.received]
        assert sorted(names) == ["fast0", "fast1", "fast2"]  # three keys: any order
    finally:
        await deliverer.aclose()


async def test_a_claim_takes_endpoints_round_robin_within_their_room(
    store: KeyStore, manager: KeyManager
) -> None:
    hooks = hooks_of(store)
    busy = await add_endpoint(hooks, "http://127.0.0.1:9/busy", workspace="busy")
    quiet = await add_endpoint(hooks, "http://127.0.0.1:9/quiet", workspace="quiet")
    for number in range(6):
        await manager.create(name=f"busy{number}", full_access=True, workspace="busy")
    for number in range(2):
        await manager.create(name=f"quiet{number}", full_access=True, workspace="quiet")
    await hooks.take(utcnow())
    now = utcnow()
    lease = now + timedelta(minutes=1)
    room = {busy.id: 3, quiet.id: 3}
    first = await hooks.claim("one", now, lease, 4, room=room)
    # Each endpoint's first, then each one's second (which endpoint goes first within a
    # turn is the store's: Redis reads them by due time, then id).
    turns = [{item.webhook_id for item in first[:2]}, {item.webhook_id for item in first[2:]}]
    assert turns == [{busy.id, quiet.id}, {busy.id, quiet.id}]
    # Room counts per claim: the caller says what it has left; an endpoint not named
    # (or with no room left) is not claimed for.
    second = await hooks.claim("two", now, lease, 10, room={busy.id: 1})
    assert [item.webhook_id for item in second] == [busy.id]
    assert await hooks.claim("three", now, lease, 10, room={busy.id: 0}) == []
    rest = await hooks.claim("four", now, lease, 10)
    assert [item.webhook_id for item in rest] == [busy.id] * 3
    names = [
        json.loads(item.body)["data"]["key"]["name"]
        for item in (*first, *second, *rest)
        if item.webhook_id == busy.id
    ]
    assert sorted(names) == [f"busy{number}" for number in range(6)]  # each once
