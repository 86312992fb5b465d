"""The test servers close without leaving a socket to the garbage collector.

A server closed as it accepts a connection used to leave that connection's socket open and
unowned (see tests/listeners.py): its `ResourceWarning` then failed whichever test ran when
a collection found it. Here a server closes at each moment of a connection's acceptance, and
a proxy is cut again and again while clients connect to it without pause; a collection
afterwards finds nothing left open.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable

from tests.listeners import close_server
from tests.tcpproxy import TcpProxy

ROUNDS = 20
CLIENTS = 20


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while line := await reader.readline():
            writer.write(line)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _client(port: int, stop: asyncio.Event) -> None:
    """Connect, exchange a line or two, close; again until told to stop."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.001)
            continue
        try:
            for _ in range(random.randint(0, 2)):
                writer.write(b"ping\n")
                await writer.drain()
                await asyncio.wait_for(reader.readline(), 1.0)
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


@contextlib.asynccontextmanager
async def _storm(port: int) -> AsyncIterator[None]:
    stop = asyncio.Event()
    clients = [asyncio.create_task(_client(port, stop)) for _ in range(CLIENTS)]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*clients, return_exceptions=True)


async def _unclosed_after(rounds: Callable[[], Awaitable[None]]) -> list[str]:
    """The `ResourceWarning`s a collection raises after `rounds` ran."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        await rounds()
        gc.collect()
    return [str(warning.message) for warning in caught if warning.category is ResourceWarning]


async def test_a_server_closed_as_it_accepts_a_connection_leaves_no_socket_open() -> None:
    # Closed after each number of turns of the loop that a connection takes to be accepted
    # and made a transport: one of them falls between the two.
    async def rounds() -> None:
        for turns in range(8):
            server = await asyncio.start_server(_echo, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            connecting = asyncio.create_task(asyncio.open_connection("127.0.0.1", port))
            for _ in range(turns):
                await asyncio.sleep(0)
            await close_server(server)
            with contextlib.suppress(OSError):
                _, writer = await connecting
                writer.close()
                await writer.wait_closed()

    assert await _unclosed_after(rounds) == []


async def test_a_proxy_cut_while_clients_connect_leaves_no_socket_open() -> None:
    target = await asyncio.start_server(_echo, "127.0.0.1", 0)
    try:

        async def rounds() -> None:
            for _ in range(ROUNDS):
                proxy = TcpProxy("127.0.0.1", target.sockets[0].getsockname()[1]).start()
                try:
                    async with _storm(proxy.port):
                        for _ in range(3):
                            await asyncio.sleep(random.random() * 0.02)
                            await asyncio.to_thread(proxy.sever)
                            await asyncio.to_thread(proxy.restore)
                finally:
                    await asyncio.to_thread(proxy.close)

        assert await _unclosed_after(rounds) == []
    finally:
        await close_server(target)
