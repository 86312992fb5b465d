"""A TCP forwarder in front of PostgreSQL or Redis that a test can cut, hold and count.

```python
with TcpProxy.to_url(postgres_url) as proxy:
    store = store_from_url(proxy.url(postgres_url))
    proxy.sever()     # every connection dropped (RST), new ones refused: the server is "down"
    proxy.restore()   # listening again on the same port
    proxy.pause()     # data is read but held, not forwarded: requests hang "mid-flight"
    proxy.wait_for_held_data()
    proxy.hold_replies_after(b"EXEC")  # the server gets the command, the client no answer
    proxy.round_trips # request/reply exchanges seen, over all connections
```

Given a `notifications` pattern, it tells a cache's notification connection apart from the
others by what the client sends on it (`LISTEN` on PostgreSQL, `SUBSCRIBE` or `CLIENT
TRACKING` on Redis: `NOTIFICATIONS[scheme]`), and can fault those connections alone:

```python
proxy = TcpProxy("127.0.0.1", 5432, notifications=NOTIFICATIONS["postgresql"]).start()
proxy.black_hole_notifications()  # their bytes held both ways, connections kept open
proxy.cut_notifications()         # reset, and so is each new one as soon as it shows itself
proxy.restore()                   # both undone; held bytes are forwarded
proxy.drop_notices()              # PostgreSQL: NOTIFY messages to them lost, the rest flows
```

It runs its own event loop in a daemon thread, so it serves sync and async code alike, in
this process or in servers started as subprocesses, and its methods block until done.

A round trip is counted, per connection, when the server answers after the client has
sent something: pipelined commands sent in one go count once, as they cost one wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import re
import threading
import time
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Literal, Self, TypeVar
from urllib.parse import urlsplit, urlunsplit

from tests.listeners import close_server

__all__ = ["NOTIFICATIONS", "TcpProxy", "rewrite_url"]

_T = TypeVar("_T")
_DEFAULT_PORTS = {"postgresql": 5432, "postgres": 5432, "redis": 6379, "rediss": 6379}

_LISTEN = re.compile(rb"(?i)\blisten\s")
_SUBSCRIBE = re.compile(rb"(?i)\r\n[ps]?subscribe\r\n|\r\ntracking\r\n")
NOTIFICATIONS: dict[str, re.Pattern[bytes]] = {
    "postgresql": _LISTEN,
    "postgres": _LISTEN,
    "redis": _SUBSCRIBE,
    "rediss": _SUBSCRIBE,
}
"""What a client sends on a notification connection, by URL scheme: `LISTEN` (PostgreSQL),
`SUBSCRIBE`/`PSUBSCRIBE`/`SSUBSCRIBE` or `CLIENT TRACKING` (Redis, RESP-encoded)."""
# Bytes of the previous read kept to find a pattern split across two reads.
_TAIL = 64


def rewrite_url(url: str, host: str, port: int) -> str:
    """`url` with its host and port replaced, user, password, path and query kept."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class _Link:
    """One client connection and its upstream connection."""

    __slots__ = (
        "awaiting_reply",
        "client",
        "notifications",
        "partial",
        "seen",
        "tasks",
        "upstream",
    )

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream = upstream
        self.tasks: list[asyncio.Task[None]] = []
        self.awaiting_reply = False
        self.notifications = False  # the client showed it is a notification connection
        self.seen = b""  # the end of what the client sent last
        self.partial = b""  # PostgreSQL: the start of a server message not yet whole

    def abort(self) -> None:
        for writer in (self.client, self.upstream):
            writer.transport.abort()


class TcpProxy:
    """Forwards `<host>:<port>` to `target_host:target_port` until told otherwise.

    `host` is 127.0.0.1 unless given (e.g. the root side of a network namespace's link);
    `notifications` is the pattern that marks a notification connection (`NOTIFICATIONS`).
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        host: str = "127.0.0.1",
        notifications: re.Pattern[bytes] | None = None,
    ) -> None:
        self.target = (target_host, target_port)
        self.host = host
        self.port = 0
        self.round_trips = 0
        self.connections = 0
        self.notification_connections = 0  # connections that showed themselves as such
        self.notifications_cut = 0  # of those, how many were reset by `cut_notifications`
        self._notifications = notifications
        self._notices_flowing: asyncio.Event | None = None
        self._cut_notices = False
        self._drop_notices = False
        self._drop_channel: bytes | None = None
        self.notices_dropped = 0  # PostgreSQL NotificationResponse messages not delivered
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        # Set while data flows: from clients (requests) and from the server (replies).
        self._requests: asyncio.Event | None = None
        self._replies: asyncio.Event | None = None
        self._marker: bytes | None = None
        self._held = threading.Event()

    @classmethod
    def to_url(cls, url: str, *, host: str = "127.0.0.1") -> TcpProxy:
        """A proxy (not yet started) on `host` to the host and port of `url`, which knows
        the notification connections of `url`'s scheme."""
        parts = urlsplit(url)
        scheme = parts.scheme.split("+")[0]
        port = parts.port or _DEFAULT_PORTS.get(scheme)
        if port is None:
            raise ValueError(f"no port in {scheme}:// URL")
        return cls(
            parts.hostname or "127.0.0.1",
            port,
            host=host,
            notifications=NOTIFICATIONS.get(scheme),
        )

    def url(self, url: str) -> str:
        """`url` pointed at this proxy instead of its own host and port."""
        return rewrite_url(url, self.host, self.port)

    @property
    def listening(self) -> bool:
        return self._server is not None

    @property
    def active_connections(self) -> int:
        return len(self._links)

    @property
    def active_notification_connections(self) -> int:
        return sum(link.notifications for link in self._links)

    # -- life cycle ------------------------------------------------------------------------

    def start(self) -> Self:
        if self._loop is not None:
            raise RuntimeError("the proxy is already started")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="tcpproxy", daemon=True)
        self._thread.start()
        self._requests = self._call(self._make_event())
        self._replies = self._call(self._make_event())
        self._notices_flowing = self._call(self._make_event())
        self._call(self._listen())
        return self

    def close(self) -> None:
        """Drop everything and stop the proxy's thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            self._call(self._shut_down())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        if not loop.is_running():
            loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- faults ----------------------------------------------------------------------------

    def sever(self) -> None:
        """Reset every connection and stop listening: new connections are refused."""
        self._call(self._sever())

    def restore(self) -> None:
        """Listen again on the same port and forward data again (undoes `pause` and the
        notification faults too)."""
        self._call(self._restore())

    def black_hole_notifications(self) -> None:
        """Hold the bytes of every notification connection, both ways, now and later.

        The connections stay open and nothing on them is answered, as behind a firewall
        that drops their packets; a new one is held from the moment it shows itself (its
        `LISTEN` or `SUBSCRIBE` never reaches the server). Other connections flow.
        """
        self._require_pattern()
        self._held.clear()
        self._call(self._set_notices(flowing=False, cut=False))

    def cut_notifications(self) -> None:
        """Reset every notification connection, and each new one as soon as it shows itself
        (before what showed it reaches the server). Other connections flow."""
        self._require_pattern()
        self._call(self._set_notices(flowing=True, cut=True))

    def drop_notices(self, channel: str | None = None) -> None:
        """PostgreSQL only: lose the notifications (`NOTIFY`) sent to a listening connection
        on `channel` (on every channel if None), now and later, and forward everything else
        on it, as PgBouncer in transaction mode does to a client that is not linked to a
        server connection when another session notifies."""
        if self._notifications is not _LISTEN:
            raise RuntimeError("drop_notices is for a proxy in front of PostgreSQL")
        self._call(self._set_drop(True, channel))

    def _require_pattern(self) -> None:
        if self._notifications is None:
            raise RuntimeError("this proxy was not told how notification connections look")

    def pause(self, direction: Literal["both", "requests", "replies"] = "both") -> None:
        """Keep connections open but hold data: whatever is sent now waits, unanswered.

        `requests` holds what clients send (the server never sees it), `replies` what the
        server sends (it did the work; the client never learns of it).
        """
        self._held.clear()
        self._call(self._set_flowing(direction, False))

    def hold_replies_after(self, marker: bytes) -> None:
        """Hold every reply from the moment a client sends data containing `marker`.

        E.g. `b"EXEC"` (Redis) or `b"COMMIT;"` (PostgreSQL, as asyncpg sends it): the server
        applies the transaction, and the client is left waiting for the answer. `marker` must
        arrive in one read, which it does for a command sent in one write.
        """
        self._held.clear()
        self._call(self._arm(marker))

    def resume(self) -> None:
        """Forward the held data and everything after it."""
        self._call(self._set_flowing("both", True))

    def wait_for_held_data(self, timeout: float = 5.0) -> bool:
        """Block until data is being held (a request, or its answer, is now mid-flight)."""
        return self._held.wait(timeout)

    def reset_counts(self) -> None:
        self.round_trips = 0
        self.connections = 0

    # -- inside the proxy's loop -----------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, _T], timeout: float = 10.0) -> _T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("the proxy is not started")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @staticmethod
    async def _make_event() -> asyncio.Event:
        event = asyncio.Event()
        event.set()
        return event

    async def _set_flowing(self, direction: str, flowing: bool) -> None:
        assert self._requests is not None
        assert self._replies is not None
        events = {
            "both": (self._requests, self._replies),
            "requests": (self._requests,),
            "replies": (self._replies,),
        }[direction]
        for event in events:
            if flowing:
                event.set()
            else:
                event.clear()
        if flowing:
            self._marker = None

    async def _arm(self, marker: bytes) -> None:
        self._marker = marker

    async def _set_drop(self, drop: bool, channel: str | None = None) -> None:
        self._drop_notices = drop
        self._drop_channel = None if channel is None else channel.encode() + b"\0"

    async def _set_notices(self, *, flowing: bool, cut: bool) -> None:
        assert self._notices_flowing is not None
        self._cut_notices = cut
        if flowing:
            self._notices_flowing.set()
        else:
            self._notices_flowing.clear()
        if cut:
            for link in [link for link in self._links if link.notifications]:
                self.notifications_cut += 1
                self._links.discard(link)
                link.abort()

    def _without_notices(self, link: _Link, data: bytes) -> bytes:
        """Whole PostgreSQL messages of `data` (the rest waits for its end), less the
        NotificationResponses ('A') while notices are dropped.

        A listening connection is framed from its `LISTEN` on: the server has answered
        everything before it, so its next byte starts a message.
        """
        buffer = link.partial + data
        whole = bytearray()
        start = 0
        while len(buffer) - start >= 5:
            end = start + 1 + int.from_bytes(buffer[start + 1 : start + 5], "big")
            if end > len(buffer):
                break
            # NotificationResponse: 'A', length, the sender's pid, channel, payload.
            if (
                buffer[start : start + 1] == b"A"
                and self._drop_notices
                and (
                    self._drop_channel is None
                    or buffer.startswith(self._drop_channel, start + 9, end)
                )
            ):
                self.notices_dropped += 1
            else:
                whole += buffer[start:end]
            start = end
        link.partial = buffer[start:]
        return bytes(whole)

    async def _listen(self) -> None:
        # The same port again after a sever: retry briefly while the old socket lets go.
        deadline = time.monotonic() + 5.0
        while True:
            try:
                self._server = await asyncio.start_server(
                    self._accept, self.host, self.port, reuse_address=True
                )
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _sever(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            # Connections it accepts meanwhile see `_server` is None and are dropped.
            await close_server(server)
        links, self._links = self._links, set()
        tasks = [task for link in links for task in link.tasks]
        for link in links:
            link.abort()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _shut_down(self) -> None:
        """Sever, then let the connections accepted meanwhile finish: each one still
        connecting upstream closes both its ends once it sees the proxy severed. A loop
        stopped under them would leave their sockets to the garbage collector (a
        `ResourceWarning` in whichever test runs then)."""
        await self._sever()
        # Until none is left: a connection the listener took just before it closed becomes
        # a task (`_accept`) only once its transport is made, after the first look.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while True:
            await asyncio.sleep(0)
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            if not others:
                return
            if loop.time() >= deadline:
                for task in others:
                    task.cancel()
                await asyncio.gather(*others, return_exceptions=True)
                return
            await asyncio.wait(others, timeout=deadline - loop.time())

    async def _restore(self) -> None:
        await self._set_flowing("both", True)
        await self._set_notices(flowing=True, cut=False)
        self._drop_notices = False
        if self._server is None:
            await self._listen()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server = self._server
        if server is None:  # taken by a listener closed since: never linked
            writer.transport.abort()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        except asyncio.CancelledError:  # the proxy shut down while this one connected
            writer.transport.abort()
            raise
        if server is not self._server:
            # Severed while connecting upstream: this connection belongs to the old server.
            writer.transport.abort()
            upstream_writer.transport.abort()
            return
        self.connections += 1
        link = _Link(writer, upstream_writer)
        self._links.add(link)
        link.tasks = [
            asyncio.create_task(self._pump(reader, upstream_writer, link, from_client=True)),
            asyncio.create_task(self._pump(upstream_reader, writer, link, from_client=False)),
        ]

    async def _pump(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        link: _Link,
        *,
        from_client: bool,
    ) -> None:
        flowing = self._requests if from_client else self._replies
        notices = self._notices_flowing
        assert flowing is not None
        assert notices is not None
        try:
            while data := await source.read(65536):
                if from_client and self._notifications is not None and not link.notifications:
                    seen = link.seen + data
                    if self._notifications.search(seen):
                        link.notifications = True
                        self.notification_connections += 1
                        if self._cut_notices:
                            self.notifications_cut += 1
                            break
                    link.seen = seen[-_TAIL:]
                if link.notifications and not from_client and self._notifications is _LISTEN:
                    data = self._without_notices(link, data)
                    if not data:
                        continue
                if from_client:
                    link.awaiting_reply = True
                    if self._marker is not None and self._marker in data:
                        self._marker = None
                        assert self._replies is not None
                        self._replies.clear()
                elif link.awaiting_reply:
                    link.awaiting_reply = False
                    self.round_trips += 1
                while not flowing.is_set() or (link.notifications and not notices.is_set()):
                    self._held.set()
                    await (notices if flowing.is_set() else flowing).wait()
                if link.notifications and self._cut_notices:
                    break
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            # One side gone: close both, as a server that drops a connection would.
            link.abort()
            self._links.discard(link)
