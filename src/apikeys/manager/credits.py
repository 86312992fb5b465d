"""Spending credits on the request path: a key's, and its identity's with it in one decision
(CONTRACT section 13), through the store's atomic steps."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from apikeys.manager.construction import ManagerBase
from apikeys.policies import parse_refill
from apikeys.stores.contract import CreditSpend
from apikeys.types import TEST, KeyRecord, utcnow

if TYPE_CHECKING:
    from apikeys.identities import IdentityRecord

__all__ = ["CreditSpending", "refill_window", "spends_identity"]


def refill_window(credit_refill: str | None) -> tuple[int, datetime] | None:
    """A `credit_refill` as the stores take it: `(amount, start of the current period)`,
    or None for credits without a refill."""
    refill = parse_refill(credit_refill) if credit_refill else None
    return None if refill is None else (refill.amount, refill.period_start(utcnow()))


def spends_identity(record: KeyRecord, identity: IdentityRecord | None) -> bool:
    """Whether a request of `record` spends its identity's credits: the identity has
    credits, and the key is not a test key (test keys never spend an identity's)."""
    return identity is not None and identity.credits is not None and record.environment != TEST


class CreditSpending(ManagerBase):
    """The credits a `KeyManager` spends for the request path."""

    async def spend_request_credits(
        self, record: KeyRecord, identity: IdentityRecord | None, cost: int = 1
    ) -> CreditSpend:
        """Take `cost` of the key's credits (if it has any) and of its `identity`'s (if it
        has any and the key is live), both or neither; `CreditSpend` says what is left of
        each or which refused. A rolled key spends its pair's one balance (`spend_credits`)."""
        if identity is None or not spends_identity(record, identity):
            if record.credits is None:
                return CreditSpend(None, None)
            left = await self.store.spend_credits(
                record.id, cost, refill=refill_window(record.credit_refill)
            )
            return CreditSpend(None, left, None if left is not None else "key")
        identities = self.store.identities()
        assert identities is not None  # the key's identity was read from it
        return await identities.spend_credits_with_key(
            identity.id,
            None if record.credits is None else record.id,
            cost,
            refill=refill_window(identity.credit_refill),
            key_refill=refill_window(record.credit_refill),
        )
