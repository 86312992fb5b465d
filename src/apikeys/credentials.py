"""Reading the API key from a request's headers.

`Authorization: Bearer <key>` by default; or the bare key in one other header that the
application names (`X-API-Key`), and then Authorization is never read. Only one header is
ever read, never twice, never the query string. Whether the token is in the key format is
`KeyManager.verify`'s to check.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from apikeys.errors import AuthenticationError, ConfigurationError, MalformedAPIKey, MissingAPIKey

__all__ = ["MAX_AUTHORIZATION_LENGTH", "bearer_token", "header_error", "header_token", "key_header"]

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
