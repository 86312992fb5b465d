"""Reading keys: one record, a list, pages of records, a key's usage (and an identity's: its
keys' together) and the audit trail."""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Final

from apikeys.errors import (
    IdentityNotFound,
    InvalidKeyParameters,
    KeyNotFound,
)
from apikeys.identities import check_identity_id
from apikeys.listing import (
    DEFAULT_PAGE_SIZE,
    AuditPage,
    KeyFilter,
    KeyPage,
    check_page_size,
    decode_cursor,
    decode_trail_cursor,
    encode_cursor,
    encode_trail_cursor,
    position,
)
from apikeys.manager.construction import ManagerBase
from apikeys.policies import check_text
from apikeys.stores.contract import MAX_ROLL_HOPS
from apikeys.stores.shared import ADMITTED, LEGACY_SCHEME, days_of
from apikeys.types import (
    AuditEvent,
    DailyUsage,
    Environment,
    KeyRecord,
    Status,
    utcnow,
)

__all__ = ["KeyReading"]

# As many events as any trail holds: a trail page counts its place from the oldest event.
_WHOLE_TRAIL: Final = 2**62


class KeyReading(ManagerBase):
    """The reads of a `KeyManager`: records as the store has them, with this process's
    unflushed usage and the balance a rolled key spends from."""

    async def get(
        self,
        key_id: str,
        *,
        workspace: str | None = None,
        environment: Environment | None = None,
    ) -> KeyRecord:
        """The record of `key_id`, with this process's unflushed usage. Raises `KeyNotFound`,
        also for a key of another `workspace` or `environment` when they are given: after
        the same one read as for an unknown id, so that no count of work tells them apart."""
        self._use()
        stored = await self.store.get(key_id)
        if (
            stored is None
            or (workspace is not None and stored.record.workspace != workspace)
            or (environment is not None and stored.record.environment != environment)
        ):
            raise KeyNotFound(key_id)
        return self.usage_buffer.apply(await self._shared_credits(stored.record, {}))

    async def list(
        self,
        workspace: str | None = None,
        *,
        owner: str | None = None,
        status: Status | None = None,
        environment: Environment | None = None,
        identity: str | None = None,
    ) -> list[KeyRecord]:
        """Every record of `workspace` (or of all workspaces), oldest first, in one read;
        `owner`, `status`, `environment` and `identity` keep only the keys with that owner,
        status, environment (`live` or `test`) and identity (its id).

        For many keys, read them a page at a time: `list_page`, or `iter_keys`.
        """
        self._use()
        where = KeyFilter(workspace, owner, status, environment, identity)
        now = utcnow()
        records = await self.store.list(workspace)
        by_id = {record.id: record for record in records}
        return [
            self.usage_buffer.apply(await self._shared_credits(record, by_id))
            for record in records
            if where.matches(record, now)
        ]

    async def list_page(
        self,
        workspace: str | None = None,
        *,
        owner: str | None = None,
        status: Status | None = None,
        limit: int = DEFAULT_PAGE_SIZE,
        cursor: str | None = None,
        environment: Environment | None = None,
        identity: str | None = None,
    ) -> KeyPage:
        """One page of the records that match, oldest first (by `created_at`, then id).

        `limit` is the page size, 1 to `MAX_PAGE_SIZE` (1000). The page's `next_cursor`,
        passed as `cursor`, gives the next page; it is None on the last one. A cursor is
        opaque (it names a position, never a secret); one that was not made here raises
        `InvalidKeyParameters`, as does a bad `limit` or `status`. What a walk through the
        pages guarantees while keys change is in `apikeys.listing`.
        """
        self._use()
        where = KeyFilter(workspace, owner, status, environment, identity)
        size = check_page_size(limit)
        start = None if cursor is None else decode_cursor(cursor)
        found = await self.store.list_page(where, start=start, limit=size + 1, now=utcnow())
        by_id = {record.id: record for record in found}
        records = [
            self.usage_buffer.apply(await self._shared_credits(record, by_id))
            for record in found[:size]
        ]
        more = len(found) > size
        return KeyPage(records, encode_cursor(position(records[-1])) if more else None)

    async def iter_keys(
        self,
        workspace: str | None = None,
        *,
        owner: str | None = None,
        status: Status | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        environment: Environment | None = None,
        identity: str | None = None,
    ) -> AsyncIterator[KeyRecord]:
        """Every record that matches, oldest first, read `page_size` at a time
        (`list_page` without the cursors)."""
        cursor: str | None = None
        while True:
            page = await self.list_page(
                workspace,
                owner=owner,
                status=status,
                limit=page_size,
                cursor=cursor,
                environment=environment,
                identity=identity,
            )
            for record in page.records:
                yield record
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def _shared_credits(self, record: KeyRecord, known: Mapping[str, KeyRecord]) -> KeyRecord:
        """`record`, showing the balance it spends from: a rolled key's is its successor's
        (followed to the newest key; `known` holds records already read)."""
        holder = record
        for _ in range(MAX_ROLL_HOPS):
            if holder.replaced_by is None:
                break
            successor = known.get(holder.replaced_by)
            if successor is None:
                stored = await self.store.get(holder.replaced_by)
                if stored is None:
                    break
                successor = stored.record
            holder = successor
        if holder is record:
            return record
        return replace(
            record, credits=holder.credits, credits_refilled_at=holder.credits_refilled_at
        )

    # -- state changes ---------------------------------------------------------------------

    async def usage(self, key_id: str, days: int = 30) -> builtins.list[DailyUsage]:
        """The key's requests per UTC day over the last `days` days (today included),
        oldest first, one entry per day (zero on days without requests): admitted, and
        refused by code. Includes this process's counts not yet written."""
        if not 1 <= days <= 3660:
            raise InvalidKeyParameters("days must be from 1 to 3660")
        await self.get(key_id)  # KeyNotFound for an unknown id
        today = utcnow().date()
        first = today - timedelta(days=days - 1)
        counts: dict[tuple[str, str], int] = {}
        for day in await self.store.usage_history(key_id, first):
            counts[(day.day.isoformat(), ADMITTED)] = day.admitted
            counts[(day.day.isoformat(), LEGACY_SCHEME)] = day.legacy_scheme
            for code, count in day.refused.items():
                counts[(day.day.isoformat(), code)] = count
        for slot, count in self.usage_buffer.pending_daily(key_id).items():
            counts[slot] = counts.get(slot, 0) + count
        history = {day.day: day for day in days_of((d, o, n) for (d, o), n in counts.items())}
        return [
            history.get(first + timedelta(days=n), DailyUsage(first + timedelta(days=n)))
            for n in range(days)
        ]

    async def identity_usage(self, identity_id: str, days: int = 30) -> builtins.list[DailyUsage]:
        """An identity's requests per UTC day over the last `days` days, oldest first: the
        sum of `usage` of every key that belongs to it now (disabled, revoked and test keys
        too). A key moved out of the identity takes its history with it. Raises
        `IdentityNotFound` for an unknown identity."""
        check_identity_id(identity_id)
        if not 1 <= days <= 3660:
            raise InvalidKeyParameters("days must be from 1 to 3660")
        identities = self.store.identities()
        if identities is None or await identities.get(identity_id) is None:
            raise IdentityNotFound(identity_id)
        today = utcnow().date()
        total = {day: DailyUsage(day) for day in (today - timedelta(days=n) for n in range(days))}
        for record in await self.list(identity=identity_id):
            for one in await self.usage(record.id, days=days):
                summed = total.get(one.day)
                if summed is None:  # a key read after midnight: today's is not in the range
                    continue
                refused = dict(summed.refused)
                for code, count in one.refused.items():
                    refused[code] = refused.get(code, 0) + count
                total[one.day] = replace(
                    summed,
                    admitted=summed.admitted + one.admitted,
                    refused=refused,
                    legacy_scheme=summed.legacy_scheme + one.legacy_scheme,
                )
        return sorted(total.values(), key=lambda day: day.day)

    async def audit(
        self,
        *,
        workspace: str | None = None,
        key_id: str | None = None,
        since: datetime | None = None,
        limit: int = 1000,
    ) -> builtins.list[AuditEvent]:
        """The audit trail: the newest `limit` changes that match, oldest first. A
        `workspace` no key can have (control characters, text that is not Unicode) raises
        `InvalidKeyParameters`."""
        if workspace is not None:
            check_text(workspace, "workspace")
        return await self.store.audit(workspace=workspace, key_id=key_id, since=since, limit=limit)

    async def audit_page(
        self,
        workspace: str,
        *,
        key_id: str | None = None,
        environment: Environment | None = None,
        limit: int = DEFAULT_PAGE_SIZE,
        cursor: str | None = None,
    ) -> AuditPage:
        """One page of `workspace`'s audit trail (of the key `key_id` only, when given),
        newest last: the newest `limit` events, and a `next_cursor` (None at the oldest
        event) whose page holds the events before them. `environment` (`live` or `test`)
        keeps the events about keys of that environment, and every identity's event (an
        identity belongs to no environment). A cursor not made here raises
        `InvalidKeyParameters`; one made for another filter names a place, nothing more.

        Each page reads the trail of the workspace (or key) and, with `environment`, the
        workspace's keys.
        """
        check_text(workspace, "workspace")
        size = check_page_size(limit)
        end = None if cursor is None else decode_trail_cursor(cursor)
        events = await self.store.audit(workspace=workspace, key_id=key_id, limit=_WHOLE_TRAIL)
        if environment is not None:
            shown = {r.id for r in await self.store.list(workspace) if r.environment == environment}
            events = [e for e in events if e.identity is not None or e.key_id in shown]
        end = len(events) if end is None else min(end, len(events))
        start = max(end - size, 0)
        return AuditPage(events[start:end], encode_trail_cursor(start) if start else None)
