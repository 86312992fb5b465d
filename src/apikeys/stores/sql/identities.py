"""The SQL store's identities: the table `<keys table>_identities` (`identities_table`).

Each change is one conditional `UPDATE … WHERE` (atomic on both databases), with its audit
entry and notice written in its transaction by the keys' `ChangeWriter`. Whoever writes a
row, the triggers of `apikeys.stores.sql.log` log it as `i:<id>` in the keys' change log.
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable, Collection, Mapping
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection

from apikeys.errors import DuplicateIdentity, IdentityNotFound
from apikeys.identities import IDENTITY_FIELDS, IdentityRecord
from apikeys.lifecycle import TRANSITIONS
from apikeys.listing import Position
from apikeys.stores.contract import CreditSpend, IdentityStore
from apikeys.stores.sql.changes import ChangeWriter
from apikeys.stores.sql.credits import spend_with_identity
from apikeys.stores.sql.engine import is_duplicate
from apikeys.types import REVOKED, AuditEvent, StoredState

__all__ = ["SQLIdentities"]

_T = TypeVar("_T")
_NAMES = tuple(field.name for field in IDENTITY_FIELDS)


class SQLIdentities(IdentityStore):
    """Identities in `table`, written through `run` (the store's `_run`: a pooled
    connection, a commit after writes, failures as `StoreUnavailable`)."""

    def __init__(
        self,
        run: Callable[..., Awaitable[Any]],
        table: sa.Table,
        writer: ChangeWriter,
        *,
        keys: sa.Table | None = None,
    ) -> None:
        self._run = run
        self._table = table
        self._writer = writer
        self._keys = keys  # the keys table: a key's credits spent with its identity's
        self._columns = tuple(table.c[name] for name in _NAMES)

    def __repr__(self) -> str:
        return f"SQLIdentities(table={self._table.name!r})"

    def _record(self, row: sa.Row[Any]) -> IdentityRecord:
        return IdentityRecord(**dict(zip(_NAMES, row, strict=True)))

    async def insert(self, record: IdentityRecord, *, event: AuditEvent | None = None) -> None:
        values = {name: getattr(record, name) for name in _NAMES}

        async def work(conn: AsyncConnection) -> None:
            try:
                await conn.execute(sa.insert(self._table).values(**values))
            except sa_exc.IntegrityError as exc:
                if is_duplicate(exc):
                    raise DuplicateIdentity(record.id) from None
                raise
            await self._writer.record(conn, event)

        await self._run(work)

    async def _select_one(self, conn: AsyncConnection, identity_id: str) -> IdentityRecord | None:
        statement = sa.select(*self._columns).where(self._table.c.id == identity_id)
        row = (await conn.execute(statement)).first()
        return None if row is None else self._record(row)

    async def get(self, identity_id: str) -> IdentityRecord | None:
        async def work(conn: AsyncConnection) -> IdentityRecord | None:
            return await self._select_one(conn, identity_id)

        found: IdentityRecord | None = await self._run(work, write=False)
        return found

    async def list(self, workspace: str | None = None) -> builtins.list[IdentityRecord]:
        return await self._select(workspace, None, None)

    async def list_page(
        self, workspace: str | None, *, start: Position | None, limit: int
    ) -> builtins.list[IdentityRecord]:
        return await self._select(workspace, start, limit)

    async def _select(
        self, workspace: str | None, start: Position | None, limit: int | None
    ) -> builtins.list[IdentityRecord]:
        c = self._table.c
        statement = sa.select(*self._columns).order_by(c.created_at, c.id)
        if workspace is not None:
            statement = statement.where(c.workspace == workspace)
        if start is not None:
            statement = statement.where(sa.tuple_(c.created_at, c.id) > sa.tuple_(*start))
        if limit is not None:
            statement = statement.limit(limit)

        async def work(conn: AsyncConnection) -> builtins.list[IdentityRecord]:
            return [self._record(row) for row in await conn.execute(statement)]

        found: builtins.list[IdentityRecord] = await self._run(work, write=False)
        return found

    async def _change(
        self,
        identity_id: str,
        update: sa.Update | None,
        notice: str | None,
        event: AuditEvent | None,
    ) -> IdentityRecord:
        """Run a conditional UPDATE of one identity, its event only if it changed the row,
        and its notice either way; the record afterwards."""

        async def work(conn: AsyncConnection) -> IdentityRecord:
            record = None
            if update is not None:
                row = (await conn.execute(update.returning(*self._columns))).first()
                if row is not None:
                    record = self._record(row)
                    await self._writer.record(conn, event)
            if record is None:
                record = await self._select_one(conn, identity_id)
                if record is None:
                    raise IdentityNotFound(identity_id)
            await self._writer.publish(conn, notice)
            return record

        changed: IdentityRecord = await self._run(work)
        return changed

    async def update(
        self,
        identity_id: str,
        changes: Mapping[str, Any],
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> IdentityRecord:
        c = self._table.c
        update = (
            sa.update(self._table)
            .where(c.id == identity_id, c.state.in_(TRANSITIONS["update"].sources))
            .values(**changes)
            if changes
            else None
        )
        return await self._change(identity_id, update, notice, event)

    async def set_state(
        self,
        identity_id: str,
        state: StoredState,
        *,
        allowed_from: Collection[StoredState],
        at: datetime,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> IdentityRecord:
        c = self._table.c
        values: dict[str, Any] = {"state": state}
        if state == REVOKED:
            values["revoked_at"] = at
        update = (
            sa.update(self._table)
            .where(c.id == identity_id, c.state != state, c.state.in_(tuple(allowed_from)))
            .values(**values)
        )
        return await self._change(identity_id, update, notice, event)

    async def spend_credits_with_key(
        self,
        identity_id: str,
        key_id: str | None,
        cost: int,
        *,
        refill: tuple[int, datetime] | None = None,
        key_refill: tuple[int, datetime] | None = None,
    ) -> CreditSpend:
        keys, table = self._keys, self._table
        assert keys is not None

        async def work(conn: AsyncConnection) -> CreditSpend:
            return await spend_with_identity(
                conn, table, keys, identity_id, key_id, cost, refill, key_refill
            )

        spent: CreditSpend = await self._run(work)
        return spent
