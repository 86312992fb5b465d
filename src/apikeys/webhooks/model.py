"""What a store keeps for webhooks: endpoints, and a delivery per event and endpoint."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from apikeys.identities import IdentityRecord
from apikeys.ratelimit import ThresholdCrossing
from apikeys.types import KeyRecord, isoformat
from apikeys.webhooks.events import (
    EXPIRING_NOTICES,
    Subject,
    crossed_thresholds,
    event_body,
    subject_of,
)

if TYPE_CHECKING:
    from apikeys.stores.contract import IdentityStore

__all__ = [
    "Claimed",
    "Delivery",
    "DeliveryStatus",
    "Endpoint",
    "Timed",
    "delivery_id",
    "expiring_deliveries",
    "fair_share",
    "identity_usage_deliveries",
    "rate_threshold_deliveries",
    "usage_threshold_deliveries",
    "wanting",
]

DeliveryStatus = Literal["pending", "delivered", "failed"]

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A URL events are sent to. `secret` signs them; `previous_secret` too, until
    `previous_until`, after a roll. `events` empty means every event; `workspace` None
    means every workspace.

    Both secrets are as the store keeps them: `sealed$<pepper id>$<nonce>`, from which a
    process with that pepper makes the secret again (`apikeys.webhooks.signing`), or, made
    without a pepper or by an earlier version, the `whsec_…` secret itself. The endpoint
    `add_endpoint` returns holds the secret itself, to be shown once."""

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

    def wants_any(self, events: Iterable[str]) -> bool:
        """Whether this endpoint is sent one of `events` (about one workspace or another)."""
        return not self.events or any(event in self.events for event in events)

    def secrets(self, now: datetime) -> tuple[str, ...]:
        """The secrets a delivery at `now` is signed with (the newest first), as the store
        keeps them (`unseal_secret` makes each a secret)."""
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
    """One event for one endpoint: its status, attempts and the last response.

    `key_id` names the key the event is about, or its identity as `i:<id>` for an
    `identity.*` event. `workspace` is the workspace of the key (or identity) the event is
    about (neither ever changes workspace), which is whose the delivery is: an endpoint
    for every workspace is sent events about keys of each, and each of those deliveries
    is that key's workspace's.
    None only from a store of your own that does not say.

    `order` is where the delivery sorts in its store's listing, newest first, by `order`
    and then `id` (`WebhookStore.deliveries_page`): the change log's sequence when its
    event was made (SQL, memory) or its event's time in microseconds (Redis); it never
    changes. None only from a store of your own that does not say: its deliveries are
    then listed one page deep."""

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
    workspace: str | None = None
    order: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "webhook_id": self.webhook_id,
            "key_id": self.key_id,
            "workspace": self.workspace,
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


def delivery_id(*parts: object) -> str:
    """The id of the delivery that `parts` (endpoint, key, and what makes the event that
    one) name: made again by any process, in any round, it is the same delivery."""
    return "msg_" + hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class Timed:
    """A delivery of an event found by the clock (`key.expiring`, `key.usage_threshold`),
    for a store to make unless it holds one of that `id` already. `workspace` is the key's
    (`Delivery.workspace`)."""

    id: str
    webhook_id: str
    key_id: str
    event: str
    body: bytes
    workspace: str


def fair_share(
    in_line: Iterable[_T],
    endpoint_of: Callable[[_T], str],
    room: Mapping[str, int] | None,
    limit: int,
) -> list[_T]:
    """At most `limit` of `in_line` (due deliveries that are first in line for their
    endpoint and key, oldest first), round robin across endpoints: each endpoint's oldest,
    then each one's second, and so on, so that one endpoint's backlog never hides another's.
    With `room`, at most `room[endpoint]` of each endpoint, none of one it does not name."""
    ranked: list[tuple[int, int, _T]] = []
    taken: dict[str, int] = {}
    for position, item in enumerate(in_line):
        endpoint = endpoint_of(item)
        rank = taken.get(endpoint, 0)
        if room is not None and rank >= room.get(endpoint, 0):
            continue
        taken[endpoint] = rank + 1
        ranked.append((rank, position, item))
    ranked.sort(key=lambda entry: (entry[0], entry[1]))
    return [item for _, _, item in ranked[: max(limit, 0)]]


def wanting(endpoints: Iterable[Endpoint], event: str) -> list[Endpoint]:
    """The endpoints that are sent `event` (about a key of one workspace or another)."""
    return [endpoint for endpoint in endpoints if not endpoint.events or event in endpoint.events]


def expiring_deliveries(
    endpoints: Iterable[Endpoint], record: KeyRecord, now: datetime
) -> list[Timed]:
    """The `key.expiring` deliveries `record` calls for at `now`: one per endpoint that
    wants it and notice of `EXPIRING_NOTICES` the key's expiry is within, each once per
    endpoint, key, notice and expiry. None for a revoked key."""
    expires_at = record.expires_at
    if record.state == "revoked" or expires_at is None:
        return []
    if not now < expires_at <= now + max(EXPIRING_NOTICES):
        return []
    return [
        Timed(
            delivery_id(endpoint.id, record.id, notice.days, expires_at),
            endpoint.id,
            record.id,
            "key.expiring",
            event_body("key.expiring", now, record, expires_in_days=notice.days),
            record.workspace,
        )
        for endpoint in endpoints
        if endpoint.wants("key.expiring", record.workspace)
        for notice in EXPIRING_NOTICES
        if expires_at - now <= notice
    ]


def usage_threshold_deliveries(
    endpoints: Iterable[Endpoint], record: Subject, now: datetime
) -> list[Timed]:
    """The `key.usage_threshold` deliveries `record` calls for at `now` (for an identity,
    `identity.usage_threshold`: its keys share its credits): one per threshold it has
    reached (`crossed_thresholds`) and endpoint that wants it, each once per endpoint, key
    (or identity), threshold and refill period. None for a revoked key or identity."""
    if record.state == "revoked":
        return []
    event = (
        "identity.usage_threshold"
        if isinstance(record, IdentityRecord)
        else ("key.usage_threshold")
    )
    subject = subject_of(record)
    endpoints = list(endpoints)
    return [
        Timed(
            delivery_id(endpoint.id, subject, f"{threshold}%", data["period_start"]),
            endpoint.id,
            subject,
            event,
            event_body(event, now, record, **data),
            record.workspace,
        )
        for threshold, data in crossed_thresholds(record, now)
        for endpoint in endpoints
        if endpoint.wants(event, record.workspace)
    ]


async def identity_usage_deliveries(
    endpoints: Iterable[Endpoint], identities: IdentityStore | None, now: datetime
) -> list[Timed]:
    """The `identity.usage_threshold` deliveries of the credits of `identities` (a store's,
    None for one that keeps none) at `now`: read only while an endpoint wants the event,
    and then every identity with credits and a refill is looked at (an identity's keys
    share one balance, so there is one look per identity, not per key)."""
    wanted = wanting(endpoints, "identity.usage_threshold")
    if not wanted or identities is None:
        return []
    return [
        due
        for record in await identities.list()
        if record.credits is not None and record.credit_refill
        for due in usage_threshold_deliveries(wanted, record, now)
    ]


def rate_threshold_deliveries(
    endpoints: Iterable[Endpoint], record: Subject, crossing: ThresholdCrossing
) -> list[Timed]:
    """The usage threshold deliveries of a rate limit's window reaching a threshold
    (`crossing`, as the limiter told it): `key.usage_threshold` about a key's own policy,
    `identity.usage_threshold` about its identity's (then `record` is the identity, and the
    policy is named `identity.<name>`, as in the request's headers). One per endpoint
    that wants the event about `record`'s workspace, each once per endpoint, key (or
    identity), policy, threshold and window. None for a revoked key or identity."""
    if record.state == "revoked":
        return []
    identity = crossing.identity is not None
    event = "identity.usage_threshold" if identity else "key.usage_threshold"
    policy = f"identity.{crossing.policy}" if identity else crossing.policy
    subject = subject_of(record)
    # Whole seconds, so that the same window is named alike however it was measured.
    window_end = isoformat(datetime.fromtimestamp(math.ceil(crossing.window_end), UTC))
    body = event_body(
        event,
        datetime.fromtimestamp(crossing.at, UTC),
        record,
        source="rate_limit",
        policy=policy,
        threshold=crossing.threshold,
        used=crossing.used,
        limit=crossing.limit,
        window=crossing.window,
        window_end=window_end,
    )
    return [
        Timed(
            delivery_id(endpoint.id, subject, policy, f"{crossing.threshold}%", window_end),
            endpoint.id,
            subject,
            event,
            body,
            record.workspace,
        )
        for endpoint in endpoints
        if endpoint.wants(event, record.workspace)
    ]
