"""The SQL store's page of a key listing: one keyset query (see `apikeys.listing`).

The page starts after a position with a row-value comparison, `(created_at, id) > (:t,
:id)`, ordered by the same pair: PostgreSQL and SQLite read it as a range of the index
`(workspace, created_at, id)` when a workspace is given, and no row before the cursor is
read again, however deep the page. `owner` and `status` are conditions on the rows read.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from apikeys.listing import KeyFilter, Position
from apikeys.types import ACTIVE, EXPIRED

__all__ = ["page_statement"]


def page_statement(
    table: sa.Table,
    columns: Sequence[sa.ColumnElement[object]],
    where: KeyFilter,
    *,
    start: Position | None,
    limit: int,
    now: datetime,
) -> sa.Select[*tuple[Any, ...]]:
    """The SELECT of up to `limit` rows that match `where` and sort after `start`."""
    c = table.c
    conditions: list[sa.ColumnElement[bool]] = []
    if where.workspace is not None:
        conditions.append(c.workspace == where.workspace)
    if where.owner is not None:
        conditions.append(c.owner == where.owner)
    if where.environment is not None:
        conditions.append(c.environment == where.environment)
    if where.identity is not None:
        conditions.append(c.identity == where.identity)
    if where.status == ACTIVE:
        conditions += [c.state == ACTIVE, sa.or_(c.expires_at.is_(None), c.expires_at > now)]
    elif where.status == EXPIRED:
        # Revoked and disabled win over expired (KeyRecord.status_at).
        conditions += [c.state == ACTIVE, c.expires_at <= now]
    elif where.status is not None:
        conditions.append(c.state == where.status)
    if start is not None:
        created_at, key_id = start
        conditions.append(
            sa.tuple_(c.created_at, c.id)
            > sa.tuple_(
                sa.bindparam(None, created_at, type_=c.created_at.type),
                sa.bindparam(None, key_id, type_=c.id.type),
            )
        )
    return sa.select(*columns).where(*conditions).order_by(c.created_at, c.id).limit(limit)
