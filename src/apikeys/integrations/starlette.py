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
answers 403, or redirects); a request with a key goes through the same `Gate` as
`APIKeyMiddleware`'s requests (address, rate limits, scopes, credits, the same usage counts),
and any refusal is answered by `on_auth_error` with the same problem+json response. Scopes
are checked with `requires("contacts:read")` and understand `resource:*` grants and full
access; give the backend the route table too (`scopes=`, the middleware's rules) to have
them checked before credits are spent. For `RateLimit` headers on every admitted response,
use `APIKeyMiddleware` instead.

The first time the backend sees a request, it holds its `scopes` and `costs` rules against
the app's routes (`apikeys.routes.check_routes`): a rule that matches no route, or differs
from one by a trailing slash, is logged and warned about (`RouteRuleWarning`), once.

A CORS preflight passes without a key wherever Starlette's `CORSMiddleware` sits: outside
`AuthenticationMiddleware` (before it in `middleware=[…]`) it answers preflights before the
backend sees them; inside, a preflight without a key is anonymous here and reaches it.
Either way no endpoint runs for a preflight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from starlette.authentication import AuthenticationBackend, AuthenticationError
from starlette.requests import HTTPConnection
from starlette.responses import Response

from apikeys import errors
from apikeys.gate import APIKeyAuth, APIKeyUser, Gate, route_path
from apikeys.manager import KeyManager
from apikeys.problems import check_realm, encode_problem
from apikeys.ratelimit import RateLimiter
from apikeys.routes import check_routes

__all__ = ["APIKeyBackend", "APIKeyRefused", "on_auth_error"]


class APIKeyRefused(AuthenticationError):
    """Starlette's `AuthenticationError`, carrying the apikeys error it stands for."""

    def __init__(self, error: errors.AuthenticationError, realm: str = "api") -> None:
        super().__init__(error.code)
        self.error = error
        self.realm = realm


class APIKeyBackend(AuthenticationBackend):
    """Authenticate `Authorization: Bearer <key>` with a `KeyManager`.

    Every key's rate limit applies, in `limiter` (default: `manager.limiter`, the one the
    manager's integrations share; `APIKEYS_LIMITER_URL` names a Redis to share it across
    processes).

    `header="X-API-Key"` reads the bare key from that one header instead, and never reads
    Authorization, as `APIKeyMiddleware(header=…)` does. `scopes` (the middleware's rules,
    `{"GET /api/v1/contacts": "contacts:read"}`) is checked before credits are spent;
    `unmapped` says what a restricted key may do on a route no rule covers (`"allow"`, the
    default here: `requires()` decides). `costs`, `policy_name`, `trusted_proxies` and
    `legacy_schemes` are the middleware's.
    """

    def __init__(
        self,
        manager: KeyManager,
        *,
        limiter: RateLimiter | None = None,
        realm: str = "api",
        header: str = "Authorization",
        trusted_proxies: int = 0,
        scopes: Mapping[str, str | Sequence[str]] | None = None,
        unmapped: Literal["deny", "allow"] = "allow",
        costs: Mapping[str, int] | None = None,
        policy_name: str = "default",
        legacy_schemes: Sequence[str] = (),
    ) -> None:
        self.manager = manager
        self.realm = check_realm(realm)
        self._rules = (dict(scopes or {}), dict(costs or {}))
        self._unchecked = True
        self.gate = Gate(
            manager,
            limiter=limiter,
            scopes=scopes,
            unmapped=unmapped,
            costs=costs,
            header=header,
            policy_name=policy_name,
            trusted_proxies=trusted_proxies,
            legacy_schemes=legacy_schemes,
        )
        """The request path `APIKeyMiddleware` runs too (`apikeys.gate`)."""

    @property
    def limiter(self) -> RateLimiter:
        """The limiter the keys' rate limits are held in."""
        return self.gate.limiter

    async def authenticate(self, conn: HTTPConnection) -> tuple[APIKeyAuth, APIKeyUser] | None:
        scope = conn.scope
        if self._unchecked:
            self._unchecked = False
            check_routes(scope.get("app"), scopes=self._rules[0], costs=self._rules[1])
        wanted = self.gate.header_name
        if not any(name == wanted for name, _ in scope["headers"]):
            return None  # anonymous: requires() refuses or redirects
        try:
            await self.gate.admit(scope, route_path(scope))
        except errors.AuthenticationError as exc:
            raise APIKeyRefused(exc, self.realm) from None
        return scope["auth"], scope["user"]


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
