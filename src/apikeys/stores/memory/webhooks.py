"""Webhooks on the memory store: the outbox, endpoints and deliveries in the process.

The store appends each change's event with the key's record (`log`) in the same step as the
change, while an endpoint exists (without one, nothing would ever take it). Every method
runs without awaiting anything, so each is atomic on its event loop, as the store's own.
It all lives and dies with the process: for a single-process app and for tests.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING

from apikeys.errors import DeliveryInProgress
from apikeys.listing import DeliveryPosition
from apikeys.stores.contract import WebhookStore
from apikeys.types import AuditEvent
from apikeys.webhooks.events import EVENT_OF_ACTION, Subject, delivered_as, event_body, subject_of
from apikeys.webhooks.model import (
    Claimed,
    Delivery,
    DeliveryStatus,
    Endpoint,
    Timed,
    expiring_deliveries,
    fair_share,
    identity_usage_deliveries,
    usage_threshold_deliveries,
    wanting,
)

if TYPE_CHECKING:
    from apikeys.stores.memory.store import MemoryStore

__all__ = ["MemoryWebhooks"]


@dataclass(slots=True)
class _Entry:
    seq: int
    event: str
    at: datetime
    record: Subject


@dataclass(slots=True)
class _Held:
    delivery: Delivery
    order: int
    body: bytes
    holder: str | None = None
    lease_until: datetime | None = None


class MemoryWebhooks(WebhookStore):
    """The webhook side of a `MemoryStore` (see the module doc)."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self._seq = 0
        self._log: list[_Entry] = []
        self._endpoints: dict[str, Endpoint] = {}
        self._taken: dict[str, int] = {}
        self._deliveries: dict[str, _Held] = {}

    def log(self, event: AuditEvent, record: Subject) -> None:
        """Keep the webhook event of the change `event` made, with `record` as it left the
        key or identity (the store calls this in the change's own step)."""
        kind = EVENT_OF_ACTION.get(event.action)
        if kind is None or not self._endpoints:
            return
        self._seq += 1
        self._log.append(_Entry(self._seq, kind, event.time, record))

    async def add_endpoint(self, endpoint: Endpoint) -> None:
        self._endpoints[endpoint.id] = endpoint
        self._taken[endpoint.id] = self._seq

    async def endpoints(self) -> list[Endpoint]:
        return sorted(self._endpoints.values(), key=lambda item: (item.created_at, item.id))

    async def remove_endpoint(self, endpoint_id: str) -> bool:
        if self._endpoints.pop(endpoint_id, None) is None:
            return False
        del self._taken[endpoint_id]
        for delivery_id, held in list(self._deliveries.items()):
            if held.delivery.webhook_id == endpoint_id:
                del self._deliveries[delivery_id]
        return True

    async def roll_secret(self, endpoint_id: str, secret: str, overlap_until: datetime) -> bool:
        endpoint = self._endpoints.get(endpoint_id)
        if endpoint is None:
            return False
        self._endpoints[endpoint_id] = replace(
            endpoint, secret=secret, previous_secret=endpoint.secret, previous_until=overlap_until
        )
        return True

    async def forget_previous_secrets(self, now: datetime) -> int:
        ended = [
            endpoint
            for endpoint in self._endpoints.values()
            if endpoint.previous_secret is not None
            and (endpoint.previous_until is None or endpoint.previous_until <= now)
        ]
        for endpoint in ended:
            self._endpoints[endpoint.id] = replace(
                endpoint, previous_secret=None, previous_until=None
            )
        return len(ended)

    def _make(
        self,
        delivery_id: str,
        endpoint_id: str,
        key_id: str,
        event: str,
        *,
        workspace: str,
        now: datetime,
        order: int,
        body: bytes,
    ) -> bool:
        if delivery_id in self._deliveries:
            return False
        self._deliveries[delivery_id] = _Held(
            Delivery(
                id=delivery_id,
                webhook_id=endpoint_id,
                key_id=key_id,
                event=event,
                status="pending",
                attempts=0,
                created_at=now,
                next_attempt_at=now,
                last_attempt_at=None,
                last_status=None,
                last_error=None,
                workspace=workspace,
                order=order,
            ),
            order,
            body,
        )
        return True

    async def take(self, now: datetime, limit: int = 500) -> int:
        made = 0
        for endpoint in self._endpoints.values():
            mark = self._taken[endpoint.id]
            for entry in self._log:
                sent = delivered_as(endpoint.events, entry.event)
                if entry.seq <= mark or sent is None:
                    continue
                if endpoint.workspace not in (None, entry.record.workspace):
                    continue
                made += self._make(
                    "msg_" + secrets.token_hex(12),
                    endpoint.id,
                    subject_of(entry.record),
                    sent,
                    workspace=entry.record.workspace,
                    now=now,
                    order=entry.seq,
                    body=event_body(sent, entry.at, entry.record),
                )
            self._taken[endpoint.id] = self._seq
        self._log.clear()  # every endpoint took it all
        return made

    async def expiring(self, now: datetime) -> int:
        endpoints = wanting(self._endpoints.values(), "key.expiring")
        records = await self._store.list() if endpoints else []
        return self._make_timed(
            [due for record in records for due in expiring_deliveries(endpoints, record, now)],
            now,
        )

    async def usage_thresholds(self, now: datetime) -> int:
        endpoints = wanting(self._endpoints.values(), "key.usage_threshold")
        records = await self._store.list() if endpoints else []
        made = [
            due for record in records for due in usage_threshold_deliveries(endpoints, record, now)
        ]
        made += await identity_usage_deliveries(
            self._endpoints.values(), self._store.identities(), now
        )
        return self._make_timed(made, now)

    async def make_deliveries(self, deliveries: Sequence[Timed], now: datetime) -> int:
        return self._make_timed(deliveries, now)

    def _make_timed(self, made: Iterable[Timed], now: datetime) -> int:
        return sum(
            self._make(
                due.id,
                due.webhook_id,
                due.key_id,
                due.event,
                workspace=due.workspace,
                now=now,
                order=self._seq,
                body=due.body,
            )
            for due in made
            if due.webhook_id in self._endpoints  # not for an endpoint removed meanwhile
        )

    async def claim(
        self,
        holder: str,
        now: datetime,
        lease_until: datetime,
        limit: int,
        *,
        room: Mapping[str, int] | None = None,
    ) -> list[Claimed]:
        pending = sorted(
            (held for held in self._deliveries.values() if held.delivery.status == "pending"),
            key=lambda held: held.order,
        )
        first: dict[tuple[str, str], _Held] = {}
        for held in pending:
            first.setdefault((held.delivery.webhook_id, held.delivery.key_id), held)
        due = [
            held
            for held in first.values()
            if held.delivery.next_attempt_at <= now
            and (held.lease_until is None or held.lease_until < now)
        ]
        claimed: list[Claimed] = []
        for held in fair_share(due, lambda held: held.delivery.webhook_id, room, limit):
            held.holder, held.lease_until = holder, lease_until
            delivery = held.delivery
            claimed.append(
                Claimed(
                    id=delivery.id,
                    webhook_id=delivery.webhook_id,
                    body=held.body,
                    attempts=delivery.attempts,
                    created_at=delivery.created_at,
                )
            )
        return claimed

    async def finish(
        self,
        delivery_id: str,
        holder: str,
        *,
        now: datetime,
        status: DeliveryStatus,
        next_attempt_at: datetime,
        response: int | None,
        error: str | None,
    ) -> None:
        held = self._deliveries.get(delivery_id)
        if held is None or held.holder != holder:
            return
        held.delivery = replace(
            held.delivery,
            status=status,
            attempts=held.delivery.attempts + 1,
            last_attempt_at=now,
            next_attempt_at=next_attempt_at,
            last_status=response,
            last_error=None if error is None else error[:200],
        )
        held.holder = held.lease_until = None

    async def deliveries(
        self,
        *,
        status: DeliveryStatus | None = None,
        workspace: str | None = None,
        limit: int = 100,
    ) -> list[Delivery]:
        return await self.deliveries_page(None, status=status, workspace=workspace, limit=limit)

    async def deliveries_page(
        self,
        start: DeliveryPosition | None,
        *,
        status: DeliveryStatus | None = None,
        workspace: str | None = None,
        limit: int = 100,
    ) -> list[Delivery]:
        listed = sorted(
            (
                (held.order, held.delivery.id)
                for held in self._deliveries.values()
                if (status is None or held.delivery.status == status)
                and (workspace is None or held.delivery.workspace == workspace)
            ),
            reverse=True,
        )
        chosen = [place for place in listed if start is None or place < start][:limit]
        return [self._deliveries[delivery_id].delivery for _, delivery_id in chosen]

    async def delivery(self, delivery_id: str) -> Delivery | None:
        held = self._deliveries.get(delivery_id)
        return None if held is None else held.delivery

    async def prune(self, before: datetime, limit: int = 1000) -> int:
        old = [
            delivery_id
            for delivery_id, held in self._deliveries.items()
            if held.delivery.status != "pending"
            and held.delivery.last_attempt_at is not None
            and held.delivery.last_attempt_at < before
        ][:limit]
        for delivery_id in old:
            del self._deliveries[delivery_id]
        return len(old)

    async def replay(self, delivery_id: str, now: datetime) -> bool:
        held = self._deliveries.get(delivery_id)
        if held is None:
            return False
        if held.lease_until is not None and held.lease_until >= now:
            raise DeliveryInProgress(delivery_id)
        held.delivery = replace(
            held.delivery, status="pending", created_at=now, next_attempt_at=now
        )
        held.holder = held.lease_until = None  # a lease run out: its holder is gone
        return True
