"""The key format: generation, checksum and parsing.

A key reads `{prefix}_{id}_{secret}{checksum}`:

- `prefix`: lowercase letters, digits and `_`, starting with a letter: the manager's prefix
  (default `ak`) and the key's environment, `ak_live` or `ak_test`
  (`environment_prefix`); a key made before environments existed has the bare `ak`;
- `id`: 12 base62 characters, random and public (it names the key in lists and logs);
- `secret`: 32 base62 characters from `secrets`, about 190 bits;
- `checksum`: 6 base62 characters, zero-padded, of CRC32 over `{prefix}_{id}_{secret}`.

The checksum lets `parse_key` refuse typos and noise without a store lookup, and lets secret
scanners tell a real key from a random string. Parsing works from the right
(`rsplit("_", 2)`) so that a prefix may itself contain `_`.

The environment a token's prefix names is never trusted alone: the key's record says what
its environment is, and a token whose prefix names another is refused as an unknown key.
"""

from __future__ import annotations

import functools
import re
import secrets
import zlib
from collections.abc import Callable, Iterable
from typing import NamedTuple

from apikeys.errors import InvalidKeyParameters, MalformedAPIKey
from apikeys.types import ENVIRONMENTS, LIVE, Environment

__all__ = [
    "BASE62",
    "CHECKSUM_LENGTH",
    "DEFAULT_PREFIX",
    "ID_LENGTH",
    "MAX_KEY_LENGTH",
    "SECRET_LENGTH",
    "ParsedKey",
    "checksum",
    "environment_prefix",
    "environments_of",
    "generate_id",
    "generate_key",
    "key_splitter",
    "manager_prefix",
    "mask",
    "parse_key",
    "parse_key_of",
    "prefixes_splitter",
    "split_key",
    "validate_prefix",
]

BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
DEFAULT_PREFIX = "ak"
ID_LENGTH = 12
SECRET_LENGTH = 32
CHECKSUM_LENGTH = 6
MAX_PREFIX_LENGTH = 32
# prefix + "_" + id + "_" + secret + checksum
MAX_KEY_LENGTH = MAX_PREFIX_LENGTH + 1 + ID_LENGTH + 1 + SECRET_LENGTH + CHECKSUM_LENGTH

_PREFIX_RE = re.compile(r"[a-z][a-z0-9_]*")
_TAIL_LENGTH = SECRET_LENGTH + CHECKSUM_LENGTH


class ParsedKey(NamedTuple):
    """A key split into its parts. Its repr hides the secret."""

    prefix: str
    id: str
    secret: str

    def __repr__(self) -> str:
        return f"ParsedKey(prefix={self.prefix!r}, id={self.id!r}, secret='…')"

    def __str__(self) -> str:
        return repr(self)

    @property
    def token(self) -> str:
        """The full key, checksum included."""
        body = f"{self.prefix}_{self.id}_{self.secret}"
        return body + checksum(body)

    @property
    def masked(self) -> str:
        """The display form shown in lists: `ak_<id>_…`."""
        return mask(self.prefix, self.id)


def validate_prefix(prefix: str) -> str:
    """Return `prefix` if it is a valid key prefix, else raise `InvalidKeyParameters`."""
    if (
        not isinstance(prefix, str)
        or len(prefix) > MAX_PREFIX_LENGTH
        or _PREFIX_RE.fullmatch(prefix) is None
    ):
        raise InvalidKeyParameters(
            "a key prefix is 1 to 32 lowercase letters, digits or '_', starting with a letter"
        )
    return prefix


# Every pair of base62 digits, so a 6-digit checksum takes three lookups.
_PAIRS = [first + second for first in BASE62 for second in BASE62]
_PAIR_BASE = 62 * 62
_PAIR_BASE_SQUARED = _PAIR_BASE * _PAIR_BASE


def checksum(body: str) -> str:
    """The 6-character base62 CRC32 of `body` (`{prefix}_{id}_{secret}`), zero-padded."""
    value = zlib.crc32(body.encode("ascii"))
    return (
        _PAIRS[value // _PAIR_BASE_SQUARED]
        + _PAIRS[value // _PAIR_BASE % _PAIR_BASE]
        + _PAIRS[value % _PAIR_BASE]
    )


def _random_base62(length: int) -> str:
    return "".join(secrets.choice(BASE62) for _ in range(length))


def generate_id() -> str:
    """A fresh random key id: 12 base62 characters."""
    return _random_base62(ID_LENGTH)


def generate_key(
    prefix: str = DEFAULT_PREFIX,
    key_id: str | None = None,
    environment: Environment | None = None,
) -> ParsedKey:
    """Generate a new key with a fresh secret (and a fresh id unless one is given): of
    `environment` (`{prefix}_live_…`, `{prefix}_test_…`) when one is given, else with
    `prefix` as it is."""
    validate_prefix(prefix)
    if environment is not None:
        prefix = environment_prefix(prefix, environment)
    return ParsedKey(prefix, key_id or generate_id(), _random_base62(SECRET_LENGTH))


def environment_prefix(prefix: str, environment: str) -> str:
    """The prefix of the keys of `environment` a manager of `prefix` makes: `ak_live`,
    `ak_test`. `InvalidKeyParameters` for an environment other than `live` or `test`."""
    if environment not in ENVIRONMENTS:
        raise InvalidKeyParameters(
            f"invalid environment {str(environment)[:20]!r}: one of {', '.join(ENVIRONMENTS)}"
        )
    return validate_prefix(f"{prefix}_{environment}")


def environments_of(prefix: str) -> dict[str, Environment]:
    """The prefixes of the tokens a manager of `prefix` reads, each with the environment it
    names: `{prefix}_live`, `{prefix}_test`, and the bare `prefix` of keys made before
    environments existed, which are live."""
    named: dict[str, Environment] = {prefix: LIVE}
    for environment in ENVIRONMENTS:
        named[environment_prefix(prefix, environment)] = environment
    return named


def mask(prefix: str, key_id: str) -> str:
    """The masked display form of a key: its prefix and id, never its secret."""
    return f"{prefix}_{key_id}_…"


def key_splitter(prefix: str) -> Callable[[str], tuple[str, str]]:
    """`split_key(token, prefix)` for one prefix, prepared once: the `(id, secret)` of a
    token of that prefix whose checksum matches, else `MalformedAPIKey`.

    Every part has a fixed size, so one regex splits. `KeyManager` makes one for its
    prefix: on the request path, the prefix's regex is not looked up again per request.
    """
    fullmatch = re.compile(
        f"{re.escape(prefix)}_([0-9A-Za-z]{{{ID_LENGTH}}})_"
        f"([0-9A-Za-z]{{{SECRET_LENGTH}}})([0-9A-Za-z]{{{CHECKSUM_LENGTH}}})"
    ).fullmatch
    crc32, pairs = zlib.crc32, _PAIRS

    def split(token: str) -> tuple[str, str]:
        try:
            found = fullmatch(token)
        except TypeError:  # not a str
            found = None
        if found is None:
            raise MalformedAPIKey()
        key_id, secret, given = found.groups()
        # checksum(), written out: this runs on every request.
        value = crc32(token[:-CHECKSUM_LENGTH].encode("ascii"))
        if (
            pairs[value // _PAIR_BASE_SQUARED]
            + pairs[value // _PAIR_BASE % _PAIR_BASE]
            + pairs[value % _PAIR_BASE]
        ) != given:
            raise MalformedAPIKey()
        return key_id, secret

    return split


def prefixes_splitter(prefixes: Iterable[str]) -> Callable[[str], tuple[str, str, str]]:
    """`key_splitter` for tokens of any of `prefixes`: the `(prefix, id, secret)` of a
    token whose checksum matches, else `MalformedAPIKey`. The id and the tail hold no `_`
    and have fixed sizes, so a token has one reading even when a prefix starts another
    (`ak` and `ak_test`)."""
    chosen = sorted({validate_prefix(prefix) for prefix in prefixes}, key=len, reverse=True)
    fullmatch = re.compile(
        f"({'|'.join(re.escape(prefix) for prefix in chosen)})_([0-9A-Za-z]{{{ID_LENGTH}}})_"
        f"([0-9A-Za-z]{{{SECRET_LENGTH}}})([0-9A-Za-z]{{{CHECKSUM_LENGTH}}})"
    ).fullmatch

    def split(token: str) -> tuple[str, str, str]:
        try:
            found = fullmatch(token)
        except TypeError:  # not a str
            found = None
        if found is None or checksum(token[:-CHECKSUM_LENGTH]) != found.group(4):
            raise MalformedAPIKey()
        return found.group(1), found.group(2), found.group(3)

    return split


_splitter = functools.lru_cache(maxsize=64)(key_splitter)


@functools.lru_cache(maxsize=64)
def _manager_splitter(prefix: str) -> Callable[[str], tuple[str, str, str]]:
    return prefixes_splitter(environments_of(prefix))


def split_key(token: str, prefix: str | None = None) -> tuple[str, str, str]:
    """`parse_key` as a plain tuple `(prefix, id, secret)`."""
    if prefix:
        key_id, secret = _splitter(prefix)(token)
        return prefix, key_id, secret
    if not isinstance(token, str) or len(token) > MAX_KEY_LENGTH or not token.isascii():
        raise MalformedAPIKey()
    parts = token.rsplit("_", 2)
    if len(parts) != 3:
        raise MalformedAPIKey()
    key_prefix, key_id, tail = parts
    if (
        len(key_id) != ID_LENGTH
        or len(tail) != _TAIL_LENGTH
        or not key_id.isalnum()
        or not tail.isalnum()
        or _PREFIX_RE.fullmatch(key_prefix) is None
        or checksum(token[:-CHECKSUM_LENGTH]) != tail[SECRET_LENGTH:]
    ):
        raise MalformedAPIKey()
    return key_prefix, key_id, tail[:SECRET_LENGTH]


def parse_key(token: str, prefix: str | None = None) -> ParsedKey:
    """Split a token into its parts, or raise `MalformedAPIKey`.

    Checks length, alphabet, the prefix (when `prefix` is given) and the checksum; it never
    touches a store, so garbage is refused for the price of one CRC32.
    """
    return ParsedKey(*split_key(token, prefix))


def parse_key_of(token: str, prefix: str) -> ParsedKey:
    """`parse_key` of a token a manager of `prefix` reads: `{prefix}_live_…`,
    `{prefix}_test_…` or the bare `{prefix}_…` of a key made before environments, else
    `MalformedAPIKey`. The environment its prefix names is checked against the key's
    record by `KeyManager.verify`, never here."""
    return ParsedKey(*_manager_splitter(prefix)(token))


def manager_prefix(key_prefix: str) -> str:
    """The prefix of the manager that makes keys of `key_prefix`: `ak` for `ak_live` and
    `ak_test`; any other prefix is a bare one, its own manager's."""
    base, underscore, environment = key_prefix.rpartition("_")
    if underscore and environment in ENVIRONMENTS and _PREFIX_RE.fullmatch(base):
        return base
    return key_prefix
