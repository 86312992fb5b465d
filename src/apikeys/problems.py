"""The one place that turns a `RequestRefused` into an RFC 9457 problem response.

Bodies are `application/problem+json` with `type`, `title`, `status`, `detail` and a
machine-readable `code`. Headers follow RFC 6750 (`WWW-Authenticate: Bearer …`) and the
rate-limit drafts (`Retry-After`). Nothing here can carry a secret: bodies are built from
the error's class, scope names and numbers only.
"""

from __future__ import annotations

import json
from typing import Any

from apikeys.errors import (
    AuthenticationError,
    AuthUnavailable,
    ConfigurationError,
    CreditsExhausted,
    ForbiddenField,
    InsufficientScope,
    InvalidPayload,
    MissingAPIKey,
    RateLimited,
    RequestRefused,
    SigningKeysUnavailable,
)
from apikeys.types import Send

__all__ = [
    "PROBLEM_CONTENT_TYPE",
    "TYPE_BASE",
    "check_realm",
    "encode_problem",
    "problem_body",
    "problem_headers",
    "send_problem",
]

PROBLEM_CONTENT_TYPE = "application/problem+json"
TYPE_BASE = "urn:apikeys:problem:"

Headers = list[tuple[bytes, bytes]]


def problem_body(exc: RequestRefused) -> dict[str, Any]:
    """The problem+json document for `exc`."""
    body: dict[str, Any] = {
        "type": TYPE_BASE + exc.code,
        "title": exc.title,
        "status": exc.status,
        "detail": exc.detail,
        "code": exc.code,
    }
    if isinstance(exc, InsufficientScope):
        body["required_scopes"] = list(exc.required_scopes)
    if isinstance(exc, RateLimited):
        body["retry_after"] = exc.retry_after
        body["violated_policies"] = list(exc.violated_policies)
    if isinstance(exc, CreditsExhausted) and exc.retry_after is not None:
        body["retry_after"] = exc.retry_after
    if isinstance(exc, InvalidPayload):
        body["errors"] = [dict(error) for error in exc.errors]
    if isinstance(exc, ForbiddenField):
        body["field"] = exc.field
    return body


_MAX_REALM_LENGTH = 100


def check_realm(realm: object) -> str:
    """`realm` if it can stand in a `WWW-Authenticate` challenge: 1 to 100 printable ASCII
    characters (`"` and `\\` are escaped); else `ConfigurationError`, when the entry point
    is built. Another realm made every refusal fail as it was sent: a 500 for a character
    outside Latin-1, a header split in two for a line break."""
    if (
        not isinstance(realm, str)
        or not 1 <= len(realm) <= _MAX_REALM_LENGTH
        or not all(" " <= char <= "~" for char in realm)
    ):
        raise ConfigurationError(
            f"realm takes 1 to {_MAX_REALM_LENGTH} printable ASCII characters, "
            f"not {str(realm)[:50]!r}"
        )
    return realm


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def problem_headers(exc: RequestRefused, realm: str = "api") -> Headers:
    """`WWW-Authenticate` for a key's 401 and 403, `Retry-After` for 429 and 503."""
    headers: Headers = [(b"cache-control", b"no-store")]
    if not isinstance(exc, AuthenticationError):
        if isinstance(exc, SigningKeysUnavailable):
            headers.append((b"retry-after", str(exc.retry_after).encode("latin-1")))
        return headers
    challenge = f'Bearer realm="{_quote(realm)}"'
    if exc.status == 401:
        if not isinstance(exc, MissingAPIKey):
            challenge += ', error="invalid_token"'
        headers.append((b"www-authenticate", challenge.encode("latin-1")))
    elif isinstance(exc, InsufficientScope):
        scope = " ".join(exc.required_scopes)
        challenge += f', error="insufficient_scope", scope="{_quote(scope)}"'
        headers.append((b"www-authenticate", challenge.encode("latin-1")))
    elif (
        isinstance(exc, RateLimited | AuthUnavailable | CreditsExhausted)
        and exc.retry_after is not None
    ):
        headers.append((b"retry-after", str(exc.retry_after).encode("latin-1")))
    return headers


def encode_problem(
    exc: RequestRefused, realm: str = "api", extra: Headers | None = None
) -> tuple[Headers, bytes]:
    """The raw headers and body of the problem response for `exc`."""
    return _encode(exc, realm, extra or [])


def _encode(exc: RequestRefused, realm: str, extra: Headers) -> tuple[Headers, bytes]:
    body = json.dumps(problem_body(exc), separators=(",", ":")).encode()
    headers = [
        (b"content-type", PROBLEM_CONTENT_TYPE.encode()),
        (b"content-length", str(len(body)).encode()),
        *problem_headers(exc, realm),
        *exc.headers,
        *extra,
    ]
    return headers, body


# Errors whose response never varies are encoded once per (class, realm).
_STATIC: dict[tuple[type[RequestRefused], str], tuple[Headers, bytes]] = {}


async def send_problem(
    send: Send, exc: RequestRefused, realm: str = "api", extra: Headers | None = None
) -> None:
    """Send `exc` as a complete problem+json response on an ASGI `send`."""
    if (
        extra
        or exc.headers
        or isinstance(
            exc,
            InsufficientScope | RateLimited | CreditsExhausted | InvalidPayload | ForbiddenField,
        )
        or exc.detail != type(exc).detail
    ):
        headers, body = _encode(exc, realm, extra or [])
    else:
        cache_key = (type(exc), realm)
        cached = _STATIC.get(cache_key)
        if cached is None:
            cached = _STATIC[cache_key] = _encode(exc, realm, [])
        headers, body = cached
    await send({"type": "http.response.start", "status": exc.status, "headers": list(headers)})
    await send({"type": "http.response.body", "body": body})
