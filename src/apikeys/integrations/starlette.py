"""apikeys as a Starlette `AuthenticationBackend`, for apps built on `AuthenticationMiddleware`.

```python
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware

from apikeys.integrations.starlette import APIKeyBackend, on_auth_error

middleware = [
    Middleware(AuthenticationMiddleware, backend=APIKeyBackend(manager), on_error=on_auth_error)
]
```

A request without an `Authorization` header (or without the header named by `header=`, such
as `X-API-Key`, which then carries the bare key) is anonymous (Starlette's `requires()` then
answers 403, or redirects); any other failure is answered by `on_auth_error` with the same
problem+json body `APIKeyMiddleware` sends. Scopes are checked with `requires("contacts:read")`
and understand `resource:*` grants and full access. For `RateLimit` headers on every response,
use `APIKeyMiddleware` instead.
"""

from __future__ import annotations

import logging

from starlette.authentication import AuthenticationBackend, AuthenticationError
from starlette.requests import HTTPConnection
from starlette.responses import Response

from apikeys import errors
from apikeys.manager import KeyManager
from apikeys.middleware import (
    APIKeyAuth,
    APIKeyUser,
    _header_error,
    _key_header,
    bearer_token,
    check_address,
    check_rate_limits,
    header_token,
    spend_credit,
)
from apikeys.problems import encode_problem
from apikeys.ratelimit import RateLimiter
from apikeys.scopes import grants_for

__all__ = ["APIKeyBackend", "APIKeyRefused", "on_auth_error"]

logger = logging.getLogger("apikeys")


class APIKeyRefused(AuthenticationError):
    """Starlette's `AuthenticationError`, carrying the apikeys error it stands for."""

    def __init__(self, error: errors.AuthenticationError, realm: str = "api") -> None:
        super().__init__(error.code)
        self.error = error
        self.realm = realm


class APIKeyBackend(AuthenticationBackend):
    """Authenticate `Authorization: Bearer <key>` with a `KeyManager`.

    Every key's rate limit applies (`limiter` defaults to `RateLimiter()`, in memory with
    the default limit); pass `RateLimiter(storage_url="redis://…")` to share it.

    `header="X-API-Key"` reads the bare key from that one header instead, and never reads
    Authorization, as `APIKeyMiddleware(header=…)` does.
    """

    def __init__(
        self,
        manager: KeyManager,
        *,
        limiter: RateLimiter | None = None,
        realm: str = "api",
        header: str = "Authorization",
        trusted_proxies: int = 0,
    ) -> None:
        self.manager = manager
        self.trusted_proxies = trusted_proxies
        self.limiter = limiter if limiter is not None else RateLimiter()
        self.realm = realm
        self.header = header
        self._header_name = _key_header(header)
        self._bearer = self._header_name == b"authorization"

    async def authenticate(self, conn: HTTPConnection) -> tuple[APIKeyAuth, APIKeyUser] | None:
        header_name = self._header_name
        values = [value for name, value in conn.scope["headers"] if name == header_name]
        if not values:
            return None
        record = None
        try:
            if self._bearer:
                record = await self.manager.verify(bearer_token(values))
            else:
                record = await self.manager.verify(header_token(values, self.header))
            if record.allowed_ips:
                check_address(conn.scope, record, self.trusted_proxies)  # before any charge
            rate_headers, limited = await check_rate_limits(self.limiter, record)
            if limited is not None:
                limited.headers = tuple(rate_headers)
                raise limited
            if record.credits is not None:
                # Spent here, when the key is authenticated: `requires()` checks scopes later.
                rate_headers = await spend_credit(self.manager, self.limiter, record, rate_headers)
        except errors.AuthenticationError as exc:
            if record is not None:  # the key's request, refused: in its usage history
                self.manager.usage_buffer.refused(record.id, exc.code)
            if not self._bearer:
                exc = _header_error(exc, self.header)
            raise APIKeyRefused(exc, self.realm) from None
        except Exception:
            # An unforeseen store or limiter error: fail closed, as the middleware does.
            logger.exception("apikeys: unexpected error while authenticating; answering 503")
            raise APIKeyRefused(errors.AuthUnavailable(), self.realm) from None
        conn.scope["apikey"] = record
        return APIKeyAuth(grants_for(record.scopes, record.access == "full")), APIKeyUser(record)


def on_auth_error(conn: HTTPConnection, exc: Exception) -> Response:
    """`AuthenticationMiddleware`'s `on_error`: the problem+json response for `exc`."""
    if isinstance(exc, APIKeyRefused):
        error, realm = exc.error, exc.realm
    else:
        error, realm = errors.InvalidAPIKey(), "api"
    headers, body = encode_problem(error, realm)
    response = Response(body, status_code=error.status)
    response.raw_headers = headers
    return response
