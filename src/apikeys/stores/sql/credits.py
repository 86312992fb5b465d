"""Spending a key's credits in the SQL store: one conditional UPDATE, following a roll's
link to the key that holds the pair's balance (at most `MAX_ROLL_HOPS`)."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from apikeys.stores.contract import MAX_ROLL_HOPS
from apikeys.types import REVOKED

__all__ = ["spend_credits"]


async def spend_credits(
    conn: AsyncConnection,
    table: sa.Table,
    key_id: str,
    cost: int,
    refill: tuple[int, datetime] | None,
) -> int | None:
    """`KeyStore.spend_credits` in the transaction of `conn`: the credits left, or None."""
    credits, refilled_at = table.c.credits, table.c.credits_refilled_at
    if refill is None:
        due: sa.ColumnElement[bool] = sa.false()
    else:
        due = sa.or_(refilled_at.is_(None), refilled_at < refill[1])
    amount = refill[0] if refill is not None else 0
    start = refill[1] if refill is not None else None

    def spend(target: str, followed: bool) -> sa.Update:
        # Only a key no roll has linked yet holds its balance (`replaced_by IS NULL`,
        # checked again after waiting for a roll that locked the row).
        conditions = [table.c.id == target, table.c.replaced_by.is_(None)]
        if not followed:
            conditions.append(table.c.state != REVOKED)
        return (
            sa.update(table)
            .where(
                *conditions,
                credits.is_not(None),
                sa.or_(sa.and_(due, sa.literal(amount) >= cost), sa.and_(~due, credits >= cost)),
            )
            .values(
                credits=sa.case((due, amount - cost), else_=credits - cost),
                credits_refilled_at=sa.case((due, start), else_=refilled_at),
            )
            .returning(credits)
        )

    target, followed = key_id, False
    for _ in range(MAX_ROLL_HOPS):
        row = (await conn.execute(spend(target, followed))).first()
        if row is not None:
            return int(row[0])
        link = (
            await conn.execute(
                sa.select(table.c.state, table.c.replaced_by).where(table.c.id == target)
            )
        ).first()
        if link is None or (link[0] == REVOKED and not followed):
            return None
        if link[1] is None:
            if refill is not None:
                # Too few left even after a refill: still start the new period.
                await conn.execute(
                    sa.update(table)
                    .where(
                        table.c.id == target,
                        table.c.replaced_by.is_(None),
                        credits.is_not(None),
                        due,
                    )
                    .values(credits=amount, credits_refilled_at=start)
                )
            return None
        # Rolled: the pair's balance is the successor's.
        target, followed = link[1], True
    return None
