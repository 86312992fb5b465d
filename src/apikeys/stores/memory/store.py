"""The in-memory store: a dict by key id, for tests, demos and single-process apps."""

from __future__ import annotations

import builtins
import time
from collections.abc import Collection, Mapping
from dataclasses import replace
from datetime import date, datetime, timedelta
from typing import Any, Literal

from apikeys.errors import DuplicateKeyId, KeyNotFound
from apikeys.identities import IdentityRecord
from apikeys.lifecycle import may_take
from apikeys.stores.contract import MAX_ROLL_HOPS, USAGE_BATCH_RETENTION, KeyStore
from apikeys.stores.memory.identities import MemoryIdentities
from apikeys.stores.memory.webhooks import MemoryWebhooks
from apikeys.stores.shared import days_of, select_events
from apikeys.types import (
    REVOKED,
    AuditEvent,
    DailyUsage,
    KeyRecord,
    StoredKey,
    StoredState,
    UsageDelta,
)

__all__ = ["MemoryStore"]


class MemoryStore(KeyStore):
    """Keys in a dict, O(1) by id, with a per-workspace index for listing.

    Every method runs without awaiting anything, so each is atomic on its event loop. The
    store lives and dies with its process: share a SQL or Redis store between workers.

    The ids of applied usage batches are kept for `USAGE_BATCH_RETENTION` (then forgotten),
    so a batch sent again within that window is skipped.

    Spending credits writes the count beside the record, not a new record: a key with
    credits spends on every request, and copying its record each time would cost more than
    the rest of the spend. `get` and every other read fold the count back into the record;
    `get_for_verification` leaves it out (see `KeyStore.get_for_verification`).

    Verification reads keys through `get_for_verification_now` alone, without awaiting: a
    test double overrides it to fail or count those reads (or answers False there, and is
    then awaited through `get_for_verification`).
    """

    schemes = ("memory",)

    def __init__(self) -> None:
        self._keys: dict[str, StoredKey] = {}
        # workspace -> ids in insertion order (a dict used as an ordered set)
        self._by_workspace: dict[str, dict[str, None]] = {}
        # usage batch id -> when it was applied (time.monotonic()), oldest first
        self._applied_batches: dict[str, float] = {}
        self._audit: list[AuditEvent] = []
        # (key id, day, outcome) -> requests
        self._daily: dict[tuple[str, str, str], int] = {}
        # key id -> (credits, credits_refilled_at) spent since its record was last written
        self._spent: dict[str, tuple[int, datetime | None]] = {}
        self._settings: dict[str, str] = {}
        # one-time token -> (deadline on time.monotonic(), value), oldest first
        self._once: dict[str, tuple[float, str]] = {}
        self._webhooks = MemoryWebhooks(self)
        self._identities = MemoryIdentities(self._record, self.spend_credits_now)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryStore:
        return cls(**options)

    def __repr__(self) -> str:
        return f"MemoryStore(keys={len(self._keys)})"

    async def put_once(self, token: str, value: str, ttl: timedelta) -> None:
        now = time.monotonic()
        while self._once:  # drop the expired, oldest first
            oldest = next(iter(self._once))
            if self._once[oldest][0] > now:
                break
            del self._once[oldest]
        self._once.pop(token, None)  # a value put again goes last, with its new deadline
        self._once[token] = (now + ttl.total_seconds(), value)

    async def take_once(self, token: str) -> str | None:
        item = self._once.pop(token, None)
        if item is None or item[0] <= time.monotonic():
            return None
        return item[1]

    # peek_once and put_once never suspend: each call below is one step of the event loop.
    async def peek_once(self, token: str) -> str | None:
        item = self._once.get(token)
        if item is None or item[0] <= time.monotonic():
            return None
        return item[1]

    async def put_once_if_absent(self, token: str, value: str, ttl: timedelta) -> bool:
        if await self.peek_once(token) is not None:
            return False
        await self.put_once(token, value, ttl)
        return True

    async def replace_once(self, token: str, old: str, new: str | None, ttl: timedelta) -> bool:
        if await self.peek_once(token) != old:
            return False
        if new is None:
            del self._once[token]
        else:
            await self.put_once(token, new, ttl)
        return True

    async def claim_setting(
        self, name: str, value: str, *, replacing: Collection[str] = ()
    ) -> str | None:
        recorded = self._settings.get(name)
        if recorded is None or recorded in replacing:
            self._settings[name] = recorded = value
        return recorded

    def _record(self, event: AuditEvent | None, record: KeyRecord | IdentityRecord) -> None:
        """Keep the audit event of a change, and its webhook event with `record`, the key
        (or identity) as the change left it."""
        if event is not None:
            self._audit.append(event)
            self._webhooks.log(event, record)

    async def insert(self, stored: StoredKey, *, event: AuditEvent | None = None) -> None:
        key_id = stored.record.id
        if key_id in self._keys:
            raise DuplicateKeyId(key_id)
        self._keys[key_id] = stored
        self._by_workspace.setdefault(stored.record.workspace, {})[key_id] = None
        self._record(event, stored.record)

    def identities(self) -> MemoryIdentities:
        """Identities kept in the process (`apikeys.stores.memory.identities`)."""
        return self._identities

    def webhooks(self) -> MemoryWebhooks:
        """Webhooks kept in the process (`apikeys.stores.memory.webhooks`): for a single-process
        app and for tests."""
        return self._webhooks

    async def get(self, key_id: str) -> StoredKey | None:
        return self._current(key_id)

    def get_for_verification_now(self, key_id: str) -> StoredKey | Literal[False] | None:
        return self._keys.get(key_id)

    async def get_for_verification(self, key_id: str) -> StoredKey | None:
        return self._keys.get(key_id)

    def _current(self, key_id: str) -> StoredKey | None:
        """The stored key, its record first given the credits spent since it was written."""
        spent = self._spent.pop(key_id, None)
        if spent is None:
            return self._keys.get(key_id)
        stored = self._keys[key_id]
        record = replace(stored.record, credits=spent[0], credits_refilled_at=spent[1])
        stored = self._keys[key_id] = replace(stored, record=record)
        return stored

    async def list(self, workspace: str | None = None) -> list[KeyRecord]:
        for key_id in builtins.list(self._spent):
            self._current(key_id)
        if workspace is None:
            records = [stored.record for stored in self._keys.values()]
        else:
            ids = self._by_workspace.get(workspace, {})
            records = [self._keys[key_id].record for key_id in ids]
        records.sort(key=lambda record: (record.created_at, record.id))
        return records

    def _require(self, key_id: str) -> StoredKey:
        stored = self._current(key_id)
        if stored is None:
            raise KeyNotFound(key_id)
        return stored

    def _put_record(self, stored: StoredKey, record: KeyRecord) -> KeyRecord:
        self._keys[record.id] = replace(stored, record=record)
        return record

    async def set_state(
        self,
        key_id: str,
        state: StoredState,
        *,
        allowed_from: Collection[StoredState],
        at: datetime,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        stored = self._require(key_id)
        record = stored.record
        if record.state == state or record.state not in allowed_from:
            return record
        revoked_at = at if state == REVOKED else record.revoked_at
        record = self._put_record(stored, replace(record, state=state, revoked_at=revoked_at))
        self._record(event, record)
        return record

    async def shorten_expiry(
        self,
        key_id: str,
        expires_at: datetime,
        *,
        replaced_by: str | None = None,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        stored = self._require(key_id)
        record = stored.record
        if not may_take(record.state, "update"):
            return record
        if replaced_by is not None and record.replaced_by not in (None, replaced_by):
            return record  # replaced by another roll already: it won
        if record.expires_at is None or record.expires_at > expires_at:
            record = replace(record, expires_at=expires_at)
        if replaced_by is not None:
            record = replace(record, replaced_by=replaced_by)
        changed = record != stored.record
        record = self._put_record(stored, record)
        if changed:
            self._record(event, record)
        return record

    async def update(
        self,
        key_id: str,
        changes: Mapping[str, Any],
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        stored = self._require(key_id)
        record = stored.record
        if not may_take(record.state, "update") or not changes:
            return record
        record = self._put_record(stored, replace(record, **changes))
        self._record(event, record)
        return record

    async def spend_credits(
        self, key_id: str, cost: int, *, refill: tuple[int, datetime] | None = None
    ) -> int | None:
        return self.spend_credits_now(key_id, cost, refill=refill)

    def spend_credits_now(
        self,
        key_id: str,
        cost: int,
        *,
        refill: tuple[int, datetime] | None = None,
        take: bool = True,
    ) -> int | None:
        """`spend_credits` without awaiting (so atomic on the event loop). `take=False`
        only says what would be left (a refill that came due is kept all the same): what
        `MemoryIdentities.spend_credits_with_key` asks before it takes from both."""
        stored = self._keys.get(key_id)
        if stored is None or stored.record.state == REVOKED:
            return None
        # A rolled pair has one balance, the newest key's: follow the links to it.
        for _ in range(MAX_ROLL_HOPS):
            successor = stored.record.replaced_by
            if successor is None:
                break
            following = self._keys.get(successor)
            if following is None:
                return None
            key_id, stored = successor, following
        else:
            return None
        record = stored.record
        if record.credits is None:
            return None
        left, refilled_at = self._spent.get(key_id) or (
            record.credits,
            record.credits_refilled_at,
        )
        refilled = False
        if refill is not None and (refilled_at is None or refilled_at < refill[1]):
            left, refilled_at = refill
            refilled = True
        if left < cost:
            if refilled:  # too few even after the refill: the new period still began
                self._spent[key_id] = (left, refilled_at)
            return None
        if take:
            self._spent[key_id] = (left - cost, refilled_at)
        elif refilled:
            self._spent[key_id] = (left, refilled_at)
        return left - cost

    async def replace_hash(
        self,
        key_id: str,
        old_hash: str,
        new_hash: str,
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> bool:
        stored = self._keys.get(key_id)
        if stored is None or stored.secret_hash != old_hash:
            return False
        self._keys[key_id] = replace(stored, secret_hash=new_hash)
        self._record(event, stored.record)
        return True

    async def audit(
        self,
        *,
        workspace: str | None = None,
        key_id: str | None = None,
        since: datetime | None = None,
        limit: int = 1000,
    ) -> builtins.list[AuditEvent]:
        return select_events(
            self._audit, workspace=workspace, key_id=key_id, since=since, limit=limit
        )

    async def add_usage(self, usage: Mapping[str, UsageDelta], *, batch_id: str) -> None:
        if not any(delta.count or delta.daily for delta in usage.values()):
            return
        now = time.monotonic()
        self._forget_batches_before(now - USAGE_BATCH_RETENTION.total_seconds())
        if batch_id in self._applied_batches:
            return  # applied before: sending it again changes nothing
        self._applied_batches[batch_id] = now
        for key_id, delta in usage.items():
            stored = self._keys.get(key_id)
            if stored is not None:
                record = stored.record.with_usage(delta.count, delta.last_used_at)
                self._keys[key_id] = replace(stored, record=record)
                for (day, outcome), count in delta.daily.items():
                    slot = (key_id, day, outcome)
                    self._daily[slot] = self._daily.get(slot, 0) + count

    async def usage_history(self, key_id: str, since: date) -> builtins.list[DailyUsage]:
        start = since.isoformat()
        return days_of(
            (day, outcome, count)
            for (key, day, outcome), count in self._daily.items()
            if key == key_id and day >= start
        )

    def _forget_batches_before(self, cutoff: float) -> None:
        # Insertion order is application order, so the expired ids are at the front.
        applied = self._applied_batches
        while applied:
            oldest = next(iter(applied))
            if applied[oldest] >= cutoff:
                break
            del applied[oldest]
