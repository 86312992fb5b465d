"""Invalidation on PostgreSQL: the store's own change log, woken early by LISTEN/NOTIFY.

- Triggers on the keys table log every change in `<table>_changes`, in the change's own
  transaction, whoever makes it, with a sequence that follows commit order and has no holes
  (`apikeys.stores.sql.log`); they also `pg_notify` the change. The store sends the notice
  of the apikeys process that made a change with `pg_notify` too, so that readers can
  acknowledge it to that process.
- Each process keeps one connection that listens on the store's notice channel and on an
  acknowledgement channel of its own. A notice drops its key at once: that is only speed.
- A probe reads the log itself: the high-water mark and identity in `<table>_log` and every
  change after the last one applied, in one statement (one snapshot). Every change
  committed before the probe is in what it reads, so a notice lost on the way (a connection
  pooler in transaction mode, a cut connection, a writer that sent none) costs no more than
  a probe's delay. A reader that finds a hole (it fell behind the pruning), another
  identity or a lower mark (a restored or remade database) starts afresh. The same statement
  reads the seal of the log's triggers (their and their function's oids and catalog row
  versions): a change made while they were disabled or replaced, and put back in its own
  transaction, is in no log but changes the seal, and the reader starts afresh.
- The registry of readers is the table `<table>_readers` (reader id, when it runs out in
  seconds since the epoch), compared with the server's `clock_timestamp()`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from apikeys.stores.contract import Channel, ChannelError, parse_notice
from apikeys.stores.sql.log import (
    POSTGRES_TRIGGERS,
    channel_base_name,
    combined_check_sql,
    trigger_seal_sql,
)
from apikeys.tasks import started

__all__ = ["PostgresChannel"]

_BYPASSED = (
    "the keys table's change log triggers or their function were altered (disabled, replaced "
    "or made again): a change may have got past the log, so the cache starts afresh"
)
# The triggers kept when the log is: the keys table's and the identities table's.
_KEPT = 2 * len(POSTGRES_TRIGGERS)
_UNLOGGED = (
    "the keys table's change log triggers are missing or disabled: the cache is not "
    "trusted until setup() makes them again"
)


class PostgresChannel(Channel):
    """The change log of the keys table `table_name`, and LISTEN/NOTIFY (see the module doc).

    `connect_args` / `connect_kwargs` are what `asyncpg.connect` takes (the SQL store passes
    its own connection settings); `changes_table`, `log_table` and `readers_table` are the
    log's and the registry's tables (by default named after `table_name`).
    """

    def __init__(
        self,
        connect_args: tuple[Any, ...],
        connect_kwargs: dict[str, Any],
        *,
        table_name: str,
        readers_table: str,
        changes_table: str | None = None,
        log_table: str | None = None,
        prepare: Callable[[], Awaitable[None]] | None = None,
        locate: Callable[[], Awaitable[str]] | None = None,
        listen: bool = True,
    ) -> None:
        super().__init__()
        self._prepare = prepare
        self._locate = locate
        # Behind a pooler in transaction mode a LISTEN lands on whichever server connection
        # is free, and notifications then reach connections no client holds: the pooler
        # drops them (and complains). Probes alone then carry every change.
        self._listen = listen
        self._schema: str | None = None
        self._args = connect_args
        self._kwargs = connect_kwargs
        base = channel_base_name(table_name)
        self._notices = base + "_n"
        self._base = base
        self._table_name = table_name
        self._readers_table = readers_table
        self._changes_table = changes_table or f"{table_name}_changes"
        self._log_table = log_table or f"{table_name}_log"
        self._identities_table = f"{table_name}_identities"
        self._connection: Any = None
        self._on_notice: Callable[[str], None] | None = None
        self._identity = ""
        self._last = 0
        self._seal: str | None = None
        # One statement at a time on the listening connection (asyncpg refuses overlaps):
        # probes, registrations, acknowledgements and registry reads take turns.
        self._turn = asyncio.Lock()

    def __repr__(self) -> str:
        return f"PostgresChannel(channel={self._notices!r})"

    def bind(self) -> None:
        super().bind()
        self._turn = asyncio.Lock()

    def _name(self, table: str) -> str:
        # In the schema the store's own connection found the keys table in: the listening
        # connection may have another search_path, and must read the store's own log.
        quoted = '"' + table.replace('"', '""') + '"'
        if self._schema is None:
            return quoted
        return '"' + self._schema.replace('"', '""') + '".' + quoted

    @property
    def _mark_sql(self) -> str:
        return (
            f"SELECT seq, identity, {self._seal_sql} AS seal "  # noqa: S608
            f"FROM {self._name(self._log_table)} WHERE id = 1"
        )

    @property
    def _probe_sql(self) -> str:
        return (
            "SELECT l.seq AS high, l.identity, c.seq, c.notice, "  # noqa: S608
            f"{self._seal_sql} AS seal "
            f"FROM {self._name(self._log_table)} l "
            f"LEFT JOIN {self._name(self._changes_table)} c "
            "ON c.seq > $1 WHERE l.id = 1 ORDER BY c.seq"
        )

    @property
    def _seal_sql(self) -> str:
        # The keys table's triggers and the identities table's: a change to either that
        # got past its log alters the seal.
        keys = trigger_seal_sql(self._table_name, self._schema, POSTGRES_TRIGGERS)
        identities = trigger_seal_sql(self._identities_table, self._schema, POSTGRES_TRIGGERS)
        return f"concat({keys}, '/', {identities})"

    @property
    def _triggers_sql(self) -> str:
        return combined_check_sql(self._logged_tables, self._schema, "postgresql")[0]

    @property
    def _logged_tables(self) -> list[tuple[str, tuple[str, ...]]]:
        return [(self._table_name, POSTGRES_TRIGGERS), (self._identities_table, POSTGRES_TRIGGERS)]

    async def connect(self, ident: str, on_notice: Callable[[str], None]) -> None:
        import asyncpg

        self.ident = ident
        connection = await asyncpg.connect(*self._args, **self._kwargs)
        acks = f"{self._base}_a{ident}"

        def notice(_: Any, __: int, ___: str, payload: str) -> None:
            on_notice(payload)

        def ack(_: Any, __: int, ___: str, payload: str) -> None:
            reader, _sep, notice_text = payload.partition("|")
            self.acknowledged(notice_text, reader)

        try:
            if self._listen:
                await connection.add_listener(self._notices, notice)
                await connection.add_listener(acks, ack)
            if self._locate is not None:
                self._schema = await self._locate()  # makes the tables if they are missing
            try:
                row = await connection.fetchrow(self._mark_sql)
                kept = await connection.fetchval(self._triggers_sql)
            except asyncpg.UndefinedTableError:
                row, kept = None, 0
            if row is None or kept != _KEPT:
                if self._prepare is None:
                    raise ChannelError("the store's change log is missing: run setup()")
                await self._prepare()  # the store's tables and triggers, the log among them
                row = await connection.fetchrow(self._mark_sql)
                kept = await connection.fetchval(self._triggers_sql)
                if row is None or kept != _KEPT:
                    raise ChannelError(_UNLOGGED)
        except BaseException:
            connection.terminate()
            raise
        self._identity, self._last = row["identity"], row["seq"]
        # The seal is read with the mark, in one snapshot: a change that got past the
        # triggers before it is in what the (empty) cache reads from now on; one after it
        # changes the seal, which every probe compares.
        self._seal = row["seal"]
        self._on_notice = on_notice
        self._connection = connection

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

        # Its error is the caller's, if the caller still waits; otherwise nobody's.
        statement = started(in_turn())
        return await asyncio.shield(statement)

    async def probe(self) -> None:
        connection = self._live()
        rows = await self._statement(connection.fetch, self._probe_sql, self._last)
        if not rows or rows[0]["identity"] != self._identity or rows[0]["high"] < self._last:
            # Another history (a restored or remade database, the log's row deleted):
            # nothing cached can be trusted; the cache is cleared on reconnection.
            raise ChannelError("the change log was reset")
        if rows[0]["seal"] != self._seal:
            # The triggers were disabled, replaced or made again since the reader started:
            # whatever happened meanwhile may not be in the log.
            raise ChannelError(_BYPASSED)
        high = rows[0]["high"]
        changes = [(row["seq"], row["notice"]) for row in rows if row["seq"] is not None]
        if high > self._last and (not changes or changes[0][0] != self._last + 1):
            raise ChannelError("fell behind the change log")
        on_notice = self._on_notice
        assert on_notice is not None
        for seq, notice_text in changes:
            self._last = seq
            on_notice(notice_text)

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
        # The triggers are checked with every registration: a table made again by a
        # migration tool, or its triggers disabled, would log nothing, and then a proof
        # would prove nothing. The cache is dropped and the triggers made again.
        kept = await self._statement(connection.fetchval, self._triggers_sql)
        if kept != _KEPT:
            raise ChannelError(_UNLOGGED)
        await self._statement(
            connection.execute,
            f"INSERT INTO {self._name(self._readers_table)} (reader_id, expires_at) "  # noqa: S608
            "VALUES ($1, extract(epoch FROM clock_timestamp()) + $2) "
            "ON CONFLICT (reader_id) DO UPDATE SET expires_at = excluded.expires_at",
            self.ident,
            ttl,
        )

    async def readers(self) -> set[str]:
        connection = self._live()
        rows = await self._statement(
            connection.fetch,
            f"SELECT reader_id FROM {self._name(self._readers_table)} "  # noqa: S608
            "WHERE expires_at > extract(epoch FROM clock_timestamp())",
        )
        return {row[0] for row in rows}

    async def ack(self, notice: str) -> None:
        writer, _ = parse_notice(notice)
        connection = self._live()
        # An acknowledgement need not survive a crash (the reader did drop the key; after a
        # crash every reader reconnects and starts afresh), so its transaction does not wait
        # for the WAL to reach the disk. Every transaction that notifies takes one lock of
        # the server's at commit and keeps it through that wait: four readers' durable
        # acknowledgements took turns with each other and with the writer's commit, one
        # disk flush each, hundreds of milliseconds apiece on a loaded host.
        await self._statement(
            connection.execute,
            "SELECT pg_notify($1, $2), set_config('synchronous_commit', 'off', true)",
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
                    f"DELETE FROM {self._name(self._readers_table)} "  # noqa: S608
                    "WHERE reader_id = $1 "
                    "OR expires_at < extract(epoch FROM clock_timestamp()) - 3600",
                    self.ident,
                )
                await connection.close()
        except Exception:  # noqa: S110 - leaving is best effort: the registration runs out
            pass
        finally:
            connection.terminate()
