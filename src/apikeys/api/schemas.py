"""The JSON schemas of the management API's bodies, derived from the field tables, and the
one check of a request body against them.

A key's create and update bodies hold the fields `apikeys.fields.KEY_FIELDS` lists (the
ones some role may set), by their `KeyRecord` names (`access` is `"full"` or
`"restricted"`); an identity's hold `apikeys.identities.EDITABLE_FIELDS`. Each field's JSON
type comes from its `Kind`, its longest text from its `size`. The OpenAPI document
(`apikeys.api.openapi`) publishes these schemas, and `check_body` holds a body to the same
ones, so what the document promises is what is checked: an unknown member, a value of the
wrong type, a text too long is `InvalidPayload` (400) before anything else reads it.
Whether a caller may set the field at all is `apikeys.fields.check_change`'s to say.

A webhook endpoint's bodies hold what `apikeys.webhooks.admin.add_endpoint` and
`roll_endpoint_secret` take; `WEBHOOK_RESPONSE` and `DELIVERY_RESPONSE` are
`Endpoint.to_dict` and `Delivery.to_dict`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Final

from apikeys.errors import InvalidPayload
from apikeys.fields import KEY_FIELDS
from apikeys.identities import EDITABLE_FIELDS
from apikeys.policies import MAX_TEXT_LENGTH
from apikeys.types import RECORD_FIELDS, KeyField, Kind
from apikeys.webhooks.admin import MAX_URL_LENGTH
from apikeys.webhooks.events import EVENT_TYPES

__all__ = [
    "DELIVERY_RESPONSE",
    "IDENTITY_CREATE",
    "IDENTITY_UPDATE",
    "KEY_CREATE",
    "KEY_RESPONSE",
    "KEY_UPDATE",
    "MAX_COUNT",
    "MAX_NAMES",
    "NO_BODY",
    "ROLL",
    "WEBHOOK_CREATE",
    "WEBHOOK_RESPONSE",
    "WEBHOOK_ROLL",
    "check_body",
    "parse_time",
]

MAX_NAMES: Final = 100
"""The most entries a list field (scopes, allowed addresses) takes in a body."""
MAX_COUNT: Final = 2**53 - 1
"""The largest count (credits) a body takes: the largest integer every JSON reader keeps."""
MAX_GRACE_SECONDS: Final = 90 * 24 * 3600

_RFC3339: Final = re.compile(
    r"(\d{4}-\d{2}-\d{2})[Tt](\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?([Zz]|[+-]\d{2}:\d{2})"
)


def _field_schema(field: KeyField) -> dict[str, Any]:
    schema: dict[str, Any]
    if field.name == "access":
        schema = {"type": "string", "enum": ["full", "restricted"]}
    elif field.kind is Kind.TEXT:
        schema = {"type": "string", "minLength": 1, "maxLength": field.size or MAX_TEXT_LENGTH}
    elif field.kind is Kind.NAMES:
        item = {"type": "string", "minLength": 1, "maxLength": MAX_TEXT_LENGTH}
        schema = {"type": "array", "items": item, "maxItems": MAX_NAMES}
    elif field.kind is Kind.TIME:
        schema = {"type": "string", "format": "date-time"}
    elif field.kind is Kind.COUNT:
        schema = {"type": "integer", "minimum": 0, "maximum": MAX_COUNT}
    else:
        schema = {"type": "object"}
    if not field.required and schema["type"] != "array":
        schema["type"] = [schema["type"], "null"]
        if "enum" in schema:
            schema["enum"] = [*schema["enum"], None]
    schema["description"] = field.description
    return schema


def _object(
    fields: Iterable[KeyField], required: Iterable[str] = (), **extra: dict[str, Any]
) -> dict[str, Any]:
    properties = {field.name: _field_schema(field) for field in fields}
    properties.update(extra)
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


KEY_CREATE: Final[dict[str, Any]] = _object(KEY_FIELDS.values(), required=("name",))
"""A key's create body: the fields of `KEY_FIELDS` (a new key takes its caller's
environment)."""
KEY_UPDATE: Final[dict[str, Any]] = _object(KEY_FIELDS.values())
"""A key's update body: the fields of `KEY_FIELDS`, each one optional."""
ROLL: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "grace_seconds": {
            "type": "integer",
            "minimum": 0,
            "maximum": MAX_GRACE_SECONDS,
            "description": "how long the old key keeps working (default: 24 hours)",
        }
    },
    "required": [],
    "additionalProperties": False,
}
"""A roll's body."""
NO_BODY: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {},
    "required": [],
    "additionalProperties": False,
}
"""The body of a state change: none, or an empty object."""

IDENTITY_CREATE: Final[dict[str, Any]] = _object(EDITABLE_FIELDS.values())
"""An identity's create body: the fields of `EDITABLE_FIELDS`. No `id`: the API draws one
(`apikeys.api.identities.new_identity_id`), so that no caller learns which ids another
workspace uses; a customer's own reference goes in `metadata`."""
IDENTITY_UPDATE: Final[dict[str, Any]] = _object(EDITABLE_FIELDS.values())
"""An identity's update body."""


def _shown_schema(field: KeyField) -> dict[str, dict[str, Any]]:
    shown: dict[str, dict[str, Any]] = {}
    for name in field.shown_as:
        if name == "status":
            shown[name] = {"type": "string", "enum": ["active", "disabled", "revoked", "expired"]}
        elif name == "rate_limits":
            policy = {"type": "object", "properties": {"name": {}, "limit": {}}}
            shown[name] = {"type": "array", "items": policy}
        else:
            schema = _field_schema(field)
            for bound in ("minLength", "maxLength", "maxItems", "maximum", "enum"):
                schema.pop(bound, None)  # what was stored may predate a bound
            if schema["type"] == "array":
                schema["items"] = {"type": "string"}
            elif not field.required and not isinstance(schema["type"], list):
                schema["type"] = [schema["type"], "null"]
            shown[name] = schema
    return shown


KEY_RESPONSE: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        name: schema for field in RECORD_FIELDS for name, schema in _shown_schema(field).items()
    },
    "required": [name for field in RECORD_FIELDS if field.required for name in field.shown_as],
}
"""A key as the API shows it (`KeyRecord.to_dict`), never its secret."""


WEBHOOK_CREATE: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "url": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_URL_LENGTH,
            "pattern": "^[Hh][Tt][Tt][Pp][Ss]?://[!-~]+$",
            "description": "http:// or https:// with a host, printable ASCII without spaces",
        },
        "events": {
            "type": "array",
            "items": {"type": "string", "enum": list(EVENT_TYPES)},
            "maxItems": MAX_NAMES,
            "description": "the events it is sent (default: every event)",
        },
        "workspace": {
            "type": ["string", "null"],
            "minLength": 1,
            "maxLength": MAX_TEXT_LENGTH,
            "description": "only events about this workspace's keys (default: every workspace)",
        },
    },
    "required": ["url"],
    "additionalProperties": False,
}
"""A webhook endpoint's create body."""
WEBHOOK_ROLL: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "overlap_seconds": {
            "type": "integer",
            "minimum": 0,
            "maximum": MAX_GRACE_SECONDS,
            "description": "how long the old secret still signs beside the new one (default: "
            "24 hours)",
        }
    },
    "required": [],
    "additionalProperties": False,
}
"""A webhook endpoint's secret roll body."""

_TIME: Final = {"type": "string", "format": "date-time"}
_MAYBE_TIME: Final = {"type": ["string", "null"], "format": "date-time"}
WEBHOOK_RESPONSE: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "url": {"type": "string"},
        "events": {"type": "array", "items": {"type": "string"}},
        "workspace": {"type": ["string", "null"]},
        "created_at": _TIME,
    },
    "required": ["id", "url", "events", "workspace", "created_at"],
}
"""A webhook endpoint as the API shows it (`Endpoint.to_dict`), never its secret."""
DELIVERY_RESPONSE: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "webhook_id": {"type": "string"},
        "key_id": {"type": "string", "description": "the key, or `i:<id>` for an identity"},
        "workspace": {"type": ["string", "null"]},
        "event": {"type": "string"},
        "status": {"type": "string", "enum": ["pending", "delivered", "failed"]},
        "attempts": {"type": "integer"},
        "created_at": _TIME,
        "next_attempt_at": _TIME,
        "last_attempt_at": _MAYBE_TIME,
        "last_status": {"type": ["integer", "null"]},
        "last_error": {"type": ["string", "null"]},
    },
    "required": [
        "id",
        "webhook_id",
        "key_id",
        "workspace",
        "event",
        "status",
        "attempts",
        "created_at",
        "next_attempt_at",
        "last_attempt_at",
        "last_status",
        "last_error",
    ],
}
"""A webhook delivery as the API shows it (`Delivery.to_dict`)."""


def parse_time(value: str, name: str) -> datetime:
    """`value`, an RFC 3339 date-time, as an aware `datetime`; else `InvalidPayload`."""
    match = _RFC3339.fullmatch(value)
    if match is None:
        raise InvalidPayload([{"field": name, "message": "must be an RFC 3339 date-time"}])
    day, time, fraction, zone = match.groups()
    # Python reads at most 6 digits of a second's fraction.
    micros = (fraction or "0")[:6].ljust(6, "0")
    offset = "+00:00" if zone in ("Z", "z") else zone
    try:
        moment = datetime.fromisoformat(f"{day}T{time}.{micros}{offset}")
        # In UTC, as the stores keep it: a time at the edges of the calendar has none.
        moment.astimezone(UTC)
    except (ValueError, OverflowError):
        raise InvalidPayload([{"field": name, "message": "is not a date and time"}]) from None
    return moment


def _type_ok(value: object, wanted: str) -> bool:
    if wanted == "null":
        return value is None
    if wanted == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    types = {"string": str, "array": list, "object": dict, "boolean": bool}
    return isinstance(value, types[wanted])


def _problem(schema: Mapping[str, Any], value: object) -> str | None:
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    if not any(_type_ok(value, wanted) for wanted in types):
        return f"must be of type {' or '.join(types)}"
    if value is None:
        return None
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {', '.join(str(one) for one in schema['enum'] if one)}"
    if isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            return f"must be {schema.get('minLength', 0)} to {schema['maxLength']} characters"
        if "pattern" in schema and re.fullmatch(schema["pattern"].strip("^$"), value) is None:
            return "is not in the accepted form"
    if isinstance(value, int) and not schema["minimum"] <= value <= schema["maximum"]:
        return f"must be from {schema['minimum']} to {schema['maximum']}"
    if isinstance(value, list):
        if len(value) > schema["maxItems"]:
            return f"must have at most {schema['maxItems']} entries"
        for item in value:
            problem = _problem(schema["items"], item)
            if problem is not None:
                return f"entries {problem}"
    return None


def check_body(body: object, schema: Mapping[str, Any]) -> dict[str, Any]:
    """`body` if it is a JSON object that `schema` (one of this module's) accepts; else
    `InvalidPayload` listing the first problems. Date-times are returned as `datetime`."""
    if not isinstance(body, dict):
        raise InvalidPayload([{"field": "", "message": "the body must be a JSON object"}])
    properties: Mapping[str, Any] = schema["properties"]
    errors = [
        {"field": name[:50], "message": "is not a field of this request"}
        for name in body
        if name not in properties
    ]
    errors += [
        {"field": name, "message": "is required"} for name in schema["required"] if name not in body
    ]
    checked: dict[str, Any] = {}
    for name, value in body.items():
        if name not in properties:
            continue
        problem = _problem(properties[name], value)
        if problem is not None:
            errors.append({"field": name, "message": problem})
        elif properties[name].get("format") == "date-time" and value is not None:
            checked[name] = parse_time(value, name)
        else:
            checked[name] = value
    if errors:
        raise InvalidPayload(errors[:10])
    return checked
