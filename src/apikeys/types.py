"""The records apikeys hands out and stores, and the ASGI type aliases."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from datetime import UTC, date, datetime
from enum import StrEnum
from typing import Any, Final, Literal, get_args

__all__ = [
    "ACTIVE",
    "AUDIT_ACTIONS",
    "DISABLED",
    "ENVIRONMENTS",
    "EXPIRED",
    "LIVE",
    "RECORD_FIELDS",
    "REVOKED",
    "TEST",
    "Access",
    "AuditAction",
    "AuditEvent",
    "CreatedKey",
    "DailyUsage",
    "Environment",
    "KeyField",
    "KeyRecord",
    "Kind",
    "Role",
    "Status",
    "StoredKey",
    "UsageDelta",
    "declare",
    "field_table",
    "identity_subject",
    "isoformat",
    "json_value",
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

Environment = Literal["live", "test"]
"""Whether a key is for real traffic (`live`) or for trying things out (`test`)."""
LIVE: Environment = "live"
TEST: Environment = "test"
ENVIRONMENTS: tuple[Environment, ...] = (LIVE, TEST)


def utcnow() -> datetime:
    """The current time, timezone-aware in UTC."""
    return datetime.now(UTC)


def isoformat(moment: datetime | None) -> str | None:
    """UTC ISO 8601 ending in `Z` (`2026-01-31T12:00:00.123456Z`), or None."""
    if moment is None:
        return None
    return moment.astimezone(UTC).replace(tzinfo=None).isoformat() + "Z"


class Role(StrEnum):
    """Who asks for a change of a key's field."""

    OPERATOR = "operator"
    """The Python API, the CLI, management calls with `apikeys:admin`: may change any field."""
    WORKSPACE = "workspace"
    """The settings page, management calls with `apikeys:write`: the workspace's fields."""


class Kind(StrEnum):
    """What a field's value is, which decides how every store and the JSON form write it.

    Each store has one codec per kind (`stores/sql/schema.py`, `stores/redis/`), so a new
    field of a known kind needs no code in any store.
    """

    TEXT = "text"
    """`str`: SQL `VARCHAR(size)`, a Redis hash field as it is, a JSON string."""
    NAMES = "names"
    """`tuple[str, ...]`: a JSON list as text in SQL and Redis, a JSON list."""
    TIME = "time"
    """`datetime` in UTC: SQL `UTCDateTime`, Redis integer microseconds since the epoch,
    JSON ISO 8601 ending in `Z`."""
    COUNT = "count"
    """`int`: SQL `BIGINT`, Redis decimal text, a JSON number."""
    OBJECT = "object"
    """A JSON object: canonical JSON text in SQL and Redis (`dump_metadata`), a JSON object."""


class _NoDefault:
    def __repr__(self) -> str:
        return "NO_DEFAULT"


_MISSING: Any = _NoDefault()


@dataclass(frozen=True, slots=True)
class KeyField:
    """One field of a record as its table declares it: of `KeyRecord` (`RECORD_FIELDS`) or
    of `IdentityRecord` (`apikeys.identities.IDENTITY_FIELDS`).

    `changed_by` says who may set it through `create`/`update` (None: nobody, apikeys
    keeps it); `kind`, `required` and `size` say how it is stored (`required`: always
    stored, NOT NULL, and a stored key without it is damaged); `shared` values are interned
    when read (many keys hold the same one); `shown_as` names what `to_dict` shows for it,
    in order (the field itself unless it says otherwise).
    """

    name: str
    changed_by: Role | None
    description: str
    kind: Kind = Kind.TEXT
    required: bool = False
    size: int | None = None
    shared: bool = False
    shown_as: tuple[str, ...] = ()
    default: Any = field(default=_MISSING, repr=False, compare=False)
    default_factory: Callable[[], Any] | None = field(default=None, repr=False, compare=False)

    @property
    def has_default(self) -> bool:
        return self.default is not _MISSING or self.default_factory is not None

    def empty(self) -> Any:
        """The value of a key that has none stored: the default, else None (`KeyError` for
        a required field)."""
        if self.default_factory is not None:
            return self.default_factory()
        if self.default is not _MISSING:
            return self.default
        if self.required:
            raise KeyError(self.name)
        return None


def declare(
    kind: Kind,
    description: str,
    changed_by: Role | None = None,
    *,
    required: bool = False,
    size: int | None = None,
    shared: bool = False,
    shown_as: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """A field's entry of its record's field table (`RECORD_FIELDS`, `IDENTITY_FIELDS`), as
    the `metadata` of its dataclass field; `field_table` reads them back."""
    return {
        "apikeys": {
            "kind": kind,
            "description": description,
            "changed_by": changed_by,
            "required": required,
            "size": size,
            "shared": shared,
            "shown_as": shown_as,
        }
    }


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """What apikeys knows about a key, never its secret.

    `state` is what the store holds (`active`, `disabled` or `revoked`); `status` adds the
    derived `expired` for a key whose `expires_at` has passed.

    Each field's metadata declares it for `RECORD_FIELDS`: its kind (how stores keep it),
    who may change it, and what `to_dict` shows. A new field of a known kind is one line
    here: stores, events, `to_dict` and `update` derive from it.
    """

    id: str = field(metadata=declare(Kind.TEXT, "the key's id", required=True, size=12))
    name: str = field(metadata=declare(Kind.TEXT, "the key's label", Role.WORKSPACE, required=True))
    workspace: str = field(
        metadata=declare(Kind.TEXT, "the workspace it belongs to", required=True, shared=True)
    )
    prefix: str = field(
        metadata=declare(Kind.TEXT, "the masked display form, `ak_live_<id>_…`", required=True)
    )
    """The masked display form, `ak_live_<id>_…` (`ak_<id>_…` for a key made before
    environments existed)."""
    access: Access = field(
        metadata=declare(
            Kind.TEXT,
            "full access, or restricted to its scopes",
            Role.WORKSPACE,
            required=True,
            size=16,
            shared=True,
        )
    )
    scopes: tuple[str, ...] = field(
        metadata=declare(
            Kind.NAMES,
            "what a restricted key may do; never beyond the caller's own key's",
            Role.WORKSPACE,
            required=True,
        )
    )
    state: StoredState = field(
        metadata=declare(
            Kind.TEXT,
            "active, disabled or revoked",
            required=True,
            size=16,
            shared=True,
            shown_as=("status",),
        )
    )
    rate_limit: str | None = field(
        metadata=declare(
            Kind.TEXT,
            "requests per period, one or more policies",
            Role.OPERATOR,
            shared=True,
            shown_as=("rate_limit", "rate_limits"),
        )
    )
    created_at: datetime = field(metadata=declare(Kind.TIME, "when it was made", required=True))
    expires_at: datetime | None = field(
        default=None,
        metadata=declare(
            Kind.TIME, "when the key stops working; never later than it is now", Role.WORKSPACE
        ),
    )
    last_used_at: datetime | None = field(
        default=None, metadata=declare(Kind.TIME, "its latest request")
    )
    request_count: int = field(
        default=0, metadata=declare(Kind.COUNT, "requests it authenticated", required=True)
    )
    revoked_at: datetime | None = field(
        default=None, metadata=declare(Kind.TIME, "when it was revoked")
    )
    replaces: str | None = field(
        default=None, metadata=declare(Kind.TEXT, "the key it replaces", size=12)
    )
    """For a key made by `roll`: the id of the key it replaces."""
    replaced_by: str | None = field(
        default=None, metadata=declare(Kind.TEXT, "the key that replaces it", size=12)
    )
    """For a rolled key: the id of the key that replaces it."""
    owner: str | None = field(
        default=None, metadata=declare(Kind.TEXT, "who the key is for", Role.OPERATOR)
    )
    """Who the key is for (a user id, an e-mail address): the application's to set."""
    metadata: Mapping[str, Any] = field(
        default_factory=dict,
        hash=False,
        metadata=declare(Kind.OBJECT, "the application's data about the key", Role.OPERATOR),
    )
    """A JSON object of the application's (at most 4 KiB). Not secret: never put one here."""
    allowed_ips: tuple[str, ...] = field(
        default=(),
        metadata=declare(Kind.NAMES, "the addresses the key may be used from", Role.OPERATOR),
    )
    """CIDR ranges the key may be used from; empty: any address."""
    credits: int | None = field(
        default=None, metadata=declare(Kind.COUNT, "uses left", Role.OPERATOR)
    )
    """Uses left (spent one per admitted request); None: unlimited."""
    credit_refill: str | None = field(
        default=None,
        metadata=declare(
            Kind.TEXT, "the credits set back each day or month", Role.OPERATOR, size=32, shared=True
        ),
    )
    """`"1000/day"` or `"5000/month"`: credits are set back to that amount each UTC period."""
    credits_refilled_at: datetime | None = field(
        default=None,
        metadata=declare(Kind.TIME, "the start of the period last refilled for", shown_as=()),
    )
    """The start of the period the credits were last refilled for."""
    imported_prefix: str | None = field(
        default=None,
        metadata=declare(Kind.TEXT, "the old system's prefix of an imported key", size=64),
    )
    """An imported key's prefix in the system it came from (djangorestframework-api-key's
    `Pb7xKq2M` of `Pb7xKq2M.…`), kept to find it by; None for keys made here."""
    environment: Environment = field(
        default=LIVE,
        metadata=declare(
            Kind.TEXT,
            "live or test, fixed when the key is made",
            required=True,
            size=16,
            shared=True,
        ),
    )
    """`live` or `test`: set when the key is made (`create(environment=…)`), never changed,
    and shown in its prefix (`ak_live_…`, `ak_test_…`). Keys made before environments
    existed (`ak_…`) are live."""
    identity: str | None = field(
        default=None,
        metadata=declare(
            Kind.TEXT, "the identity the key belongs to", Role.OPERATOR, size=64, shared=True
        ),
    )
    """The id of the identity (`apikeys.identities.IdentityRecord`) the key belongs to, in
    its workspace; None for a key of no identity. The operator's to set and change."""

    @property
    def key_prefix(self) -> str:
        """The prefix the key's token starts with: `ak_live` or `ak_test` (`ak` for a key
        made before environments existed)."""
        return self.prefix[: -len(self.id) - 3]

    @property
    def masked(self) -> str:
        """The masked display form, `ak_live_<id>_…` (the same as `prefix`)."""
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
        return {name: json_value(getattr(self, name)) for name in _SHOWN}

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


def _table_field(declared: Field[Any]) -> KeyField:
    spec = dict(declared.metadata["apikeys"])
    if spec["shown_as"] is None:
        spec["shown_as"] = (declared.name,)
    factory = declared.default_factory
    return KeyField(
        declared.name,
        default=_MISSING if declared.default is MISSING else declared.default,
        default_factory=None if factory is MISSING else factory,
        **spec,
    )


def field_table(record_class: type[Any]) -> tuple[KeyField, ...]:
    """The field table of a record dataclass whose fields are each made with `declare`: a
    `KeyField` per field, in order."""
    return tuple(_table_field(one) for one in fields(record_class))


RECORD_FIELDS: tuple[KeyField, ...] = field_table(KeyRecord)
"""Every field of `KeyRecord`, in its order: the one declaration stores, events, `to_dict`,
the CLI, the page and `update` derive theirs from."""

_SHOWN: tuple[str, ...] = tuple(name for one in RECORD_FIELDS for name in one.shown_as)


def json_value(value: Any) -> Any:
    """A record field's value as JSON-ready data: times as ISO 8601 with `Z`, tuples as
    lists, mappings as dicts."""
    if isinstance(value, datetime):
        return isoformat(value)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value


AuditAction = Literal[
    "created",
    "imported",
    "updated",
    "disabled",
    "enabled",
    "rolled",
    "revoked",
    "rehashed",
    "leak_revoked",
    "identity.created",
    "identity.updated",
    "identity.disabled",
    "identity.enabled",
    "identity.revoked",
]
AUDIT_ACTIONS: tuple[AuditAction, ...] = get_args(AuditAction)

_IDENTITY_SUBJECT: Final = "i:"


def identity_subject(identity_id: str) -> str:
    """The name of identity `identity_id` where keys are named by their id: `i:<id>`, in
    its audit events' `key_id`, its notices and the key cache (key ids never hold `:`)."""
    return _IDENTITY_SUBJECT + identity_id


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """One change to a key or an identity, as the audit trail keeps it: never a secret,
    never a hash.

    A store writes it in the same transaction (or script) as the change it records, and
    only when the change happened. An identity's events have an `identity.*` action and
    `key_id` `i:<identity id>` (`identity_subject`; `identity` gives the id back).
    """

    time: datetime
    key_id: str
    """The key's id, or `i:<identity id>` for an identity's event."""
    workspace: str
    action: AuditAction
    actor: str | None
    """Who made the change: a user, `cli:<os user>`, `github-secret-scanning`, or None."""
    changes: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """What changed: field names and their new values."""

    @property
    def identity(self) -> str | None:
        """The identity's id for an identity's event, else None."""
        if self.key_id.startswith(_IDENTITY_SUBJECT):
            return self.key_id[len(_IDENTITY_SUBJECT) :]
        return None

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
