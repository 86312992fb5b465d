"""A key's rate limits as written: one limit in `limits`' notation (`100/minute`), or named
policies (`burst=10/second, daily=10000/day`), parsed, bounded and written back."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterable, Mapping
from typing import Final, NamedTuple

from limits import RateLimitItem, parse_many

from apikeys.errors import InvalidKeyParameters

__all__ = [
    "DEFAULT_POLICY",
    "DEFAULT_RATE_LIMIT",
    "MAX_AMOUNT",
    "MAX_LIMIT_LENGTH",
    "MAX_POLICIES",
    "MAX_POLICIES_LENGTH",
    "MAX_WINDOW_SECONDS",
    "RATE_LIMIT_ENV",
    "THRESHOLDS",
    "Policy",
    "format_policies",
    "parse_policies",
    "parse_rate_limit",
]

RATE_LIMIT_ENV = "APIKEYS_RATE_LIMIT"
# Bounds that every limits storage can hold (Redis refuses absurd expiry times).
MAX_WINDOW_SECONDS = 366 * 24 * 3600
MAX_AMOUNT = 10**12
DEFAULT_RATE_LIMIT = "100/minute"
DEFAULT_POLICY = "default"
"""The name of a key's limit when it is written without one (`100/minute`)."""
MAX_POLICIES = 8
THRESHOLDS: Final = (80, 90, 100)
"""The percentages of a limit at which `RateLimiter.on_threshold` is told of a window (and
of the credits granted at which `key.usage_threshold` is sent)."""
MAX_LIMIT_LENGTH: Final = 64
"""The longest text of one limit read (`10000 per 365 days` and spaces to spare)."""
MAX_POLICIES_LENGTH: Final = 1024
"""The longest text of a key's limits read (`MAX_POLICIES` named limits and spaces)."""
_POLICY_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# One limit as limits' notation writes it (`100/minute`, `3 per 2 seconds`), possessive
# throughout: linear, where limits' own regex backtracks cubically on runs of spaces. Only
# what matches (and is short) is handed to limits' parse_many.
_LIMIT = re.compile(r"[0-9]++\s*+(?:/|per)\s*+(?:[0-9]++\s*+)?[a-z]++", re.IGNORECASE)
_SEPARATORS = re.compile(r"[,;]")
_SHOWN_LENGTH = 200
_NOTATION = "write one limit as '100/minute' or named ones as 'burst=10/second, daily=10000/day'"


def parse_rate_limit(limit: str) -> RateLimitItem:
    """Parse one limit in `limits` notation (`100/minute`, `3 per 2 seconds`), or raise.

    Text over `MAX_LIMIT_LENGTH` characters is refused unread (`InvalidKeyParameters`).
    """
    if isinstance(limit, str) and len(limit) <= MAX_LIMIT_LENGTH:
        return _parse_rate_limit(limit)
    raise _invalid_limit(limit)


def _invalid_limit(limit: object) -> InvalidKeyParameters:
    return InvalidKeyParameters(
        f"invalid rate limit {_shown(limit)}: write it as '100/minute' or '3 per 2 seconds' "
        f"(one limit of at most {MAX_LIMIT_LENGTH} characters, a window of at most a year)"
    )


def _shown(text: object) -> str:
    """`text` quoted for a message, cut to `_SHOWN_LENGTH` characters."""
    shown = repr(text)
    return shown if len(shown) <= _SHOWN_LENGTH else shown[:_SHOWN_LENGTH] + "…"


@functools.lru_cache(maxsize=1024)
def _parse_rate_limit(limit: str) -> RateLimitItem:
    text = limit.strip()
    items: list[RateLimitItem] = []
    if _LIMIT.fullmatch(text):
        with contextlib.suppress(ValueError):
            items = parse_many(text)
    # One limit per key: "1/second;100/minute" would silently keep only the first.
    item = items[0] if len(items) == 1 else None
    if item is None or not 1 <= item.amount <= MAX_AMOUNT or item.get_expiry() > MAX_WINDOW_SECONDS:
        raise _invalid_limit(limit)
    return item


class Policy(NamedTuple):
    """One named limit of a key: `burst` at `10/second`."""

    name: str
    item: RateLimitItem
    text: str
    """The limit as written, without its name (`10/second`)."""


def _invalid(text: object, reason: str) -> InvalidKeyParameters:
    return InvalidKeyParameters(f"invalid rate limit {_shown(text)}: {reason}; {_NOTATION}")


def parse_policies(text: str) -> tuple[Policy, ...]:
    """Parse a key's limits: `100/minute` (one policy, `default`) or named policies.

    Named policies are `name=limit` items separated by commas or semicolons
    (`burst=10/second, daily=10000/day`): names match `[a-z][a-z0-9_-]{0,31}` and are
    unique, at most `MAX_POLICIES` items, each limit in `limits` notation with a window of
    at most a year. Raises `InvalidKeyParameters` with a one-line message; text over
    `MAX_POLICIES_LENGTH` characters is refused unread.
    """
    if not isinstance(text, str) or not text.strip():
        raise _invalid(text, "no limit given")
    if len(text) > MAX_POLICIES_LENGTH:
        raise _invalid(text, f"{len(text)} characters, at most {MAX_POLICIES_LENGTH} are allowed")
    return _parse_policies(text)


@functools.lru_cache(maxsize=1024)
def _parse_policies(text: str) -> tuple[Policy, ...]:
    parts = [part.strip() for part in _SEPARATORS.split(text)]
    if len(parts) > MAX_POLICIES:
        raise _invalid(text, f"{len(parts)} limits, at most {MAX_POLICIES} are allowed")
    policies: list[Policy] = []
    for part in parts:
        name, equals, limit = part.partition("=")
        if not equals:
            if len(parts) > 1:
                reason = f"{_shown(part)} has no name (name every limit when there are several)"
                raise _invalid(text, reason if part else "an empty item")
            name, limit = DEFAULT_POLICY, part
        name, limit = name.strip(), limit.strip()
        if _POLICY_NAME.fullmatch(name) is None:
            reason = f"{_shown(name)} is not a policy name (a-z, 0-9, _ and -, 32 at most)"
            raise _invalid(text, reason)
        if any(policy.name == name for policy in policies):
            raise _invalid(text, f"the name {name!r} is used twice")
        try:
            item = parse_rate_limit(limit)
        except InvalidKeyParameters:
            reason = f"{_shown(limit)} is not one limit with a window of at most a year"
            raise _invalid(text, reason) from None
        policies.append(Policy(name, item, limit))
    return tuple(policies)


def format_policies(policies: str | Mapping[str, str] | Iterable[Policy]) -> str:
    """The canonical text of a key's limits, as `KeyRecord.rate_limit` stores it.

    Takes `{name: limit}` (`{"burst": "10/second", "daily": "10000/day"}`), `Policy`
    items, or text. One policy named `default` is its bare limit (`100/minute`); otherwise
    `burst=10/second, daily=10000/day`, in the order given. Raises `InvalidKeyParameters`.
    """
    if isinstance(policies, str):
        parsed = parse_policies(policies)
    else:
        pairs: list[tuple[object, object]]
        if isinstance(policies, Mapping):
            pairs = list(policies.items())
        else:
            pairs = []
            for policy in policies:
                if not isinstance(policy, Policy):
                    raise InvalidKeyParameters(f"invalid rate limit {policy!r}: not a Policy")
                pairs.append((policy.name, policy.text))
        if not pairs:
            raise _invalid({}, "no limit given")
        for name, limit in pairs:
            # A limit holding a separator would smuggle in another policy.
            if not isinstance(name, str) or not isinstance(limit, str) or "=" in limit:
                raise _invalid({name: limit}, "names and limits must be text, one limit each")
            if _SEPARATORS.search(limit):
                raise _invalid({name: limit}, "one limit per name")
        parsed = parse_policies(", ".join(f"{name}={limit}" for name, limit in pairs))
    if len(parsed) == 1 and parsed[0].name == DEFAULT_POLICY:
        return parsed[0].text
    return ", ".join(f"{policy.name}={policy.text}" for policy in parsed)
