"""Who may change which field of a key: one table, and the one check of a requested change.

A key is changed by its operator (the Python API, the CLI, management calls with
`apikeys:admin`) or by a workspace user (the settings page, management calls with
`apikeys:write`). `KEY_FIELDS` declares, once per editable field of `KeyRecord`, which of
the two may change it; `check_change` is what every path a workspace user takes runs
before it changes anything (the page's create and edit, and any management API), so a
refused change raises `ForbiddenField` (403 `forbidden_field`) and changes nothing.

By default a workspace user sets a key's name, access and scopes, and its expiry (never
later than it is now: an operator's expiry is a ceiling); rate limits, credits and their
refill, the address allowlist, the owner and the metadata are entitlements the operator
grants, so they are the operator's. An operator may hand more fields to workspace users
(`workspace_fields`, e.g. `KeysPage(..., workspace_fields={"rate_limit"})`).
A key's workspace and environment (`live`, `test`) are set when it is made and never
changed: no role changes them. Disabling, enabling, rolling and revoking a key are not
field changes: workspace users may
do all four with their workspace's keys, but a workspace user's roll makes a key that
expires when the old one does (`workspace_roll_expiry`), never later.

The table is `apikeys.types.RECORD_FIELDS`, declared on `KeyRecord`'s fields: each field's
name, type, default, who may change it and how it is stored, once. The stores' schemas
and codecs, `to_dict`, the events' snapshots, the CLI's options, the page's fields and
`KeyManager.update` derive theirs from it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from datetime import UTC, datetime
from types import MappingProxyType

from apikeys.errors import ConfigurationError, ForbiddenField
from apikeys.scopes import GrantedScopes
from apikeys.types import RECORD_FIELDS, KeyField, KeyRecord, Role

__all__ = [
    "KEY_FIELDS",
    "OPERATOR_ONLY",
    "KeyField",
    "Role",
    "check_change",
    "check_workspace_fields",
    "workspace_may_change",
    "workspace_roll_expiry",
]


KEY_FIELDS: Mapping[str, KeyField] = MappingProxyType(
    {field.name: field for field in RECORD_FIELDS if field.changed_by is not None}
)
"""Every field a key's create or update may set, in `KeyRecord`'s order: the entries of
`RECORD_FIELDS` that name who may change them."""


OPERATOR_ONLY: frozenset[str] = frozenset({"identity"})
"""Operator fields no operator can hand to workspace users: a key's `identity` says whose
limits and credits it spends and with whom it goes off, so moving a key out of (or into)
one is never a workspace user's to do."""


def check_workspace_fields(names: Iterable[str]) -> frozenset[str]:
    """`names` as the set of extra fields an operator lets workspace users change;
    `ConfigurationError` for a name that is not a field of `KEY_FIELDS`, or is one of
    `OPERATOR_ONLY`."""
    chosen = frozenset(names)
    unknown = sorted(chosen - KEY_FIELDS.keys())
    if unknown:
        raise ConfigurationError(
            f"workspace_fields: {', '.join(unknown)} is not a key field; "
            f"the fields are {', '.join(KEY_FIELDS)}"
        )
    kept = sorted(chosen & OPERATOR_ONLY)
    if kept:
        raise ConfigurationError(
            f"workspace_fields: {', '.join(kept)} is the operator's alone "
            "(it says whose limits and credits a key spends)"
        )
    return chosen


def workspace_may_change(field: str, workspace_fields: Collection[str] = ()) -> bool:
    """Whether a workspace user may set `field` at all (its value may still be refused)."""
    entry = KEY_FIELDS.get(field)
    return entry is not None and (
        entry.changed_by == Role.WORKSPACE
        or (field in workspace_fields and field not in OPERATOR_ONLY)
    )


def check_change(
    requested: Mapping[str, object],
    *,
    role: Role,
    current: KeyRecord | None = None,
    scope_ceiling: Collection[str] | None = None,
    workspace_fields: Collection[str] = (),
) -> None:
    """Raise `ForbiddenField` unless `role` may make this change; it changes nothing.

    `requested` holds the fields a create (`current` None) or an update of `current` asks
    to set, by `KeyRecord` attribute (`access` is `"full"` or `"restricted"`): a field
    sent at all counts, even with the value it has now. The operator may set anything. A
    workspace user may set the fields `KEY_FIELDS` gives the workspace, and those named
    in `workspace_fields`; an expiry no later than `current`'s (None: never, the latest of
    all); and, given a `scope_ceiling` (the scopes of the caller's own key), no scope
    beyond it and no full access. A name outside the table is refused (fail closed).
    """
    if role == Role.OPERATOR:
        return
    order = {name: index for index, name in enumerate(KEY_FIELDS)}
    for field in sorted(requested, key=lambda name: (order.get(name, len(order)), name)):
        if not workspace_may_change(field, workspace_fields):
            raise ForbiddenField(field)
    if "expires_at" in requested and current is not None and current.expires_at is not None:
        _check_expiry(requested["expires_at"], current.expires_at)
    if scope_ceiling is not None:
        _check_scopes(requested, scope_ceiling)


def workspace_roll_expiry(current: KeyRecord, now: datetime) -> datetime | None:
    """When the key a workspace user's roll of `current` makes expires: when `current` does
    (None: never, as `current`). A roll must not outlive the expiry the key has, as an edit
    may not move it later; so a key that has expired is not rolled by a workspace user
    (`ForbiddenField`). The operator's roll keeps the key's lifetime from now instead
    (`KeyManager.roll`)."""
    if current.expires_at is not None and current.expires_at <= now:
        raise ForbiddenField(
            "expires_at",
            "the key has expired, and a roll may not give it a later expiry than it has",
        )
    return current.expires_at


def _check_expiry(wanted: object, ceiling: datetime) -> None:
    if not isinstance(wanted, datetime) or wanted.tzinfo is None or wanted > ceiling:
        raise ForbiddenField(
            "expires_at",
            "it may be brought forward, never moved past "
            f"{ceiling.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC or removed",
        )


def _check_scopes(requested: Mapping[str, object], ceiling: Collection[str]) -> None:
    if requested.get("access") == "full":
        raise ForbiddenField("access", "full access goes beyond the scopes of your own key")
    wanted = requested.get("scopes", ())
    if not isinstance(wanted, Iterable) or isinstance(wanted, str | bytes):
        raise ForbiddenField("scopes", "scopes are a list of scope names")
    granted = GrantedScopes(ceiling)
    beyond = [scope for scope in wanted if scope not in granted]
    if beyond:
        raise ForbiddenField("scopes", f"{str(beyond[0])[:50]} is beyond your own key's scopes")
