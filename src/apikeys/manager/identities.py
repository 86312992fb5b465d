"""Identities through the manager: create, read, list, update, and their state changes
(disable, enable, revoke), each written with its audit event and announced as `i:<id>` so
that every caching process drops it before the change returns (as a key's change)."""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any, Final

from apikeys.errors import (
    ConfigurationError,
    IdentityNotFound,
    InvalidTransition,
)
from apikeys.identities import IdentityRecord, check_identity_id, identity_changes
from apikeys.lifecycle import TRANSITIONS
from apikeys.listing import (
    DEFAULT_PAGE_SIZE,
    IdentityPage,
    check_page_size,
    decode_cursor,
    encode_cursor,
    position,
)
from apikeys.manager.construction import ManagerBase
from apikeys.policies import check_text
from apikeys.stores.contract import IdentityStore
from apikeys.types import ACTIVE, REVOKED, AuditAction, AuditEvent, jsonable, utcnow

__all__ = ["KEEP", "IdentityManagement"]


class _Keep:
    """The default of `update_identity`'s arguments, for which None means something."""

    def __repr__(self) -> str:
        return "KEEP"


KEEP: Final = _Keep()
"""`update_identity`'s default: the field keeps its value."""

_STATE_ACTIONS: dict[str, AuditAction] = {
    "disable": "identity.disabled",
    "enable": "identity.enabled",
    "revoke": "identity.revoked",
}


class IdentityManagement(ManagerBase):
    """The identity calls of a `KeyManager` (CONTRACT section 13). Every one is an
    operator's: a workspace user changes nothing of an identity."""

    @property
    def identities(self) -> IdentityStore:
        """The store's identities; `ConfigurationError` for a store that keeps none."""
        identities = self.store.identities()
        if identities is None:
            raise ConfigurationError(f"{type(self.store).__name__} keeps no identities")
        return identities

    async def create_identity(
        self,
        identity_id: str,
        *,
        workspace: str,
        name: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        rate_limit: str | None = None,
        credits: int | None = None,
        credit_refill: str | None = None,
        actor: str | None = None,
    ) -> IdentityRecord:
        """Create the identity `identity_id` (the application's id for its customer) in
        `workspace`; `DuplicateIdentity` if the id is taken (in any workspace).

        `rate_limit` holds the limits its keys share, in the grammar of a key's
        (`burst=10/second, daily=10000/day`); `credits` and `credit_refill` their shared
        uses, as a key's.
        """
        check_identity_id(identity_id, "identity id")
        check_text(workspace, "workspace")
        now = utcnow()
        given = {
            "name": name,
            "metadata": metadata,
            "rate_limit": rate_limit,
            "credits": credits,
            "credit_refill": credit_refill,
        }
        fields = identity_changes({k: v for k, v in given.items() if v is not None}, now)
        record = IdentityRecord(
            id=identity_id, workspace=workspace, state=ACTIVE, created_at=now, **fields
        )
        shown = {k: v for k, v in record.to_dict().items() if k in given and v not in (None, {})}
        event = self._identity_event("identity.created", record, actor, shown)
        self._use()
        await self.identities.insert(record, event=event)
        self._announce(event)
        return record

    async def get_identity(self, identity_id: str) -> IdentityRecord:
        """The identity `identity_id`; `IdentityNotFound` if there is none."""
        check_identity_id(identity_id)
        self._use()
        record = await self.identities.get(identity_id)
        if record is None:
            raise IdentityNotFound(identity_id)
        return record

    async def list_identities(self, workspace: str | None = None) -> builtins.list[IdentityRecord]:
        """The identities of `workspace` (or of all), oldest first. Their keys are
        `list(identity=…)`."""
        if workspace is not None:
            check_text(workspace, "workspace")
        self._use()
        return await self.identities.list(workspace)

    async def list_identities_page(
        self,
        workspace: str | None = None,
        *,
        limit: int = DEFAULT_PAGE_SIZE,
        cursor: str | None = None,
    ) -> IdentityPage:
        """One page of the identities of `workspace` (or of all), oldest first (by
        `created_at`, then id), as `list_page` pages keys: `limit` is 1 to `MAX_PAGE_SIZE`,
        the page's `next_cursor` (None on the last one) passed as `cursor` gives the next
        page, and a cursor not made here raises `InvalidKeyParameters`."""
        if workspace is not None:
            check_text(workspace, "workspace")
        size = check_page_size(limit)
        start = None if cursor is None else decode_cursor(cursor)
        self._use()
        found = await self.identities.list_page(workspace, start=start, limit=size + 1)
        records = found[:size]
        more = len(found) > size
        return IdentityPage(records, encode_cursor(position(records[-1])) if more else None)

    async def update_identity(
        self,
        identity_id: str,
        *,
        name: str | _Keep | None = KEEP,
        metadata: Mapping[str, Any] | _Keep | None = KEEP,
        rate_limit: str | _Keep | None = KEEP,
        credits: int | _Keep | None = KEEP,
        credit_refill: str | _Keep | None = KEEP,
        actor: str | None = None,
    ) -> IdentityRecord:
        """Edit an identity: only what is given changes; None clears a field (`metadata`
        `{}`, `credits` unlimited); a new refill starts now, full. Refused for a revoked
        identity. Returns once every caching process has dropped the old record."""
        before = await self.get_identity(identity_id)
        given = {
            "name": name,
            "metadata": metadata,
            "rate_limit": rate_limit,
            "credits": credits,
            "credit_refill": credit_refill,
        }
        changes = {k: v for k, v in given.items() if not isinstance(v, _Keep)}
        fields = identity_changes(changes, utcnow())
        event = self._identity_event("identity.updated", before, actor, fields) if fields else None
        record = await self._change(
            before.subject,
            lambda notice: self.identities.update(identity_id, fields, notice=notice, event=event),
        )
        if record.state == REVOKED:
            raise InvalidTransition(identity_id, REVOKED, "update", subject="identity")
        if event is not None:
            self._announce(event)
        return record

    async def disable_identity(
        self, identity_id: str, *, actor: str | None = None
    ) -> IdentityRecord:
        """Turn an identity off: its keys are refused until `enable_identity`."""
        return await self._identity_transition(identity_id, "disable", actor)

    async def enable_identity(
        self, identity_id: str, *, actor: str | None = None
    ) -> IdentityRecord:
        """Turn a disabled identity on again; refused for a revoked one."""
        return await self._identity_transition(identity_id, "enable", actor)

    async def revoke_identity(
        self, identity_id: str, *, actor: str | None = None
    ) -> IdentityRecord:
        """Turn an identity off for good: its keys are refused, and it cannot be enabled."""
        return await self._identity_transition(identity_id, "revoke", actor)

    async def _identity_transition(
        self, identity_id: str, verb: str, actor: str | None
    ) -> IdentityRecord:
        allowed_from, target = TRANSITIONS[verb]
        assert target is not None
        before = await self.get_identity(identity_id)
        if before.state != target and before.state not in allowed_from:
            raise InvalidTransition(identity_id, before.state, verb, subject="identity")
        event = self._identity_event(_STATE_ACTIONS[verb], before, actor, {"state": target})
        record = await self._change(
            before.subject,
            lambda notice: self.identities.set_state(
                identity_id,
                target,
                allowed_from=allowed_from,
                at=event.time,
                notice=notice,
                event=event,
            ),
        )
        if record.state != target:
            raise InvalidTransition(identity_id, record.state, verb, subject="identity")
        if before.state != target:
            self._announce(event)
        return record

    async def check_identity(self, identity_id: str, workspace: str) -> str:
        """`identity_id` if a key of `workspace` may belong to it: a valid id
        (`InvalidKeyParameters`) of an identity of that workspace (`IdentityNotFound`: another
        workspace's answers as an unknown one) that is not revoked (`InvalidTransition`)."""
        check_identity_id(identity_id)
        record = await self.identities.get(identity_id)
        if record is None or record.workspace != workspace:
            raise IdentityNotFound(
                identity_id, f"no identity with id {identity_id!r} in workspace {workspace!r}"
            )
        if record.state == REVOKED:
            raise InvalidTransition(
                identity_id, REVOKED, "add a key to", "it is revoked", subject="identity"
            )
        return identity_id

    @staticmethod
    def _identity_event(
        action: AuditAction, record: IdentityRecord, actor: str | None, changes: Mapping[str, Any]
    ) -> AuditEvent:
        return AuditEvent(
            time=utcnow(),
            key_id=record.subject,
            workspace=record.workspace,
            action=action,
            actor=actor,
            changes=jsonable(changes),
        )
