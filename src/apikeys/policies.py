"""A key's policies beyond scopes and rate limits: owner, metadata, IP allowlist, credits.

Each is checked here, once, for every way in (Python, the command line, the settings page),
and turned into the record's fields. See CONTRACT section 8 and docs/concepts/policies.md.

- `owner`: a string naming who the key is for (a user id, an e-mail address), at most 200
  characters, no control characters.
- `metadata`: a JSON object of at most `MAX_METADATA_BYTES` encoded. It is returned with the
  record and given to the application as `scope["apikey"].metadata`. It is not secret:
  never put a secret there.
- `allowed_ips`: CIDR ranges (`apikeys.addresses`); empty means any address.
- `credits`: uses left, spent one per admitted request (never below zero), with an optional
  `credit_refill` (`"1000/day"`, `"5000/month"`, UTC) that sets them back to the amount at
  the start of each period.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any, Final, NamedTuple

from apikeys.addresses import parse_allowlist
from apikeys.bounds import check_json_text, check_json_value
from apikeys.errors import InvalidKeyParameters

__all__ = [
    "MAX_CREDITS",
    "MAX_METADATA_BYTES",
    "MAX_OWNER_LENGTH",
    "MAX_REFILL_LENGTH",
    "MAX_TEXT_LENGTH",
    "POLICY_PARSERS",
    "Refill",
    "check_credits",
    "check_metadata",
    "check_owner",
    "check_text",
    "dump_metadata",
    "load_metadata",
    "parse_refill",
    "policy_fields",
]

MAX_METADATA_BYTES: Final = 4096
MAX_OWNER_LENGTH: Final = 200
MAX_CREDITS: Final = 10**12
MAX_TEXT_LENGTH: Final = 200
MAX_REFILL_LENGTH: Final = 64
"""The longest credit refill text read (`1000 per month` and spaces to spare)."""
_NOT_AN_OBJECT: Final = 'metadata must be a JSON object, e.g. {"plan": "pro"}'
# Lone surrogates too: no store can encode them (UTF-8 refuses), and they come from bytes
# that were not UTF-8 (a command line's arguments are decoded with surrogateescape).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_TEXT_CONTROL = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")  # a name's, as it always was
# Possessive, and no two quantifiers on the same run of spaces: linear in the text.
_REFILL = re.compile(r"\s*+(\d{1,13}+)(?:\s*+/\s*+|\s++per\s++)(day|month)\s*+", re.IGNORECASE)


def check_text(value: object, field: str) -> str:
    """`value` if it is an acceptable key name or workspace (`field`): a non-empty string
    of at most `MAX_TEXT_LENGTH` characters without control characters (nor a lone
    surrogate, which is no text: bytes that were not UTF-8); else
    `InvalidKeyParameters`."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidKeyParameters(f"{field} must be a non-empty string")
    if len(value) > MAX_TEXT_LENGTH or _TEXT_CONTROL.search(value):
        raise InvalidKeyParameters(
            f"{field} must be at most {MAX_TEXT_LENGTH} characters of valid Unicode text, "
            "without control characters"
        )
    return value


def check_owner(owner: object) -> str | None:
    """`owner` if it is an acceptable owner string (or None); else `InvalidKeyParameters`."""
    if owner is None:
        return None
    if not isinstance(owner, str) or not owner.strip():
        raise InvalidKeyParameters("owner must be a non-empty string")
    if len(owner) > MAX_OWNER_LENGTH or _CONTROL.search(owner):
        raise InvalidKeyParameters(
            f"owner must be at most {MAX_OWNER_LENGTH} characters of valid Unicode text, "
            "without control characters"
        )
    return owner


def dump_metadata(metadata: Mapping[str, Any]) -> str:
    """The canonical JSON text of `metadata` (what stores keep)."""
    return json.dumps(
        metadata, separators=(",", ":"), ensure_ascii=False, sort_keys=True, allow_nan=False
    )


def load_metadata(text: str | None) -> dict[str, Any]:
    """The metadata a store kept (`{}` for none)."""
    if not text:
        return {}
    value = json.loads(text)
    return value if isinstance(value, dict) else {}


def _size(text: str) -> int:
    try:
        return len(text.encode())
    except UnicodeEncodeError:  # a lone surrogate: no store can keep it
        raise InvalidKeyParameters("metadata must be valid Unicode text") from None


def check_metadata(metadata: object) -> dict[str, Any]:
    """`metadata` as a plain dict, if it is a JSON object of at most 4 KiB encoded, nested
    at most `MAX_JSON_DEPTH` deep. JSON text is measured before it is parsed: text over
    4 KiB (as UTF-8) is refused unread."""
    if isinstance(metadata, str):
        if len(metadata) > MAX_METADATA_BYTES or _size(metadata) > MAX_METADATA_BYTES:
            raise InvalidKeyParameters(
                f"metadata is over {MAX_METADATA_BYTES} bytes; at most "
                f"{MAX_METADATA_BYTES} are allowed"
            )
        check_json_text(metadata, "metadata")
        try:
            metadata = json.loads(metadata)
        except ValueError:
            raise InvalidKeyParameters(f"metadata is not JSON: {_NOT_AN_OBJECT}") from None
    if not isinstance(metadata, Mapping):
        raise InvalidKeyParameters(_NOT_AN_OBJECT)
    # Every value takes at least a byte once encoded: more than 4096 cannot fit.
    check_json_value(metadata, "metadata", max_items=MAX_METADATA_BYTES)
    try:
        text = dump_metadata(metadata)
    except (TypeError, ValueError):
        raise InvalidKeyParameters(
            "metadata must hold only JSON values (strings, finite numbers, booleans, null, "
            "lists, objects with string keys)"
        ) from None
    size = _size(text)
    if size > MAX_METADATA_BYTES:
        raise InvalidKeyParameters(
            f"metadata is {size} bytes as JSON; at most {MAX_METADATA_BYTES} are allowed"
        )
    return load_metadata(text)


def check_credits(credits: object) -> int | None:
    """`credits` if it is a whole number from 0 to `MAX_CREDITS` (or None: unlimited)."""
    if credits is None:
        return None
    if isinstance(credits, bool) or not isinstance(credits, int):
        raise InvalidKeyParameters("credits must be a whole number")
    if not 0 <= credits <= MAX_CREDITS:
        raise InvalidKeyParameters(f"credits must be from 0 to {MAX_CREDITS}")
    return credits


class Refill(NamedTuple):
    """Credits set back to `amount` at the start of every UTC day or month."""

    amount: int
    period: str
    """`day` or `month`."""

    def period_start(self, now: datetime) -> datetime:
        """The start of the period `now` is in (UTC)."""
        now = now.astimezone(UTC)
        day = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return day if self.period == "day" else day.replace(day=1)

    def next_start(self, now: datetime) -> datetime:
        """The start of the next period: when the credits are next refilled."""
        start = self.period_start(now)
        if self.period == "day":
            return start + timedelta(days=1)
        return (start + timedelta(days=32)).replace(day=1)

    def __str__(self) -> str:
        return f"{self.amount}/{self.period}"


def parse_refill(text: str | None) -> Refill | None:
    """`"1000/day"` or `"5000 per month"` as a `Refill`; None for None or ``""``.

    Text over `MAX_REFILL_LENGTH` characters is refused unread (`InvalidKeyParameters`).
    """
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    fits = isinstance(text, str) and len(text) <= MAX_REFILL_LENGTH
    match = _REFILL.fullmatch(text) if fits else None
    if match is None or int(match[1]) > MAX_CREDITS:
        raise InvalidKeyParameters(
            f"invalid credit refill {str(text)[:60]!r}: write it as '1000/day' or '5000/month' "
            f"(at most {MAX_REFILL_LENGTH} characters)"
        )
    return Refill(int(match[1]), match[2].lower())


def _refill_text(text: Any) -> str | None:
    refill = parse_refill(text)
    return None if refill is None else str(refill)


POLICY_PARSERS: Final[Mapping[str, Callable[[Any], Any]]] = MappingProxyType(
    {
        "owner": check_owner,
        "metadata": check_metadata,
        "allowed_ips": parse_allowlist,
        "credits": check_credits,
        "credit_refill": _refill_text,
    }
)
"""The policy fields of `KeyRecord` (`apikeys.types.RECORD_FIELDS`) with the parser each
value given to `create`/`update`, the CLI or the page goes through: it returns the value
stored, or raises `InvalidKeyParameters`. A new per-key policy is one entry here."""


def policy_fields(**given: object) -> dict[str, Any]:
    """The record fields for the policies given, parsed (those left None are not in the
    result); `TypeError` for a name that is not a policy of `POLICY_PARSERS`."""
    unknown = given.keys() - POLICY_PARSERS.keys()
    if unknown:
        raise TypeError(f"not a policy field: {', '.join(sorted(unknown))}")
    return {
        name: parse(given[name])
        for name, parse in POLICY_PARSERS.items()
        if given.get(name) is not None
    }
