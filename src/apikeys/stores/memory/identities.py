"""The memory store's identities: a dict by id, beside its keys, in the same audit trail."""

from __future__ import annotations

import builtins
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

from apikeys.errors import DuplicateIdentity, IdentityNotFound
from apikeys.identities import IdentityRecord
from apikeys.lifecycle import may_take
from apikeys.stores.contract import IdentityStore
from apikeys.types import REVOKED, AuditEvent, StoredState

__all__ = ["MemoryIdentities"]


class MemoryIdentities(IdentityStore):
    """Identities in a dict, O(1) by id: the reference the other stores are tested against.

    Every method runs without awaiting anything, so each is atomic on its event loop.
    `record` keeps a change's audit event in the key store's trail, and its webhook event
    with the identity as the change left it (`MemoryStore`).
    """

    def __init__(self, record: Callable[[AuditEvent | None, IdentityRecord], None]) -> None:
        self._identities: dict[str, IdentityRecord] = {}
        self._record = record

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
        return self._identities.get(identity_id)

    async def list(self, workspace: str | None = None) -> builtins.list[IdentityRecord]:
        records = [
            record
            for record in self._identities.values()
            if workspace is None or record.workspace == workspace
        ]
        records.sort(key=lambda record: (record.created_at, record.id))
        return records

    def _require(self, identity_id: str) -> IdentityRecord:
        record = self._identities.get(identity_id)
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
