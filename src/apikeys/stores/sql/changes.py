"""How the SQL store writes a change: the UPDATE, its audit entry and its notice, committed
together (one statement on PostgreSQL, see `ChangeWriter.in_one`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from apikeys.types import AuditEvent

__all__ = ["ChangeWriter", "audit_statement", "audit_values", "events_of"]


def audit_values(event: AuditEvent) -> dict[str, Any]:
    """The audit table's row of `event`."""
    return {
        "at": event.time,
        "key_id": event.key_id,
        "workspace": event.workspace,
        "action": event.action,
        "actor": event.actor,
        "changes": json.dumps(dict(event.changes), separators=(",", ":")),
    }


def audit_statement(
    audit: sa.Table,
    workspace: str | None,
    key_id: str | None,
    since: datetime | None,
    limit: int,
) -> sa.Select[Any]:
    """The SELECT of `KeyStore.audit`: the newest `limit` entries that match, newest first."""
    statement = sa.select(
        audit.c.at,
        audit.c.key_id,
        audit.c.workspace,
        audit.c.action,
        audit.c.actor,
        audit.c.changes,
    )
    if workspace is not None:
        statement = statement.where(audit.c.workspace == workspace)
    if key_id is not None:
        statement = statement.where(audit.c.key_id == key_id)
    if since is not None:
        statement = statement.where(audit.c.at >= since)
    return statement.order_by(audit.c.seq.desc()).limit(limit)


def events_of(rows: Iterable[Sequence[Any]]) -> list[AuditEvent]:
    """The `AuditEvent`s of the rows of `audit_statement`, oldest first."""
    return [
        AuditEvent(
            time=row[0],
            key_id=row[1],
            workspace=row[2],
            action=row[3],
            actor=row[4],
            changes=json.loads(row[5]),
        )
        for row in reversed(list(rows))
    ]


class ChangeWriter:
    """Writes a change's audit entry and notice in the change's transaction.

    On SQLite a notice is a row of the changes table (the channel reads it); on PostgreSQL
    it is a NOTIFY on `notice_channel`, delivered at commit.
    """

    def __init__(
        self,
        *,
        sqlite: bool,
        columns: tuple[sa.Column[Any], ...],
        audit: sa.Table,
        changes: sa.Table,
        notice_channel: str,
    ) -> None:
        self._sqlite = sqlite
        self._columns = columns
        self._audit = audit
        self._changes = changes
        self._notice_channel = notice_channel

    async def publish(self, conn: AsyncConnection, notice: str | None) -> None:
        """Publish `notice` in the transaction of `conn`: it commits with the change."""
        if notice is None:
            return
        if self._sqlite:
            await conn.execute(sa.insert(self._changes).values(notice=notice))
        else:
            await conn.execute(sa.select(sa.func.pg_notify(self._notice_channel, notice)))

    async def record(self, conn: AsyncConnection, event: AuditEvent | None) -> None:
        """Append `event` to the audit trail in the transaction of `conn`."""
        if event is None:
            return
        await conn.execute(sa.insert(self._audit).values(**audit_values(event)))

    def in_one(
        self, update: sa.Update, notice: str | None, event: AuditEvent | None
    ) -> sa.Select[Any]:
        """`update`, the audit entry of `event` and the notice, as one PostgreSQL statement.

        A change holds its key's row lock from its UPDATE to its commit; every statement in
        between is a round trip, and on a loaded host each one waits for the client and the
        server to be scheduled, while usage flushes queue behind the lock. In one statement
        (data-modifying CTEs), the change costs the transaction's BEGIN, this, and COMMIT.
        The audit entry and the notice are made only when the UPDATE changed the row, as
        in the statements' usual order; when it did not, the caller reads the record and
        publishes the notice on its own. A notice is delivered at commit, whenever it is
        sent in the transaction.
        """
        changed = update.returning(*self._columns).cte("changed")
        selected: list[Any] = list(changed.c)
        if notice is not None:
            selected.append(sa.func.pg_notify(self._notice_channel, notice))
        statement = sa.select(*selected)
        if event is not None:
            audit = self._audit
            values = audit_values(event)
            logged = (
                sa.insert(audit)
                .from_select(
                    list(values),
                    sa.select(
                        *(
                            sa.literal(value, type_=audit.c[name].type).label(name)
                            for name, value in values.items()
                        )
                    ).select_from(changed),
                )
                .cte("logged")
            )
            statement = statement.add_cte(logged)
        return statement
