"""What a store keeps for webhooks: endpoints, and a delivery per event and endpoint."""

from __future__ import annotations

import abc
import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

from apikeys.ratelimit import ThresholdCrossing
from apikeys.types import KeyRecord, isoformat
from apikeys.webhooks.events import EXPIRING_NOTICES, crossed_thresholds, event_body

__all__ = [
    "Claimed",
    "Delivery",
    "DeliveryStatus",
    "Endpoint",
    "Timed",
    "WebhookStore",
    "delivery_id",
    "expiring_deliveries",
    "fair_share",
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

    `workspace` is the workspace of the key the event is about (a key never changes
    workspace), which is whose the delivery is: an endpoint for every workspace is sent
    events about keys of each, and each of those deliveries is that key's workspace's.
    None only from a store of your own that does not say."""

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
    endpoints: Iterable[Endpoint], record: KeyRecord, now: datetime
) -> list[Timed]:
    """The `key.usage_threshold` deliveries `record` calls for at `now`: one per threshold
    it has reached (`crossed_thresholds`) and endpoint that wants it, each once per
    endpoint, key, threshold and refill period. None for a revoked key."""
    if record.state == "revoked":
        return []
    endpoints = list(endpoints)
    return [
        Timed(
            delivery_id(endpoint.id, record.id, f"{threshold}%", data["period_start"]),
            endpoint.id,
            record.id,
            "key.usage_threshold",
            event_body("key.usage_threshold", now, record, **data),
            record.workspace,
        )
        for threshold, data in crossed_thresholds(record, now)
        for endpoint in endpoints
        if endpoint.wants("key.usage_threshold", record.workspace)
    ]


def rate_threshold_deliveries(
    endpoints: Iterable[Endpoint], record: KeyRecord, crossing: ThresholdCrossing
) -> list[Timed]:
    """The `key.usage_threshold` deliveries of a rate limit's window reaching a threshold
    (`crossing`, as the limiter told it): one per endpoint that wants the event about a key
    of `record`'s workspace, each once per endpoint, key, policy, threshold and window.
    None for a revoked key."""
    if record.state == "revoked":
        return []
    # Whole seconds, so that the same window is named alike however it was measured.
    window_end = isoformat(datetime.fromtimestamp(math.ceil(crossing.window_end), UTC))
    body = event_body(
        "key.usage_threshold",
        datetime.fromtimestamp(crossing.at, UTC),
        record,
        source="rate_limit",
        policy=crossing.policy,
        threshold=crossing.threshold,
        used=crossing.used,
        limit=crossing.limit,
        window=crossing.window,
        window_end=window_end,
    )
    return [
        Timed(
            delivery_id(
                endpoint.id, record.id, crossing.policy, f"{crossing.threshold}%", window_end
            ),
            endpoint.id,
            record.id,
            "key.usage_threshold",
            body,
            record.workspace,
        )
        for endpoint in endpoints
        if endpoint.wants("key.usage_threshold", record.workspace)
    ]


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

    async def forget_previous_secrets(self, now: datetime) -> int:
        """Erase the previous secret of each endpoint whose overlap has ended by `now`
        (`previous_until` at or before it): it signs nothing any more, and one stored in
        clear by an earlier version must not stay in the store. Atomic per endpoint, so a
        roll made meanwhile (a new overlap) keeps its previous secret. The number erased.
        None by default (a store of your own works unchanged, keeping them)."""
        return 0

    @abc.abstractmethod
    async def take(self, now: datetime, limit: int = 500) -> int:
        """Hand the events logged since each endpoint's mark to its deliveries, in one
        transaction with moving the mark; the number of deliveries made."""

    @abc.abstractmethod
    async def expiring(self, now: datetime) -> int:
        """Make a `key.expiring` delivery for each key that expires within a notice of
        `EXPIRING_NOTICES`, once per endpoint, key, notice and expiry; the number made.
        `expiring_deliveries` gives a key's."""

    async def usage_thresholds(self, now: datetime) -> int:
        """Make a `key.usage_threshold` delivery for each threshold of `USAGE_THRESHOLDS`
        a key with a credit refill has reached in its current period (`crossed_thresholds`),
        once per endpoint, key, threshold and period; the number made
        (`usage_threshold_deliveries` gives a key's). None by default (a store of your own
        works unchanged)."""
        return 0

    async def make_deliveries(self, deliveries: Sequence[Timed], now: datetime) -> int:
        """Store each of `deliveries` as pending from `now`, in line after what its endpoint
        has been handed, unless a delivery of its `id` is stored already (made again by any
        process, in any round, a delivery is stored once); the number made. Rate limit
        thresholds reach the store this way. None by default (a store of your own works
        unchanged, without them)."""
        return 0

    @abc.abstractmethod
    async def claim(
        self,
        holder: str,
        now: datetime,
        lease_until: datetime,
        limit: int,
        *,
        room: Mapping[str, int] | None = None,
    ) -> list[Claimed]:
        """Lease at most `limit` of the due deliveries that are first in line for their
        endpoint and key, round robin across endpoints (`fair_share`), in that order. With
        `room` (endpoint id to how many more deliveries this caller will send to it now),
        at most that many of each endpoint, and none of an endpoint it does not name: one
        endpoint's backlog or slow receiver never takes another endpoint's turn."""

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
        self,
        *,
        status: DeliveryStatus | None = None,
        workspace: str | None = None,
        limit: int = 100,
    ) -> list[Delivery]:
        """The newest deliveries (of `status`, about keys of `workspace`), newest first.
        The work is about `limit` deliveries of that workspace, however many others there
        are (more with `status`: those of other statuses are read past)."""

    @abc.abstractmethod
    async def delivery(self, delivery_id: str) -> Delivery | None:
        """The delivery of that id, or None."""

    async def prune(self, before: datetime, limit: int = 1000) -> int:
        """Delete at most `limit` deliveries that were delivered or failed before `before`
        (their last attempt); never a pending one. The number deleted. Run by every
        deliverer: deleting what another process deleted already is harmless. None by
        default (a store of your own keeps its deliveries)."""
        return 0

    @abc.abstractmethod
    async def replay(self, delivery_id: str, now: datetime) -> bool:
        """Send a delivery again (same id and body): pending from `now`, with `give_up_after`
        of retries anew; False when there is no such delivery.

        Never while a process holds its lease (it is being sent): that raises
        `DeliveryInProgress` and changes nothing, so the holder records its attempt and no
        second process sends the delivery at the same time. A lease that ran out (its
        holder is gone) is cleared."""
