"""Reading the API key from a request's headers.

`Authorization: Bearer <key>` by default; or the bare key in one other header that the
application names (`X-API-Key`), and then Authorization is never read. Only one header is
ever read, never twice, never the query string. Whether the token is in the key format is
`KeyManager.verify`'s to check.

While a migration from another library lasts, Authorization may also carry that library's
scheme (`Api-Key <key>` for djangorestframework-api-key): `legacy_schemes` checks the
scheme words a deployment turns on, `legacy_token` reads a value under one of them, and
`carries_key` tells whether a request carries a key a reader reads (so that Django REST
framework can leave schemes it does not read to other authentication classes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from apikeys.errors import AuthenticationError, ConfigurationError, MalformedAPIKey, MissingAPIKey

__all__ = [
    "MAX_AUTHORIZATION_LENGTH",
    "KeyReader",
    "LegacyToken",
    "bearer_token",
    "carries_key",
    "header_error",
    "header_token",
    "key_header",
    "legacy_schemes",
    "legacy_token",
]

MAX_AUTHORIZATION_LENGTH = 256
"""Longest value worth reading: "Bearer " and the longest key the format allows, with room."""
# An HTTP field name (RFC 9110, section 5.1): one or more token characters.
_FIELD_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def bearer_token(values: Sequence[bytes]) -> str:
    """The token of the request's `Authorization` header values, or the matching error.

    No header is `MissingAPIKey`; two headers, another scheme, an oversized or non-ASCII
    value is `MalformedAPIKey`. The scheme word is case-insensitive, followed by one space;
    spaces and tabs around the whole value are ignored.
    """
    if not values:
        raise MissingAPIKey()
    if len(values) > 1:  # two Authorization headers: refuse, never pick one
        raise MalformedAPIKey()
    # RFC 9110: a field value has no leading or trailing whitespace. Servers differ in
    # whether they strip it, so it is stripped here: "Bearer <key> " means one thing.
    value = values[0].strip(b" \t")
    if len(value) > MAX_AUTHORIZATION_LENGTH or value[:7].lower() != b"bearer ":
        raise MalformedAPIKey()
    try:
        return value[7:].decode("ascii")
    except UnicodeDecodeError:
        raise MalformedAPIKey() from None


def header_token(values: Sequence[bytes], header: str = "X-API-Key") -> str:
    """The key of the request's values of a header that carries the bare key (`X-API-Key`).

    `header` is the header's name as the application spells it, used only in the errors'
    details. No header is `MissingAPIKey`; two headers, an oversized or non-ASCII value is
    `MalformedAPIKey`. The value is the key alone, no scheme word; spaces and tabs around it
    are ignored. Whether the key is in the key format is `KeyManager.verify`'s to check.
    """
    if not values:
        raise header_error(MissingAPIKey(), header)
    value = values[0].strip(b" \t")
    # Two headers of that name: refuse, never pick one.
    if len(values) > 1 or len(value) > MAX_AUTHORIZATION_LENGTH or not value.isascii():
        raise header_error(MalformedAPIKey(), header)
    return value.decode("ascii")


def header_error(exc: AuthenticationError, header: str) -> AuthenticationError:
    """`exc`, its detail naming `header` instead of Authorization when it is about the header.

    For `MissingAPIKey` and `MalformedAPIKey` (whoever raised them: `header_token` or
    `KeyManager.verify`) when the key is read from another header; other errors unchanged.
    """
    if exc.detail != type(exc).detail:
        return exc
    if isinstance(exc, MissingAPIKey):
        return MissingAPIKey(f"Send the API key in the {header} header.")
    if isinstance(exc, MalformedAPIKey):
        return MalformedAPIKey(f"The {header} header is not exactly one well-formed API key.")
    return exc


def key_header(header: str) -> bytes:
    """The lower-case name of the header that carries the key; `b"authorization"` is Bearer.

    Raises `ConfigurationError` unless `header` is a valid HTTP field name.
    """
    if not isinstance(header, str) or _FIELD_NAME.fullmatch(header) is None:
        raise ConfigurationError(
            f"header {header!r} is not an HTTP header name: name one header, such as "
            "'X-API-Key', in letters, digits and !#$%&'*+-.^_`|~"
        )
    return header.lower().encode("ascii")


def legacy_schemes(schemes: Sequence[str], header: str = "Authorization") -> tuple[bytes, ...]:
    """The scheme words of `schemes` as `legacy_token` matches them: lower-case, each
    followed by its one space (`b"api-key "`).

    Raises `ConfigurationError` for a word that is not an HTTP token (RFC 9110's
    auth-scheme), for `Bearer` (always read), and when the key is read from another header
    than Authorization (`header`): a scheme is a word of Authorization.
    """
    if isinstance(schemes, str):
        raise ConfigurationError("legacy_schemes takes a list of scheme words, e.g. ['Api-Key']")
    words: list[bytes] = []
    for scheme in schemes:
        if not isinstance(scheme, str) or _FIELD_NAME.fullmatch(scheme) is None:
            raise ConfigurationError(
                f"legacy scheme {scheme!r} is not an Authorization scheme word, such as 'Api-Key'"
            )
        if scheme.lower() == "bearer":
            raise ConfigurationError("legacy_schemes: Bearer is always read; name old schemes")
        words.append(scheme.lower().encode("ascii") + b" ")
    if words and key_header(header) != b"authorization":
        raise ConfigurationError(
            f"legacy_schemes are words of the Authorization header; the key is read from {header}"
        )
    return tuple(dict.fromkeys(words))


def legacy_token(value: bytes, schemes: tuple[bytes, ...]) -> str | None:
    """The token of an Authorization `value` (stripped, ASCII, of a bounded length) under one
    of the legacy `schemes` (`legacy_schemes`' words), or None when it names none of them.
    The scheme word is case-insensitive and followed by exactly one space."""
    for word in schemes:
        if value[: len(word)].lower() == word:
            return value[len(word) :].decode("ascii")
    return None


def carries_key(
    headers: Iterable[tuple[bytes, bytes]], header_name: bytes, legacy: tuple[bytes, ...] = ()
) -> bool:
    """True when a request's `headers` carry a key for a reader of `header_name` (as
    `key_header` answers it): that header, and for Authorization a scheme the reader reads,
    Bearer or one of the `legacy` words (`legacy_schemes`), in any of the request's
    Authorization headers. Another scheme alone (`Basic`, `Token`) is for other
    authentication to read."""
    for name, value in headers:
        if name == header_name:
            if header_name != b"authorization":
                return True
            # Any of the request's Authorization headers: one of ours beside another's is a
            # request the gate refuses (two headers), never one left to another reader.
            words = value.split(None, 1)
            scheme = words[0].lower() if words else b""
            if scheme == b"bearer" or scheme + b" " in legacy:
                return True
    return False


class LegacyToken(Exception):
    """`KeyReader.read` found the key under a legacy scheme (`Api-Key <key>`). Raised, not
    returned, so that the usual Bearer request pays nothing for the legacy schemes."""

    def __init__(self, token: str) -> None:
        self.token = token


class KeyReader:
    """Reads the key from a request's one key header: `Authorization: Bearer <key>` (and the
    `legacy_schemes` a migration turns on), or the bare key in another `header`.

    Raises `ConfigurationError` for a header or scheme word that cannot be one.
    """

    __slots__ = ("bearer", "header", "header_name", "legacy")

    def __init__(self, header: str = "Authorization", schemes: Sequence[str] = ()) -> None:
        self.header = header
        self.header_name = key_header(header)
        """The lower-case name of the header the key is read from."""
        self.bearer = self.header_name == b"authorization"
        self.legacy = legacy_schemes(schemes, header)

    def read(self, headers: Iterable[tuple[bytes, bytes]]) -> str:
        """The key in `headers`' one key header, read as `bearer_token` and `header_token`
        read it; their errors for a missing, doubled or malformed header; `LegacyToken`
        for a key under a legacy scheme."""
        header_name = self.header_name
        value: bytes | None = None
        for name, found in headers:
            if name == header_name:
                if value is not None:
                    value = None
                    break  # two: refused by the readers below
                value = found
        if value is not None:
            value = value.strip(b" \t")
            if len(value) <= MAX_AUTHORIZATION_LENGTH and value.isascii():
                if not self.bearer:
                    return value.decode("ascii")
                # The usual spelling first, sparing the two objects of the slice and lower().
                if value.startswith(b"Bearer ") or value[:7].lower() == b"bearer ":
                    return value[7:].decode("ascii")
                if self.legacy:
                    legacy = legacy_token(value, self.legacy)
                    if legacy is not None:
                        raise LegacyToken(legacy)
        values = [found for name, found in headers if name == header_name]
        return bearer_token(values) if self.bearer else header_token(values, self.header)

    def reads(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """True when `headers` carry a key this reader reads (see `carries_key`)."""
        return carries_key(headers, self.header_name, self.legacy)

    def error(self, exc: AuthenticationError) -> AuthenticationError:
        """`exc` as this reader's header names it (see `header_error`)."""
        return exc if self.bearer else header_error(exc, self.header)
