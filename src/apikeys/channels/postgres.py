"""Invalidation over PostgreSQL LISTEN/NOTIFY: the SQL store's channel on PostgreSQL.

- The store sends each notice with `pg_notify` inside the transaction of the change, so
  PostgreSQL delivers it exactly when the change commits, and never without it.
- Each process keeps one connection that listens on the store's notice channel, on a probe
  channel of its own and on an acknowledgement channel of its own.
- A probe is a `pg_notify` on the process's own probe channel. PostgreSQL delivers the
  notifications of different transactions in the order the transactions committed, so the
  probe comes back after every notice committed before it was sent. asyncpg hands
  notifications to their callbacks in the order they arrive.
- The registry of readers is the table `<table>_readers` (reader id, when it runs out in
  seconds since the epoch), compared with the server's `clock_timestamp()`.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from apikeys.channels.base import Channel, ChannelError, parse_notice

__all__ = ["PostgresChannel", "notice_channel_name"]


def _base(table_name: str) -> str:
    # Channel names are identifiers (at most 63 bytes): a short digest of the table's name.
    return "apikeys_" + hashlib.sha256(table_name.encode()).hexdigest()[:12]


def notice_channel_name(table_name: str) -> str:
    """The NOTIFY channel the notices of the keys table `table_name` travel on."""
    return _base(table_name) + "_n"


class PostgresChannel(Channel):
    """LISTEN/NOTIFY for the keys table `table_name` (see the module doc).

    `connect_args` / `connect_kwargs` are what `asyncpg.connect` takes (the SQL store passes
    its own connection settings); `readers_table` is the registry's table.
    """

    def __init__(
        self,
        connect_args: tuple[Any, ...],
        connect_kwargs: dict[str, Any],
        *,
        table_name: str,
        readers_table: str,
        prepare: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__()
        self._prepare = prepare
        self._args = connect_args
        self._kwargs = connect_kwargs
        base = _base(table_name)
        self._notices = base + "_n"
        self._base = base
        self._table_name = table_name
        self._readers_table = readers_table
        self._connection: Any = None
        self._probes: dict[str, asyncio.Future[None]] = {}
        # One statement at a time on the listening connection (asyncpg refuses overlaps):
        # probes, registrations, acknowledgements and registry reads take turns.
        self._turn = asyncio.Lock()

    def __repr__(self) -> str:
        return f"PostgresChannel(channel={self._notices!r})"

    def bind(self) -> None:
        super().bind()
        self._turn = asyncio.Lock()

    async def connect(self, ident: str, on_notice: Callable[[str], None]) -> None:
        import asyncpg

        self.ident = ident
        connection = await asyncpg.connect(*self._args, **self._kwargs)
        probes, acks = f"{self._base}_p{ident}", f"{self._base}_a{ident}"

        def notice(_: Any, __: int, ___: str, payload: str) -> None:
            on_notice(payload)

        def probe(_: Any, __: int, ___: str, payload: str) -> None:
            future = self._probes.pop(payload, None)
            if future is not None and not future.done():
                future.set_result(None)

        def ack(_: Any, __: int, ___: str, payload: str) -> None:
            reader, _sep, notice_text = payload.partition("|")
            self.acknowledged(notice_text, reader)

        def terminated(_: Any) -> None:
            for future in self._probes.values():
                if not future.done():
                    future.set_exception(ChannelError("the listening connection was lost"))
            self._probes.clear()

        try:
            await connection.add_listener(self._notices, notice)
            await connection.add_listener(probes, probe)
            await connection.add_listener(acks, ack)
            connection.add_termination_listener(terminated)
        except BaseException:
            connection.terminate()
            raise
        self._connection = connection
        self._probe_channel = probes

    def _live(self) -> Any:
        connection = self._connection
        if connection is None or connection.is_closed():
            raise ChannelError("not listening")
        return connection

    async def _statement(self, run: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """One statement on the listening connection, in turn, and never cut off midway.

        A caller that gives up (a probe past its time) stops waiting, but the statement runs
        to its end: cancelling an asyncpg statement leaves the connection busy, and the
        acknowledgement queued behind it would fail, costing a writer a whole lease.
        """

        async def in_turn() -> Any:
            async with self._turn:
                return await run(*args)

        return await asyncio.shield(in_turn())

    async def probe(self) -> None:
        connection = self._live()
        token = secrets.token_hex(8)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._probes[token] = future
        try:
            await self._statement(
                connection.execute, "SELECT pg_notify($1, $2)", self._probe_channel, token
            )
            await future
        finally:
            self._probes.pop(token, None)

    async def register(self, ttl: float) -> None:
        import asyncpg

        try:
            await self._register(ttl)
        except asyncpg.UndefinedTableError:
            if self._prepare is None:
                raise
            await self._prepare()  # the store's tables, the registry among them
            await self._register(ttl)

    async def _register(self, ttl: float) -> None:
        connection = self._live()
        await self._statement(
            connection.execute,
            f'INSERT INTO "{self._readers_table}" (reader_id, expires_at) '  # noqa: S608
            "VALUES ($1, extract(epoch FROM clock_timestamp()) + $2) "
            "ON CONFLICT (reader_id) DO UPDATE SET expires_at = excluded.expires_at",
            self.ident,
            ttl,
        )

    async def readers(self) -> set[str]:
        connection = self._live()
        rows = await self._statement(
            connection.fetch,
            f'SELECT reader_id FROM "{self._readers_table}" '  # noqa: S608
            "WHERE expires_at > extract(epoch FROM clock_timestamp())",
        )
        return {row[0] for row in rows}

    async def ack(self, notice: str) -> None:
        writer, _ = parse_notice(notice)
        connection = self._live()
        await self._statement(
            connection.execute,
            "SELECT pg_notify($1, $2)",
            f"{self._base}_a{writer}",
            f"{self.ident}|{notice}",
        )

    async def disconnect(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        try:
            async with asyncio.timeout(1.0), self._turn:
                await connection.execute(
                    f'DELETE FROM "{self._readers_table}" '  # noqa: S608
                    "WHERE reader_id = $1 "
                    "OR expires_at < extract(epoch FROM clock_timestamp()) - 3600",
                    self.ident,
                )
                await connection.close()
        except Exception:  # noqa: S110 - leaving is best effort: the registration runs out
            pass
        finally:
            connection.terminate()
