"""Receivers that answer slowly, or with a body that never ends: a delivery's attempt ends
within the `timeout` of `DeliveryOptions` (well inside its lease, as docs/webhooks.md says),
and only the answer's status is read, never its body."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from apikeys import Hasher, KeyManager
from apikeys.stores import KeyStore
from apikeys.stores.contract import WebhookStore
from apikeys.webhooks import Deliverer, DeliveryOptions
from apikeys.webhooks.admin import add_endpoint
from apikeys.webhooks.model import Delivery
from tests.conftest import STORES
from tests.listeners import close_server
from tests.pgbouncer import free_port

# A second to answer; a lease far longer, as by default (10 s and 60 s).
# The receivers here listen on 127.0.0.1: internal targets are allowed explicitly.
OPTIONS = DeliveryOptions(
    poll_interval=0.02, retry_delays=(60,), timeout=1, lease=30, allow_private_targets=True
)

Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture(
    params=[
        STORES[0],
        pytest.param("sqlite", marks=pytest.mark.sqlite, id="sqlite"),
        pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
        *STORES[3:],
    ]
)
def store_kind(request: pytest.FixtureRequest) -> str:
    """The stores that keep webhooks (`store` in tests/conftest.py makes each)."""
    return str(request.param)


@pytest.fixture
async def manager(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(
        store, hasher=Hasher(pepper=b"L8dw49pa41XlgoBNkvoeuME4lzC2vZHAO-p4QCm4Kiw"), webhooks=False
    ) as made:
        yield made


class HostileReceiver:
    """An HTTP server that reads each request whole, then answers with `answer`."""

    def __init__(self, answer: Answer) -> None:
        self.port = free_port()
        self.requests = 0
        self._answer = answer
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    async def __aenter__(self) -> HostileReceiver:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        await close_server(self._server)
        for writer in self._writers:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        try:
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                self.requests += 1
                await self._answer(writer)
        finally:
            # Also when cancelled: a connection accepted as the receiver closed is closed here.
            writer.close()


async def _headers_then_silence(writer: asyncio.StreamWriter) -> None:
    """200, announcing a terabyte of body, and then not a byte of it."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000000000\r\n\r\n")
    await writer.drain()
    await asyncio.Event().wait()


async def _headers_a_byte_at_a_time(writer: asyncio.StreamWriter) -> None:
    """A status line, then one byte of a header every 50 ms, forever: each read of the
    client gets a byte well within any timeout of one read."""
    writer.write(b"HTTP/1.1 200 OK\r\nx-slow: ")
    while True:
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"x")


async def _one_attempt(store: KeyStore, manager: KeyManager, answer: Answer) -> Delivery:
    """Deliver one event to a receiver answering with `answer`; the delivery after the
    first attempt has ended."""
    hooks: WebhookStore | None = store.webhooks()
    assert hooks is not None
    async with HostileReceiver(answer) as receiver:
        await add_endpoint(hooks, receiver.url)
        await manager.create(name="a", full_access=True)
        deliverer = Deliverer(hooks, OPTIONS)
        try:
            # A guard against a hang, not a measure: an attempt ends within OPTIONS.timeout.
            async with asyncio.timeout(30):
                while receiver.requests == 0:
                    await deliverer.run_once()
                    await asyncio.sleep(0.02)
        finally:
            await deliverer.aclose()
    (delivery,) = await hooks.deliveries()
    return delivery


async def test_a_2xx_is_delivered_without_reading_the_body_that_follows(
    store: KeyStore, manager: KeyManager
) -> None:
    delivery = await _one_attempt(store, manager, _headers_then_silence)
    assert (delivery.status, delivery.last_status, delivery.attempts) == ("delivered", 200, 1)


async def test_a_receiver_that_answers_a_byte_at_a_time_is_cut_off_at_the_timeout(
    store: KeyStore, manager: KeyManager
) -> None:
    delivery = await _one_attempt(store, manager, _headers_a_byte_at_a_time)
    assert (delivery.status, delivery.attempts, delivery.last_status) == ("pending", 1, None)
    assert delivery.last_error == "TimeoutError"


async def test_a_redirect_is_not_followed_it_is_a_failed_attempt(
    store: KeyStore, manager: KeyManager
) -> None:
    async def never(writer: asyncio.StreamWriter) -> None:
        raise AssertionError("a redirect was followed")

    async with HostileReceiver(never) as elsewhere:

        async def redirect(writer: asyncio.StreamWriter) -> None:
            writer.write(
                f"HTTP/1.1 307 Temporary Redirect\r\nlocation: {elsewhere.url}\r\n"
                "content-length: 0\r\n\r\n".encode()
            )
            await writer.drain()

        delivery = await _one_attempt(store, manager, redirect)
        assert elsewhere.requests == 0
    assert (delivery.status, delivery.last_status, delivery.last_error) == (
        "pending",
        307,
        "HTTP 307",
    )
