"""The records apikeys hands out and stores, and the ASGI type aliases."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime
from typing import Any, Literal

__all__ = [
    "ACTIVE",
    "AUDIT_ACTIONS",
    "DISABLED",
    "EXPIRED",
    "REVOKED",
    "Access",
    "AuditAction",
    "AuditEvent",
    "CreatedKey",
    "DailyUsage",
    "KeyRecord",
    "Status",
    "StoredKey",
    "UsageDelta",
    "isoformat",
    "jsonable",
    "utcnow",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

Access = Literal["full", "restricted"]
Status = Literal["active", "disabled", "revoked", "expired"]
StoredState = Literal["active", "disabled", "revoked"]

ACTIVE: StoredState = "active"
DISABLED: StoredState = "disabled"
REVOKED: StoredState = "revoked"
EXPIRED: Status = "expired"


def utcnow() -> datetime:
    """The current time, timezone-aware in UTC."""
    return datetime.now(UTC)


def isoformat(moment: datetime | None) -> str | None:
    """UTC ISO 8601 ending in `Z` (`2026-01-31T12:00:00.123456Z`), or None."""
    if moment is None:
        return None
    return moment.astimezone(UTC).replace(tzinfo=None).isoformat() + "Z"


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """What apikeys knows about a key, never its secret.

    `state` is what the store holds (`active`, `disabled` or `revoked`); `status` adds the
    derived `expired` for a key whose `expires_at` has passed.
    """

    id: str
    name: str
    workspace: str
    prefix: str
    """The masked display form, `ak_<id>_…`."""
    access: Access
    scopes: tuple[str, ...]
    state: StoredState
    rate_limit: str | None
    created_at: datetime
    expires_at: datetime | None = None
    last_used_at: datetime | None = None
    request_count: int = 0
    revoked_at: datetime | None = None
    replaces: str | None = None
    """For a key made by `roll`: the id of the key it replaces."""
    replaced_by: str | None = None
    """For a rolled key: the id of the key that replaces it."""
    owner: str | None = None
    """Who the key is for (a user id, an e-mail address): the application's to set."""
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """A JSON object of the application's (at most 4 KiB). Not secret: never put one here."""
    allowed_ips: tuple[str, ...] = ()
    """CIDR ranges the key may be used from; empty: any address."""
    credits: int | None = None
    """Uses left (spent one per admitted request); None: unlimited."""
    credit_refill: str | None = None
    """`"1000/day"` or `"5000/month"`: credits are set back to that amount each UTC period."""
    credits_refilled_at: datetime | None = None
    """The start of the period the credits were last refilled for."""

    @property
    def key_prefix(self) -> str:
        """The prefix the key's token starts with (`ak`)."""
        return self.prefix[: -len(self.id) - 3]

    @property
    def masked(self) -> str:
        """The masked display form, `ak_<id>_…` (the same as `prefix`)."""
        return self.prefix

    def status_at(self, now: datetime) -> Status:
        """The key's status at `now`: revoked and disabled win over expired."""
        if self.state != ACTIVE:
            return self.state
        if self.expires_at is not None and self.expires_at <= now:
            return EXPIRED
        return ACTIVE

    @property
    def status(self) -> Status:
        """The key's status now: `active`, `disabled`, `revoked` or `expired`."""
        return self.status_at(utcnow())

    @property
    def full_access(self) -> bool:
        """True for a full-access key, which passes every scope check."""
        return self.access == "full"

    @property
    def rate_limits(self) -> tuple[dict[str, str], ...]:
        """The key's own policies as `{"name": …, "limit": …}`, in order; empty if it has none.

        Derived from `rate_limit`: `100/minute` is one policy named `default`.
        """
        if self.rate_limit is None:
            return ()
        from apikeys.errors import InvalidKeyParameters
        from apikeys.ratelimit import parse_policies

        try:
            policies = parse_policies(self.rate_limit)
        except InvalidKeyParameters:
            # Not written by apikeys: shown as it is stored rather than failing to show it.
            return ({"name": "default", "limit": self.rate_limit},)
        return tuple({"name": policy.name, "limit": policy.text} for policy in policies)

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready data, with the field names of the contract."""
        return {
            "id": self.id,
            "name": self.name,
            "workspace": self.workspace,
            "prefix": self.prefix,
            "access": self.access,
            "scopes": list(self.scopes),
            "status": self.status,
            "rate_limit": self.rate_limit,
            "rate_limits": list(self.rate_limits),
            "created_at": isoformat(self.created_at),
            "expires_at": isoformat(self.expires_at),
            "last_used_at": isoformat(self.last_used_at),
            "request_count": self.request_count,
            "revoked_at": isoformat(self.revoked_at),
            "replaces": self.replaces,
            "replaced_by": self.replaced_by,
            "owner": self.owner,
            "metadata": dict(self.metadata),
            "allowed_ips": list(self.allowed_ips),
            "credits": self.credits,
            "credit_refill": self.credit_refill,
        }

    def with_usage(self, count: int, last_used_at: datetime | None) -> KeyRecord:
        """This record with `count` more requests and a later `last_used_at`, if any."""
        if not count:
            return self
        latest = self.last_used_at
        if last_used_at is not None and (latest is None or last_used_at > latest):
            latest = last_used_at
        return replace(self, request_count=self.request_count + count, last_used_at=latest)


@dataclass(frozen=True, slots=True)
class StoredKey:
    """A record with the stored hash of its secret: what a `KeyStore` keeps."""

    record: KeyRecord
    secret_hash: str = field(repr=False)


AuditAction = Literal[
    "created", "updated", "disabled", "enabled", "rolled", "revoked", "rehashed", "leak_revoked"
]
AUDIT_ACTIONS: tuple[AuditAction, ...] = (
    "created",
    "updated",
    "disabled",
    "enabled",
    "rolled",
    "revoked",
    "rehashed",
    "leak_revoked",
)


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """One change to a key, as the audit trail keeps it: never a secret, never a hash.

    A store writes it in the same transaction (or script) as the change it records, and
    only when the change happened.
    """

    time: datetime
    key_id: str
    workspace: str
    action: AuditAction
    actor: str | None
    """Who made the change: a user, `cli:<os user>`, `github-secret-scanning`, or None."""
    changes: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """What changed: field names and their new values."""

    def to_dict(self) -> dict[str, Any]:
        """The event as JSON-ready data (CONTRACT section 9)."""
        return {
            "time": isoformat(self.time),
            "key_id": self.key_id,
            "workspace": self.workspace,
            "action": self.action,
            "actor": self.actor,
            "changes": dict(self.changes),
        }

    def encode(self) -> str:
        """The event as one line of JSON (what stores keep)."""
        return json.dumps(self.to_dict(), separators=(",", ":"), default=_json_default)

    @classmethod
    def decode(cls, text: str) -> AuditEvent:
        data = json.loads(text)
        return cls(
            time=datetime.fromisoformat(data["time"].replace("Z", "+00:00")),
            key_id=data["key_id"],
            workspace=data["workspace"],
            action=data["action"],
            actor=data["actor"],
            changes=data["changes"],
        )


def _json_default(value: object) -> object:
    if isinstance(value, datetime):
        return isoformat(value)
    if isinstance(value, tuple | frozenset | set):
        return list(value)
    raise TypeError(type(value).__name__)


def jsonable(changes: Mapping[str, Any]) -> dict[str, Any]:
    """`changes` with datetimes as ISO strings and tuples as lists, for an audit event."""
    decoded: dict[str, Any] = json.loads(json.dumps(dict(changes), default=_json_default))
    return decoded


@dataclass(frozen=True, slots=True)
class UsageDelta:
    """Requests counted in one process since the last flush, for one key."""

    count: int
    last_used_at: datetime
    daily: Mapping[tuple[str, str], int] = field(default_factory=dict, hash=False)
    """`{(UTC day "YYYY-MM-DD", outcome): requests}`: outcome `admitted`, or the code the
    request was refused with (`insufficient_scope`, `rate_limited`, …)."""


@dataclass(frozen=True, slots=True)
class DailyUsage:
    """One key's requests on one UTC day: admitted, and refused by code. `legacy_scheme`:
    how many of them (admitted or refused) sent the key under a migration's legacy scheme
    (`Authorization: Api-Key …`, see `Gate`)."""

    day: date
    admitted: int = 0
    refused: Mapping[str, int] = field(default_factory=dict, hash=False)
    legacy_scheme: int = 0

    @property
    def total(self) -> int:
        return self.admitted + sum(self.refused.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "day": self.day.isoformat(),
            "admitted": self.admitted,
            "refused": dict(self.refused),
            "legacy_scheme": self.legacy_scheme,
        }


@dataclass(frozen=True, slots=True)
class CreatedKey:
    """What `KeyManager.create` and `roll` return: the key, once, and its record.

    `warning` is None when the store confirmed the change. It holds why not when the key
    was made on the store's primary but its replicas did not confirm it in time (a
    `ChangeNotConfirmed`, on Redis with `wait_replicas`): the key works, and this is still
    the only time it is shown, but a failover before the replicas catch up could lose it.
    Check later that it is still listed, and create another if it is not.
    """

    key: str = field(repr=False)
    record: KeyRecord
    warning: str | None = None

    @property
    def confirmed(self) -> bool:
        """False when the replicas did not confirm the key in time (see `warning`)."""
        return self.warning is None

    def __repr__(self) -> str:
        unconfirmed = "" if self.warning is None else ", confirmed=False"
        return f"CreatedKey(key='{self.record.prefix}', record={self.record!r}{unconfirmed})"

    def to_dict(self) -> dict[str, Any]:
        """`key` followed by the record's fields (the CLI's `--json` output), and for a key
        its replicas did not confirm, `confirmed: false` and the `warning`."""
        unconfirmed = {} if self.warning is None else {"confirmed": False, "warning": self.warning}
        return {"key": self.key, **self.record.to_dict(), **unconfirmed}
