"""The memory store's identities: a dict by id, beside its keys, in the same audit trail."""

from __future__ import annotations

import builtins
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any, Literal

from apikeys.errors import DuplicateIdentity, IdentityNotFound
from apikeys.identities import IdentityRecord
from apikeys.lifecycle import may_take
from apikeys.stores.contract import CreditSpend, IdentityStore
from apikeys.types import REVOKED, AuditEvent, StoredState

__all__ = ["MemoryIdentities"]


class MemoryIdentities(IdentityStore):
    """Identities in a dict, O(1) by id: the reference the other stores are tested against.

    Every method runs without awaiting anything, so each is atomic on its event loop.
    `record` keeps a change's audit event in the key store's trail, and its webhook event
    with the identity as the change left it (`MemoryStore`).
    """

    def __init__(
        self,
        record: Callable[[AuditEvent | None, IdentityRecord], None],
        spend_key: Callable[..., int | None] | None = None,
    ) -> None:
        self._identities: dict[str, IdentityRecord] = {}
        self._record = record
        # `MemoryStore.spend_credits_now`: a key's credits, taken in the same step.
        self._spend_key = spend_key
        # id -> (credits left, refilled at) spent since the record was written: kept apart,
        # so that spending leaves the record (what the request path prepares) unchanged.
        self._spent: dict[str, tuple[int, datetime | None]] = {}

    def __repr__(self) -> str:
        return f"MemoryIdentities(identities={len(self._identities)})"

    def _keep(self, event: AuditEvent | None, record: IdentityRecord) -> None:
        self._record(event, record)

    async def insert(self, record: IdentityRecord, *, event: AuditEvent | None = None) -> None:
        if record.id in self._identities:
            raise DuplicateIdentity(record.id)
        self._identities[record.id] = record
        self._keep(event, record)

    async def get(self, identity_id: str) -> IdentityRecord | None:
        return self._current(identity_id)

    def _current(self, identity_id: str) -> IdentityRecord | None:
        """The identity, its record first given the credits spent since it was written."""
        record = self._identities.get(identity_id)
        spent = self._spent.pop(identity_id, None)
        if record is None or spent is None:
            return record
        record = replace(record, credits=spent[0], credits_refilled_at=spent[1])
        self._identities[identity_id] = record
        return record

    async def spend_credits_with_key(
        self,
        identity_id: str,
        key_id: str | None,
        cost: int,
        *,
        refill: tuple[int, datetime] | None = None,
        key_refill: tuple[int, datetime] | None = None,
    ) -> CreditSpend:
        # No await from here to the end: one step of the event loop, so atomic.
        record = self._identities.get(identity_id)
        if record is None:
            return CreditSpend(None, None, "identity")
        left: int | None = None
        refilled = False
        if record.credits is not None:
            left, refilled_at = self._spent.get(identity_id) or (
                record.credits,
                record.credits_refilled_at,
            )
            if refill is not None and (refilled_at is None or refilled_at < refill[1]):
                left, refilled_at = refill
                refilled = True
            if refilled:  # a new period began, whatever this request's fate
                self._spent[identity_id] = (left, refilled_at)
            if left < cost:
                return CreditSpend(None, None, "identity")
        key_left: int | None = None
        if key_id is not None:
            assert self._spend_key is not None
            key_left = self._spend_key(key_id, cost, refill=key_refill, take=False)
            if key_left is None:
                return CreditSpend(None, None, "key")
            self._spend_key(key_id, cost, refill=key_refill)
        if left is None:
            return CreditSpend(None, key_left)
        self._spent[identity_id] = (left - cost, refilled_at)
        return CreditSpend(left - cost, key_left)

    def get_now(self, identity_id: str) -> IdentityRecord | Literal[False] | None:
        return self._identities.get(identity_id)

    async def list(self, workspace: str | None = None) -> builtins.list[IdentityRecord]:
        for identity_id in builtins.list(self._spent):
            self._current(identity_id)
        records = [
            record
            for record in self._identities.values()
            if workspace is None or record.workspace == workspace
        ]
        records.sort(key=lambda record: (record.created_at, record.id))
        return records

    def _require(self, identity_id: str) -> IdentityRecord:
        record = self._current(identity_id)
        if record is None:
            raise IdentityNotFound(identity_id)
        return record

    async def update(
        self,
        identity_id: str,
        changes: Mapping[str, Any],
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> IdentityRecord:
        record = self._require(identity_id)
        if not may_take(record.state, "update") or not changes:
            return record
        record = self._identities[identity_id] = replace(record, **changes)
        self._keep(event, record)
        return record

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
        record = self._require(identity_id)
        if record.state == state or record.state not in allowed_from:
            return record
        revoked_at = at if state == REVOKED else record.revoked_at
        record = replace(record, state=state, revoked_at=revoked_at)
        self._identities[identity_id] = record
        self._keep(event, record)
        return record
