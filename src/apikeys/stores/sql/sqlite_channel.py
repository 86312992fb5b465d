"""Invalidation on one host through the SQLite database itself: the SQL store's channel.

- Triggers on the keys table append a row to `<table>_changes` (an autoincrement `seq`) for
  every change, inside the change's transaction, whoever makes it (`apikeys.stores.sql.log`);
  the store appends its writer's notice too, so that the writer can wait for it.
- A probe asks `PRAGMA data_version`, which changes whenever another connection has committed
  to the file; only then does it read the changes after the last one seen. Every commit that
  finished before the probe is seen by it, so a probe is a proof as well as the delivery.
  The log has no holes (`seq` only grows, and its high-water mark outlives pruning in
  `sqlite_sequence`): a reader that finds the first row it reads past the one it expected
  fell behind the pruning, and one that finds another `identity` in `<table>_log`, a lower
  high-water mark or another file at the path (a restored backup) reads a different
  history; either way it starts afresh.
  Probes run on a read connection in the event loop's own thread (a few microseconds each: no
  thread hop), every `poll_interval` seconds.
- The registry of readers is the table `<table>_readers` (reader id, the last change it has
  applied, when its registration runs out on the host's boot clock). A reader acknowledges by
  raising its `seen`; a writer waits until no registered reader has `seen` below its change.
  Writes to the registry run in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
from collections.abc import Awaitable, Callable

from apikeys.cache import clock
from apikeys.stores.contract import Channel, ChannelError
from apikeys.stores.sql.log import KEEP_CHANGES, combined_check_sql
from apikeys.tasks import started

__all__ = ["SQLiteChannel"]


class _Unprepared(Exception):
    """The log's row or its triggers are missing: `setup()` makes them."""


_SCHEMA_CHANGED = (
    "the database's schema changed (the keys table's change log triggers among what may "
    "have been dropped and made again): the cache starts afresh"
)
_DELIVERY_POLL = 0.002
# Log entries pruned at most at one registration (one a lease in each process).
_PRUNE_BATCH = 5_000


class SQLiteChannel(Channel):
    """The change log and registry of readers of a SQLite store (see the module doc)."""

    def __init__(
        self,
        path: str,
        *,
        changes_table: str,
        readers_table: str,
        log_table: str,
        keys_table: str | None = None,
        triggers: tuple[str, ...] = (),
        identity_triggers: tuple[str, ...] = (),
        busy_timeout: float = 5.0,
        poll_interval: float = 0.01,
        prepare: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__()
        self._prepare = prepare
        self.path = path
        self.poll_interval = poll_interval
        self._changes = changes_table
        # The webhooks' endpoints, whose `taken` marks keep entries from pruning.
        self._webhooks = changes_table.removesuffix("_changes") + "_webhooks"
        self._log = log_table
        # The keys table's triggers, and the identities table's (`<keys table>_identities`).
        logged = [(keys_table, triggers)] if keys_table and triggers else []
        if keys_table and identity_triggers:
            logged.append((f"{keys_table}_identities", identity_triggers))
        self._check_sql, self._triggers_kept = combined_check_sql(logged, None, "sqlite")
        if not logged:
            self._check_sql = ""
        self._readers = readers_table
        self._identity = ""
        self._inode = 0
        self._busy_timeout = busy_timeout
        self._read: sqlite3.Connection | None = None
        self._write: sqlite3.Connection | None = None
        self._write_lock = asyncio.Lock()
        self._on_notice: Callable[[str], None] | None = None
        self._version = -1
        self._schema = -1
        self._last = 0
        self._seq_of: dict[str, int] = {}
        self._acked = 0

    def __repr__(self) -> str:
        return f"SQLiteChannel(table={self._changes!r})"

    def _reader(self) -> sqlite3.Connection:
        if self._read is None:
            raise ChannelError("not connected")
        return self._read

    def bind(self) -> None:
        super().bind()
        self._write_lock = asyncio.Lock()

    async def connect(self, ident: str, on_notice: Callable[[str], None]) -> None:
        self.ident = ident
        # No busy wait on the event loop's thread: a locked file fails the probe instead.
        connection = sqlite3.connect(
            self.path, isolation_level=None, timeout=0, check_same_thread=False
        )
        try:
            try:
                row = self._start(connection)
            except (_Unprepared, sqlite3.OperationalError) as exc:
                if self._prepare is None or not str(exc).startswith("no such table"):
                    raise
                await self._prepare()  # the store's tables and triggers, the log among them
                row = self._start(connection)
        except (_Unprepared, sqlite3.Error) as exc:
            connection.close()
            raise ChannelError(f"cannot read the change log: {exc}") from exc
        except BaseException:
            connection.close()
            raise
        self._identity, self._last, self._inode = row
        self._acked = self._last
        self._seq_of.clear()
        self._read = connection
        self._on_notice = on_notice

    def _start(self, connection: sqlite3.Connection) -> tuple[str, int, int]:
        inode = os.stat(self.path).st_ino
        self._version = connection.execute("PRAGMA data_version").fetchone()[0]
        self._schema = connection.execute("PRAGMA schema_version").fetchone()[0]
        identity, high = self._history(connection)
        if not self._logging(connection):
            raise _Unprepared("no such table: the change log's triggers")
        return identity, high, inode

    def _logging(self, connection: sqlite3.Connection) -> bool:
        """Whether the triggers that keep the change log are on the keys table."""
        if not self._check_sql:
            return True
        return bool(connection.execute(self._check_sql).fetchone()[0] == self._triggers_kept)

    def _history(self, connection: sqlite3.Connection) -> tuple[str, int]:
        """The log's identity and high-water mark (what the next `seq` follows)."""
        row = connection.execute(
            f'SELECT identity FROM "{self._log}" WHERE id = 1'  # noqa: S608
        ).fetchone()
        if row is None:
            raise _Unprepared(f"no such table: {self._log} (its row is missing)")
        high = connection.execute(
            "SELECT seq FROM sqlite_sequence WHERE name = ?", (self._changes,)
        ).fetchone()
        return str(row[0]), int(high[0]) if high else 0

    async def probe(self) -> None:
        connection = self._reader()
        try:
            if os.stat(self.path).st_ino != self._inode:
                raise ChannelError("the database file was replaced")
            version = connection.execute("PRAGMA data_version").fetchone()[0]
            if version == self._version:
                return
            if connection.execute("PRAGMA schema_version").fetchone()[0] != self._schema:
                # Triggers dropped and made again (or any other schema change) around a
                # change in one transaction leave the triggers in place and the change
                # unlogged: whatever happened meanwhile may not be in the log.
                raise ChannelError(_SCHEMA_CHANGED)
            identity, high = self._history(connection)
            rows = connection.execute(
                f'SELECT seq, notice FROM "{self._changes}" WHERE seq > ? ORDER BY seq',  # noqa: S608
                (self._last,),
            ).fetchall()
        except OSError as exc:
            raise ChannelError(f"cannot find the database file: {exc}") from exc
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF in (
                sqlite3.SQLITE_BUSY,
                sqlite3.SQLITE_LOCKED,
            ):
                # The file is busy for a moment (a checkpoint): a slow probe, not a broken
                # channel. The cache stops answering until a probe gets through.
                raise TimeoutError("the SQLite file is busy") from exc
            raise ChannelError(f"cannot read the change log: {exc}") from exc
        except (_Unprepared, sqlite3.Error) as exc:
            raise ChannelError(f"cannot read the change log: {exc}") from exc
        if identity != self._identity or high < self._last:
            # Another history (a restored or remade database): nothing cached can be trusted,
            # and the cache is cleared on reconnection.
            raise ChannelError("the change log was reset")
        if high > self._last and (not rows or rows[0][0] != self._last + 1):
            # Changes were pruned before this process read them: it cannot know which keys
            # changed, so it starts afresh.
            raise ChannelError("fell behind the change log")
        # Taken only once the log is read: a failed read is tried again by the next probe.
        self._version = version
        on_notice = self._on_notice
        assert on_notice is not None
        for seq, notice in rows:
            self._last = seq
            self._seq_of[notice] = seq
            on_notice(notice)
        if len(self._seq_of) > 1000:
            self._seq_of.clear()

    def _writer(self) -> sqlite3.Connection:
        if self._write is None:
            connection = sqlite3.connect(
                self.path,
                isolation_level=None,
                timeout=self._busy_timeout,
                check_same_thread=False,
            )
            # The registry is bookkeeping: losing its last write to a power cut is harmless.
            connection.execute("PRAGMA synchronous = NORMAL")
            self._write = connection
        return self._write

    async def _execute(self, sql: str, parameters: tuple[object, ...]) -> None:
        def run() -> None:
            try:
                self._writer().execute(sql, parameters)
            except sqlite3.Error as exc:
                raise ChannelError(f"cannot write the registry: {exc}") from exc

        async with self._write_lock:
            # A cancellation cannot stop the thread: the lock is held until the write ends,
            # so that neither another write nor `disconnect` (closing the connection) uses
            # the connection meanwhile, which can crash sqlite3.
            # Its error is the caller's, if the caller still waits; otherwise nobody's.
            write = started(asyncio.to_thread(run))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                while not write.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait([write])
                raise

    async def register(self, ttl: float) -> None:
        # The triggers are checked with every registration: a table made again by a
        # migration tool (copy, drop, rename) has none, and would log nothing. The cache is
        # then dropped, and the triggers made again when it reconnects.
        try:
            logging = self._logging(self._reader())
        except sqlite3.Error as exc:
            raise ChannelError(f"cannot read the schema: {exc}") from exc
        if not logging:
            raise ChannelError("the keys table's change log triggers are missing")
        await self._execute(
            f'INSERT INTO "{self._readers}" (reader_id, seen, expires_at) '  # noqa: S608
            "VALUES (?, ?, ?) ON CONFLICT (reader_id) DO UPDATE SET "
            "expires_at = excluded.expires_at, seen = max(seen, excluded.seen)",
            (self.ident, self._acked, clock() + ttl),
        )
        # Housekeeping, rarely needed: old registrations and the oldest changes, but none
        # that a webhook has not taken yet (the change log is their outbox). A batch at a
        # time: after a bulk load (an import of a million keys) one DELETE of the whole
        # backlog would hold the database's write lock past every writer's busy timeout.
        await self._execute(
            f'DELETE FROM "{self._changes}" WHERE seq IN ('  # noqa: S608
            f'SELECT seq FROM "{self._changes}" WHERE seq <= '
            f'(SELECT max(seq) FROM "{self._changes}") - ? AND seq <= '
            f'coalesce((SELECT min(taken) FROM "{self._webhooks}"), seq) '
            "ORDER BY seq LIMIT ?)",
            (KEEP_CHANGES, _PRUNE_BATCH),
        )

    async def readers(self) -> set[str]:
        now = clock()
        rows = self._reader().execute(
            f'SELECT reader_id FROM "{self._readers}" WHERE expires_at > ?',  # noqa: S608
            (now,),
        )
        return {row[0] for row in rows}

    async def ack(self, notice: str) -> None:
        seq = self._seq_of.get(notice, self._last)
        if seq <= self._acked:
            return
        self._acked = max(self._acked, self._last)
        await self._execute(
            f'UPDATE "{self._readers}" SET seen = max(seen, ?) WHERE reader_id = ?',  # noqa: S608
            (self._acked, self.ident),
        )

    async def delivered(self, notice: str) -> None:
        connection = self._reader()
        try:
            row = connection.execute(
                f'SELECT seq FROM "{self._changes}" WHERE notice = ?',  # noqa: S608
                (notice,),
            ).fetchone()
            if row is None:
                raise ChannelError("the notice is not in the change log")
            while True:
                waiting = connection.execute(
                    f'SELECT count(*) FROM "{self._readers}" '  # noqa: S608
                    "WHERE expires_at > ? AND seen < ? AND reader_id != ?",
                    (clock(), row[0], self.ident),
                ).fetchone()[0]
                if not waiting:
                    return
                await asyncio.sleep(_DELIVERY_POLL)
        except sqlite3.Error as exc:
            raise ChannelError(f"cannot read the registry: {exc}") from exc

    async def disconnect(self) -> None:
        if self._write is not None and self.ident:
            with contextlib.suppress(Exception):
                await self._execute(
                    f'DELETE FROM "{self._readers}" WHERE reader_id = ?',  # noqa: S608
                    (self.ident,),
                )
        async with self._write_lock:  # not while a write is running in its thread
            for connection in (self._read, self._write):
                if connection is not None:
                    with contextlib.suppress(Exception):
                        connection.close()
            self._read = self._write = None
        self._on_notice = None
