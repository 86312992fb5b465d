"""Identities: one customer's keys grouped, so that they share limits and credits and can be
turned off together (CONTRACT section 13).

An identity's id is the application's (its customer or tenant id), checked by
`check_identity_id`: 1 to 64 characters of `A-Z a-z 0-9 . _ @ + -`, starting with a letter
or digit. It is used in Redis keys, Cluster hash tags and notices, so it never holds `/`,
`{`, `}`, `:` or whitespace. Where keys are named by their id (audit events, notices, the
key cache, the limiter's counters), an identity is named `i:<id>` (`identity_subject`),
which no key id can be.

`IdentityRecord` is declared field by field, as `KeyRecord` is (`apikeys.types.declare`):
`IDENTITY_FIELDS` is the one table the stores' columns and codecs, `to_dict`, the CLI's
options and `update`'s checks derive from. Every field an identity's create or update may
set is the operator's: a workspace user changes nothing of an identity (CONTRACT 12).
Its states are a key's, without expiry: `active`, `disabled`, `revoked` (final), and the
transitions are `apikeys.lifecycle.TRANSITIONS`' `disable`, `enable` and `revoke`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any, Final

from apikeys.errors import InvalidKeyParameters
from apikeys.policies import check_credits, check_metadata, check_text, parse_refill
from apikeys.types import (
    ACTIVE,
    KeyField,
    Kind,
    Role,
    StoredState,
    declare,
    field_table,
    identity_subject,
    json_value,
)

__all__ = [
    "EDITABLE_FIELDS",
    "IDENTITY_FIELDS",
    "IDENTITY_ID_PATTERN",
    "MAX_IDENTITY_ID_LENGTH",
    "IdentityRecord",
    "check_identity_id",
    "identity_changes",
    "identity_subject",
]

MAX_IDENTITY_ID_LENGTH: Final = 64
"""The longest identity id: it is part of Redis keys, hash tags and notices."""
IDENTITY_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}")
"""What an identity id may be: 1 to 64 characters, starting with a letter or a digit."""


def check_identity_id(value: object, option: str = "identity") -> str:
    """`value` if it is a valid identity id, else `InvalidKeyParameters` naming `option`
    and what an id may hold (the text is measured before it is matched)."""
    if (
        not isinstance(value, str)
        or len(value) > MAX_IDENTITY_ID_LENGTH
        or IDENTITY_ID_PATTERN.fullmatch(value) is None
    ):
        raise InvalidKeyParameters(
            f"invalid {option}: an identity id is 1 to {MAX_IDENTITY_ID_LENGTH} characters "
            "of letters, digits and . _ @ + -, starting with a letter or a digit"
        )
    return value


@dataclass(frozen=True, slots=True)
class IdentityRecord:
    """What apikeys knows about an identity: the keys it groups name it by `id`.

    `state` is `active`, `disabled` or `revoked` (final). `rate_limit` holds named policies
    in the grammar keys use (`burst=10/second, daily=10000/day`); `credits` the uses left
    (None: unlimited), set back each UTC period by `credit_refill`.
    """

    id: str = field(
        metadata=declare(Kind.TEXT, "the application's id for it", required=True, size=64)
    )
    workspace: str = field(
        metadata=declare(Kind.TEXT, "the workspace it belongs to", required=True, shared=True)
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
    created_at: datetime = field(metadata=declare(Kind.TIME, "when it was made", required=True))
    name: str | None = field(default=None, metadata=declare(Kind.TEXT, "its label", Role.OPERATOR))
    metadata: Mapping[str, Any] = field(
        default_factory=dict,
        hash=False,
        metadata=declare(Kind.OBJECT, "the application's data about it", Role.OPERATOR),
    )
    """A JSON object of the application's (at most 4 KiB). Not secret."""
    rate_limit: str | None = field(
        default=None,
        metadata=declare(
            Kind.TEXT,
            "requests per period its keys share, one or more policies",
            Role.OPERATOR,
            shared=True,
            shown_as=("rate_limit", "rate_limits"),
        ),
    )
    credits: int | None = field(
        default=None, metadata=declare(Kind.COUNT, "uses its keys have left", Role.OPERATOR)
    )
    credit_refill: str | None = field(
        default=None,
        metadata=declare(
            Kind.TEXT, "the credits set back each day or month", Role.OPERATOR, size=32
        ),
    )
    credits_refilled_at: datetime | None = field(
        default=None,
        metadata=declare(Kind.TIME, "the start of the period last refilled for", shown_as=()),
    )
    revoked_at: datetime | None = field(
        default=None, metadata=declare(Kind.TIME, "when it was revoked")
    )

    @property
    def status(self) -> StoredState:
        """`active`, `disabled` or `revoked` (an identity does not expire)."""
        return self.state

    @property
    def active(self) -> bool:
        """Whether its keys may be used (as far as the identity decides)."""
        return self.state == ACTIVE

    @property
    def subject(self) -> str:
        """`i:<id>`: its name in notices, audit events and the key cache."""
        return identity_subject(self.id)

    @property
    def rate_limits(self) -> tuple[dict[str, str], ...]:
        """Its policies as `{"name": …, "limit": …}`, in order; empty if it has none."""
        if self.rate_limit is None:
            return ()
        from apikeys.ratelimit import parse_policies

        try:
            policies = parse_policies(self.rate_limit)
        except InvalidKeyParameters:
            return ({"name": "default", "limit": self.rate_limit},)
        return tuple({"name": policy.name, "limit": policy.text} for policy in policies)

    def to_dict(self) -> dict[str, Any]:
        """The identity as JSON-ready data (the CLI's `--json`)."""
        return {name: json_value(getattr(self, name)) for name in _SHOWN}


IDENTITY_FIELDS: Final[tuple[KeyField, ...]] = field_table(IdentityRecord)
"""Every field of `IdentityRecord`, in order: the one declaration stores, `to_dict`, the CLI
and `update` derive theirs from."""

_SHOWN: Final = tuple(name for one in IDENTITY_FIELDS for name in one.shown_as)

EDITABLE_FIELDS: Final[Mapping[str, KeyField]] = MappingProxyType(
    {one.name: one for one in IDENTITY_FIELDS if one.changed_by is not None}
)
"""The fields an identity's create or update may set (every one the operator's), in order."""


def _rate_limit(value: object) -> str:
    from apikeys.ratelimit import parse_policies

    if not isinstance(value, str):
        raise InvalidKeyParameters("rate_limit must be text such as '100/minute'")
    parse_policies(value)
    return value


def _refill(value: object) -> str | None:
    refill = parse_refill(value)  # type: ignore[arg-type]
    return None if refill is None else str(refill)


_PARSERS: Final = MappingProxyType(
    {
        "name": lambda value: check_text(value, "name"),
        "metadata": check_metadata,
        "rate_limit": _rate_limit,
        "credits": check_credits,
        "credit_refill": _refill,
    }
)


def identity_changes(given: Mapping[str, object], now: datetime) -> dict[str, Any]:
    """The fields of an identity's create or update, each checked (`InvalidKeyParameters`);
    None clears a field (`{}` for metadata, unlimited credits). A refill set now starts
    now: full, unless `credits` says otherwise. A name outside `IDENTITY_FIELDS`' editable
    fields is refused."""
    unknown = sorted(given.keys() - EDITABLE_FIELDS.keys())
    if unknown:
        raise InvalidKeyParameters(
            f"not a field of an identity: {', '.join(unknown)}; "
            f"the fields are {', '.join(EDITABLE_FIELDS)}"
        )
    changes: dict[str, Any] = {
        name: EDITABLE_FIELDS[name].empty() if value is None else _PARSERS[name](value)
        for name, value in given.items()
    }
    refill = parse_refill(changes.get("credit_refill"))
    if refill is not None:
        if changes.get("credits") is None:
            changes["credits"] = refill.amount
        changes["credits_refilled_at"] = refill.period_start(now)
    return changes
