"""Spending a key's credits in the SQL store: one conditional UPDATE, following a roll's
link to the key that holds the pair's balance (at most `MAX_ROLL_HOPS`); and an identity's
with a key's, in one transaction (`spend_with_identity`)."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from apikeys.stores.contract import MAX_ROLL_HOPS, CreditSpend
from apikeys.types import REVOKED

__all__ = ["spend_credits", "spend_with_identity"]


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


async def spend_with_identity(
    conn: AsyncConnection,
    identities: sa.Table,
    keys: sa.Table,
    identity_id: str,
    key_id: str | None,
    cost: int,
    refill: tuple[int, datetime] | None,
    key_refill: tuple[int, datetime] | None,
) -> CreditSpend:
    """`IdentityStore.spend_credits_with_key` in the transaction of `conn`.

    The identity's row first, then the key's (every transaction that takes both takes
    them in this order, so two never wait on each other). When the key refuses, the
    identity's `cost` is given back in the same transaction: no other transaction ever
    sees it taken (its row stays locked until the commit; SQLite writes one at a time).
    An identity whose credits are NULL (unlimited) is not charged.
    """
    c = identities.c
    credits, refilled_at = c.credits, c.credits_refilled_at
    due: sa.ColumnElement[bool] = sa.false()
    amount, start = 0, None
    if refill is not None:
        due = sa.or_(refilled_at.is_(None), refilled_at < refill[1])
        amount, start = refill
    taken = (
        sa.update(identities)
        .where(
            c.id == identity_id,
            credits.is_not(None),
            sa.or_(sa.and_(due, sa.literal(amount) >= cost), sa.and_(~due, credits >= cost)),
        )
        .values(
            credits=sa.case((due, amount - cost), else_=credits - cost),
            credits_refilled_at=sa.case((due, start), else_=refilled_at),
        )
        .returning(credits)
    )
    row = (await conn.execute(taken)).first()
    left: int | None = None
    if row is not None:
        left = int(row[0])
    else:
        found = (await conn.execute(sa.select(credits).where(c.id == identity_id))).first()
        if found is None or found[0] is not None:
            if found is not None and refill is not None:
                # Too few even after a refill: the new period still began.
                await conn.execute(
                    sa.update(identities)
                    .where(c.id == identity_id, due)
                    .values(credits=amount, credits_refilled_at=start)
                )
            return CreditSpend(None, None, "identity")
    key_left: int | None = None
    if key_id is not None:
        key_left = await spend_credits(conn, keys, key_id, cost, key_refill)
        if key_left is None:
            if left is not None:
                await conn.execute(
                    sa.update(identities).where(c.id == identity_id).values(credits=credits + cost)
                )
            return CreditSpend(None, None, "key")
    return CreditSpend(left, key_left)
