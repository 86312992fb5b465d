"""A webhook receiver for tests: a bare HTTP/1.1 server that records what it is sent.

It answers every POST with 200 (or with `status`), keeps each request's headers and body
in arrival order, and can be stopped and started again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from tests.listeners import close_server


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    port: int
    status: int = 200
    received: list[Received] = field(default_factory=list)
    _server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await close_server(server)

    async def wait_for(self, count: int) -> None:
        """Return once `count` requests arrived (the caller bounds the wait)."""
        while len(self.received) < count:  # noqa: ASYNC110 - a test helper's poll
            await asyncio.sleep(0.05)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, value = line.split(":", 1)
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.received.append(Received(headers, body))
                writer.write(f"HTTP/1.1 {self.status} X\r\ncontent-length: 0\r\n\r\n".encode())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
