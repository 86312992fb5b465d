"""The events webhooks send, and the JSON body of each.

The body is `{"type": …, "timestamp": …, "data": {"key": <record JSON>}}`: the key's record
as `KeyRecord.to_dict()` gives it, never a secret or a hash. An identity's events
(`identity.*`) carry `{"identity": <record JSON>}` instead, as `IdentityRecord.to_dict()`
gives it; their deliveries name the identity as `i:<id>` where a key's name its id
(`subject_of`), so that an identity's events are delivered in order, as a key's are.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from apikeys.identities import IDENTITY_FIELDS, IdentityRecord
from apikeys.policies import load_metadata, parse_refill
from apikeys.ratelimit import THRESHOLDS
from apikeys.types import RECORD_FIELDS, KeyField, KeyRecord, Kind, isoformat

__all__ = [
    "EVENT_OF_ACTION",
    "EVENT_TYPES",
    "EXPIRING_NOTICES",
    "IDENTITY_EVENT_TYPES",
    "USAGE_THRESHOLDS",
    "Subject",
    "crossed_thresholds",
    "delivered_as",
    "event_body",
    "identity_from_snapshot",
    "record_from_snapshot",
    "snapshot_record",
    "subject_of",
]

Subject = KeyRecord | IdentityRecord
"""What a webhook event is about: a key, or an identity."""

IDENTITY_EVENT_TYPES: Final = (
    "identity.created",
    "identity.updated",
    "identity.disabled",
    "identity.enabled",
    "identity.revoked",
    "identity.usage_threshold",
)
"""The events about an identity: one per change of it (`identity.created` … `identity.revoked`),
and `identity.usage_threshold` when a window of one of its limits reaches a threshold."""

EVENT_TYPES: Final = (
    "key.created",
    "key.updated",
    "key.disabled",
    "key.enabled",
    "key.rolled",
    "key.revoked",
    "key.leaked",
    "key.expiring",
    "key.usage_threshold",
    *IDENTITY_EVENT_TYPES,
)
"""Every event an endpoint can ask for (all of them by default)."""

EVENT_OF_ACTION: Final[Mapping[str, str]] = {
    "created": "key.created",
    "imported": "key.created",
    "updated": "key.updated",
    "disabled": "key.disabled",
    "enabled": "key.enabled",
    "rolled": "key.rolled",
    "revoked": "key.revoked",
    "leak_revoked": "key.leaked",
    "identity.created": "identity.created",
    "identity.updated": "identity.updated",
    "identity.disabled": "identity.disabled",
    "identity.enabled": "identity.enabled",
    "identity.revoked": "identity.revoked",
}
"""The event of a change, by its audit action, for the stores that have no change log of
triggers (Redis, memory). An imported key is `key.created`, as the SQL stores' triggers
send it; a re-hash is none. An identity's change is the event its audit action names."""

EXPIRING_NOTICES: Final = (timedelta(days=7), timedelta(days=1))
"""How long before a key expires `key.expiring` is sent (once for each)."""

USAGE_THRESHOLDS: Final = THRESHOLDS
"""The percentages at which `key.usage_threshold` is sent: of a key's credits per refill
period (once each, per period), and of a rate limit's window (once each, per window)."""


def _time(value: Any) -> datetime | None:
    if value is None:
        return None
    moment = datetime.fromisoformat(str(value))
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _names(value: Any) -> tuple[str, ...]:
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        value = json.loads(value)
    return tuple(str(item) for item in value)


def _object(value: Any) -> dict[str, Any]:
    return load_metadata(value) if isinstance(value, str) else dict(value or {})


# How a row of the keys table as JSON holds each kind of field (`Kind`): the value itself
# for text and counts; lists and objects as JSON text (SQLite) or JSON (PostgreSQL).
_FROM_JSON: Final[Mapping[Kind, Callable[[Any], Any]]] = {
    Kind.TEXT: str,
    Kind.NAMES: _names,
    Kind.TIME: _time,
    Kind.COUNT: int,
    Kind.OBJECT: _object,
}
_SNAPSHOT: Final = tuple((field, _FROM_JSON[field.kind]) for field in RECORD_FIELDS)
_IDENTITY_SNAPSHOT: Final = tuple((field, _FROM_JSON[field.kind]) for field in IDENTITY_FIELDS)


def _values(
    row: Mapping[str, Any], fields: tuple[tuple[KeyField, Callable[[Any], Any]], ...]
) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for field, decode in fields:
        value = row.get(field.name)
        values[field.name] = field.empty() if value is None else decode(value)
    return values


def record_from_snapshot(row: Mapping[str, Any]) -> KeyRecord:
    """The record of a key from a row of the keys table as JSON (the change log's copy).

    A field the row lacks or holds as null has its `KeyRecord` default (`KeyError` for one a
    key must have)."""
    return KeyRecord(**_values(row, _SNAPSHOT))


def identity_from_snapshot(row: Mapping[str, Any]) -> IdentityRecord:
    """The record of an identity from a row of the identities table as JSON (the change
    log's copy), as `record_from_snapshot` makes a key's."""
    return IdentityRecord(**_values(row, _IDENTITY_SNAPSHOT))


def snapshot_record(snapshot: Mapping[str, Any]) -> Subject:
    """The record a change log entry's data holds: `{"key": …}` or `{"identity": …}`."""
    identity = snapshot.get("identity")
    if identity is not None:
        return identity_from_snapshot(identity)
    return record_from_snapshot(snapshot["key"])


def subject_of(record: Subject) -> str:
    """Whom a delivery is about, in order: a key's id, or `i:<id>` for an identity."""
    return record.subject if isinstance(record, IdentityRecord) else record.id


def event_body(event: str, at: datetime, record: Subject, **extra: Any) -> bytes:
    """The JSON body of `event` about `record` (a key, or an identity) at `at` (`extra`
    joins `data`)."""
    name = "identity" if isinstance(record, IdentityRecord) else "key"
    data: dict[str, Any] = {name: record.to_dict(), **extra}
    return json.dumps(
        {"type": event, "timestamp": isoformat(at), "data": data},
        separators=(",", ":"),
        sort_keys=True,
    ).encode()


def crossed_thresholds(record: Subject, now: datetime) -> list[tuple[int, dict[str, Any]]]:
    """The thresholds of `USAGE_THRESHOLDS` a key (or an identity) with credits and a refill
    has reached in the refill period `now` is in, each with the `data` of its
    `key.usage_threshold` (`identity.usage_threshold`) event
    (`source` `"credits"`, `threshold`, `used`, `granted`, `period_start`). A key without a
    refill has none: a store keeps its balance, not what was granted."""
    refill = parse_refill(record.credit_refill) if record.credit_refill else None
    if refill is None or record.credits is None or refill.amount <= 0:
        return []
    start = refill.period_start(now)
    refilled = record.credits_refilled_at
    if refilled is None or refilled < start:
        return []  # not spent from yet this period: its next spend refills it first
    used = max(0, refill.amount - record.credits)
    extra = {
        "source": "credits",
        "used": used,
        "granted": refill.amount,
        "period_start": isoformat(start),
    }
    return [
        (threshold, {"threshold": threshold, **extra})
        for threshold in USAGE_THRESHOLDS
        if used * 100 >= threshold * refill.amount
    ]


def delivered_as(wanted: tuple[str, ...], event: str) -> str | None:
    """The event an endpoint that asks for `wanted` (empty: every event) is sent for a
    change that is `event`; None when it is sent none.

    A key revoked because its secret leaked is `key.leaked`, sent as `key.revoked` to an
    endpoint that asks for `key.revoked` but not `key.leaked`: one event per endpoint and
    change, and no endpoint that follows revocations misses one."""
    if not wanted or event in wanted:
        return event
    if event == "key.leaked" and "key.revoked" in wanted:
        return "key.revoked"
    return None
