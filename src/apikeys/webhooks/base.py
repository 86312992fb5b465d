"""What a store keeps for webhooks: endpoints, and a delivery per event and endpoint."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from apikeys.types import isoformat

__all__ = ["Claimed", "Delivery", "DeliveryStatus", "Endpoint", "WebhookStore"]

DeliveryStatus = Literal["pending", "delivered", "failed"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A URL events are sent to. `secret` signs them; `previous_secret` too, until
    `previous_until`, after a roll. `events` empty means every event; `workspace` None
    means every workspace."""

    id: str
    url: str
    events: tuple[str, ...]
    workspace: str | None
    secret: str
    created_at: datetime
    previous_secret: str | None = None
    previous_until: datetime | None = None

    def __repr__(self) -> str:  # no secret in a repr
        return f"Endpoint(id={self.id!r}, url={self.url!r})"

    def wants(self, event: str, workspace: str) -> bool:
        """Whether this endpoint is sent `event` about a key of `workspace`."""
        if self.events and event not in self.events:
            return False
        return self.workspace is None or self.workspace == workspace

    def secrets(self, now: datetime) -> tuple[str, ...]:
        """The secrets a delivery at `now` is signed with (the newest first)."""
        if self.previous_secret and self.previous_until and self.previous_until > now:
            return (self.secret, self.previous_secret)
        return (self.secret,)

    def to_dict(self) -> dict[str, Any]:
        """The endpoint as JSON-ready data, without its secrets."""
        return {
            "id": self.id,
            "url": self.url,
            "events": list(self.events),
            "workspace": self.workspace,
            "created_at": isoformat(self.created_at),
        }


@dataclass(frozen=True, slots=True)
class Delivery:
    """One event for one endpoint: its status, attempts and the last response."""

    id: str
    webhook_id: str
    key_id: str
    event: str
    status: DeliveryStatus
    attempts: int
    created_at: datetime
    next_attempt_at: datetime
    last_attempt_at: datetime | None
    last_status: int | None
    last_error: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "webhook_id": self.webhook_id,
            "key_id": self.key_id,
            "event": self.event,
            "status": self.status,
            "attempts": self.attempts,
            "created_at": isoformat(self.created_at),
            "next_attempt_at": isoformat(self.next_attempt_at),
            "last_attempt_at": isoformat(self.last_attempt_at),
            "last_status": self.last_status,
            "last_error": self.last_error,
        }


@dataclass(frozen=True, slots=True)
class Claimed:
    """A delivery this process holds the lease of: what to send, and where."""

    id: str
    webhook_id: str
    body: bytes
    attempts: int
    created_at: datetime


class WebhookStore(abc.ABC):
    """The webhook side of a store: endpoints, the outbox's hand-over, and leases."""

    @abc.abstractmethod
    async def add_endpoint(self, endpoint: Endpoint) -> None:
        """Store `endpoint`; it is sent the events of changes committed after this."""

    @abc.abstractmethod
    async def endpoints(self) -> list[Endpoint]:
        """Every endpoint, oldest first."""

    @abc.abstractmethod
    async def remove_endpoint(self, endpoint_id: str) -> bool:
        """Remove the endpoint and its deliveries; False when there was none."""

    @abc.abstractmethod
    async def roll_secret(self, endpoint_id: str, secret: str, overlap_until: datetime) -> bool:
        """Sign with `secret` from now on, and with the current one too until
        `overlap_until`; False when there is no such endpoint."""

    @abc.abstractmethod
    async def take(self, now: datetime, limit: int = 500) -> int:
        """Hand the events logged since each endpoint's mark to its deliveries, in one
        transaction with moving the mark; the number of deliveries made."""

    @abc.abstractmethod
    async def expiring(self, now: datetime) -> int:
        """Make a `key.expiring` delivery for each key that expires within a notice of
        `EXPIRING_NOTICES`, once per endpoint, key, notice and expiry; the number made."""

    async def usage_thresholds(self, now: datetime) -> int:
        """Make a `key.usage_threshold` delivery for each threshold of `USAGE_THRESHOLDS`
        a key with a credit refill has reached in its current period (`crossed_thresholds`),
        once per endpoint, key, threshold and period; the number made. None by default (a
        store of your own works unchanged)."""
        return 0

    @abc.abstractmethod
    async def claim(
        self, holder: str, now: datetime, lease_until: datetime, limit: int
    ) -> list[Claimed]:
        """Lease the due deliveries that are first in line for their endpoint and key."""

    @abc.abstractmethod
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
        """Record an attempt of a delivery whose lease `holder` holds."""

    @abc.abstractmethod
    async def deliveries(
        self, *, status: DeliveryStatus | None = None, limit: int = 100
    ) -> list[Delivery]:
        """The newest deliveries (of `status`), newest first."""

    @abc.abstractmethod
    async def replay(self, delivery_id: str, now: datetime) -> bool:
        """Send a delivery again (same id and body): pending from `now`."""
