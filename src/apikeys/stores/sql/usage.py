"""Usage in the SQL store: batches of counts applied once, daily counts, their history.

A batch's id is recorded first, in the batch's own transaction (see `SQLUsage.add`); the
ids of the last `USAGE_BATCH_RETENTION` are kept, so a batch sent again is not counted twice.
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, date, datetime
from typing import Any, Final, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from apikeys.stores.contract import USAGE_BATCH_RETENTION
from apikeys.stores.shared import days_of
from apikeys.stores.sql.engine import is_duplicate
from apikeys.stores.sql.schema import UTCDateTime
from apikeys.types import DailyUsage, UsageDelta

__all__ = ["SQLUsage"]

_T = TypeVar("_T")
Run = Callable[..., Awaitable[Any]]

logger = logging.getLogger("apikeys")

# How often a store deletes the ids of usage batches older than USAGE_BATCH_RETENTION.
_PRUNE_INTERVAL: Final = 60.0


class SQLUsage:
    """The usage side of `SQLStore`: `add` (its `add_usage`) and `history` (`usage_history`).

    `run(work, write=...)` is the store's: it runs `work` on a pooled connection and turns
    errors into the store's.
    """

    def __init__(
        self,
        run: Run,
        dialect: sa.Dialect,
        table: sa.Table,
        batches: sa.Table,
        daily: sa.Table,
    ) -> None:
        self._run = run
        self._table, self._daily = table, daily
        # `add` records its batch id first; a conflict means "applied before".
        self._claim_batch: sa.Insert = sa.insert(batches)
        if dialect.name == "postgresql":
            self._claim_batch = postgresql.insert(batches).on_conflict_do_nothing(
                index_elements=[batches.c.batch_id]
            )
        elif dialect.name == "sqlite":
            self._claim_batch = sqlite.insert(batches).on_conflict_do_nothing(
                index_elements=[batches.c.batch_id]
            )
        # Daily usage: add to a (key, day, outcome) row, made on first use, for a key that
        # exists (as the counts above): one statement, so the batch's write transaction
        # stays short when the process is busy.
        self._add_daily: sa.TextClause | None = None
        if dialect.name in ("postgresql", "sqlite"):
            quote = dialect.identifier_preparer.format_table
            daily_name, keys_name = quote(daily), quote(table)
            # Table names quoted by the dialect; every value is a bound parameter.
            self._add_daily = sa.text(
                f"INSERT INTO {daily_name} (key_id, day, outcome, count) "  # noqa: S608
                "SELECT CAST(:key_id AS VARCHAR(12)), CAST(:day AS VARCHAR(10)), "
                "CAST(:outcome AS VARCHAR(32)), CAST(:count AS BIGINT) "
                f"WHERE EXISTS (SELECT 1 FROM {keys_name} WHERE id = CAST(:key_id AS VARCHAR(12))) "
                "ON CONFLICT (key_id, day, outcome) "
                f"DO UPDATE SET count = {daily_name}.count + excluded.count"
            )
        self._prune_batches = sa.delete(batches).where(
            batches.c.applied_at < sa.bindparam("cutoff", type_=UTCDateTime())
        )
        self._next_prune = 0.0  # time.monotonic() of the next prune; the first batch prunes

    async def add(self, usage: Mapping[str, UsageDelta], *, batch_id: str) -> None:
        """One transaction: record `batch_id`, then add the increments.

        The batch id goes in first. If it is there already (a row with that primary key,
        committed by an earlier send, or by a concurrent one that PostgreSQL makes this one
        wait for), the batch was applied: the transaction is rolled back and nothing else
        happens. Otherwise the increments follow in the same transaction, so the id is
        recorded if and only if the batch is applied.
        """
        # Sorted by id, so concurrent batches lock rows in one order and cannot deadlock.
        params = [
            {"b_id": key_id, "b_count": delta.count, "b_last": delta.last_used_at}
            for key_id, delta in sorted(usage.items())
            if delta.count
        ]
        daily_rows = [
            {"key_id": key_id, "day": day, "outcome": outcome, "count": count}
            for key_id, delta in sorted(usage.items())
            for (day, outcome), count in sorted(delta.daily.items())
            if count
        ]
        if not params and not daily_rows:
            return
        table = self._table
        last = sa.bindparam("b_last", type_=UTCDateTime())
        statement = (
            sa.update(table)
            .where(table.c.id == sa.bindparam("b_id"))
            .values(
                request_count=table.c.request_count
                + sa.bindparam("b_count", type_=sa.BigInteger()),
                last_used_at=sa.case(
                    (
                        sa.or_(table.c.last_used_at.is_(None), table.c.last_used_at < last),
                        last,
                    ),
                    else_=table.c.last_used_at,
                ),
            )
        )
        claim = {"batch_id": batch_id, "applied_at": datetime.now(UTC)}

        async def work(conn: AsyncConnection) -> None:
            try:
                claimed = (await conn.execute(self._claim_batch, claim)).rowcount != 0
            except sa_exc.IntegrityError as exc:  # a dialect without ON CONFLICT DO NOTHING
                if not is_duplicate(exc):
                    raise
                claimed = False
            if not claimed:
                await conn.rollback()  # applied before: nothing to do
                return
            if daily_rows:
                await self._add_daily_usage(conn, daily_rows)
            # The keys' rows last, right before the commit: a change to a key (a revoke)
            # waits for their locks, and every statement between the lock and the commit
            # would be one more round trip of this process (slow on a loaded host) for it
            # to wait through.
            if params:
                await conn.execute(statement, params)

        await self._run(work)
        await self._maybe_prune_batches()

    async def _add_daily_usage(
        self, conn: AsyncConnection, rows: builtins.list[dict[str, Any]]
    ) -> None:
        if self._add_daily is not None:
            await conn.execute(self._add_daily, rows)
            return
        daily, table = self._daily, self._table  # pragma: no cover - no ON CONFLICT
        for row in rows:  # pragma: no cover
            known = await conn.execute(sa.select(table.c.id).where(table.c.id == row["key_id"]))
            if known.first() is None:
                continue  # an unknown id adds nothing
            key = (daily.c.key_id == row["key_id"]) & (daily.c.day == row["day"])
            key &= daily.c.outcome == row["outcome"]
            updated = await conn.execute(
                sa.update(daily).where(key).values(count=daily.c.count + row["count"])
            )
            if not updated.rowcount:
                await conn.execute(sa.insert(daily).values(row))

    async def history(self, key_id: str, since: date) -> builtins.list[DailyUsage]:
        daily = self._daily
        statement = (
            sa.select(daily.c.day, daily.c.outcome, daily.c.count)
            .where(daily.c.key_id == key_id, daily.c.day >= since.isoformat())
            .order_by(daily.c.day)
        )

        async def work(conn: AsyncConnection) -> builtins.list[DailyUsage]:
            return days_of([(row[0], row[1], int(row[2])) for row in await conn.execute(statement)])

        history: builtins.list[DailyUsage] = await self._run(work, write=False)
        return history

    async def _maybe_prune_batches(self) -> None:
        """Delete batch ids older than the retention window, at most once a minute.

        Its own short transaction after the batch's: housekeeping that may fail (it is
        tried again a minute later) without failing the batch, which is applied already.
        """
        now = time.monotonic()
        if now < self._next_prune:
            return
        self._next_prune = now + _PRUNE_INTERVAL
        cutoff = datetime.now(UTC) - USAGE_BATCH_RETENTION

        async def work(conn: AsyncConnection) -> None:
            await conn.execute(self._prune_batches, {"cutoff": cutoff})

        try:
            await self._run(work)
        except Exception as exc:
            logger.debug("apikeys: pruning old usage batch ids failed: %s", type(exc).__name__)
