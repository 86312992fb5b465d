"""`APIKeyMiddleware`: a pure ASGI middleware that authenticates, scopes and rate-limits.

```python
app = APIKeyMiddleware(
    app,
    manager=manager,
    scopes={"GET /api/v1/contacts": "contacts:read"},
    protect="/api/",
    rate_limit="100/minute",
    limiter_url="memory://",
)
```

Requests under `protect` need `Authorization: Bearer <key>`, or, with `header="X-API-Key"`,
the bare key in that one header instead (then Authorization is never read). A request that
passes reaches the app with `scope["apikey"]` (the `KeyRecord`), and `scope["auth"]` /
`scope["user"]` set the way Starlette's `AuthenticationMiddleware` sets them, so `requires()`
works. Every refusal is an `application/problem+json` response; nothing unexpected becomes
a 500 or lets a request through.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Mapping, Sequence
from typing import Literal

from starlette.datastructures import Headers as StarletteHeaders

from apikeys.credentials import bearer_token, header_token
from apikeys.errors import AuthenticationError, ConfigurationError
from apikeys.gate import (
    APIKeyAuth,
    APIKeyUser,
    Gate,
    check_address,
    check_rate_limits,
    credit_headers,
    rate_limit_headers,
    route_path,
    spend_credit,
)
from apikeys.manager import KeyManager
from apikeys.problems import check_realm, send_problem
from apikeys.ratelimit import RateLimiter
from apikeys.routes import CostTable, ScopeTable, check_routes, is_preflight, preflight_answerer
from apikeys.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "APIKeyAuth",
    "APIKeyMiddleware",
    "APIKeyUser",
    "CostTable",
    "ScopeTable",
    "bearer_token",
    "check_address",
    "check_rate_limits",
    "credit_headers",
    "header_token",
    "rate_limit_headers",
    "spend_credit",
]

logger = logging.getLogger("apikeys")


class APIKeyMiddleware:
    """Authenticate every HTTP and WebSocket request under `protect` with an API key.

    - `manager`: the `KeyManager` that verifies keys.
    - `scopes`: `{"METHOD /path/{param}": "resource:action"}` (see `ScopeTable`).
    - `protect`: a path prefix (or several) that needs a key; other paths pass through.
    - `rate_limit`: the default per-key limit (`APIKEYS_RATE_LIMIT`, else `100/minute`); a
      key's own `rate_limit` overrides it. Several named limits are written
      `"burst=10/second, daily=10000/day"` or given as `{"burst": "10/second", …}`: a
      request is admitted only if each admits it (docs/concepts/rate-limits.md).
    - `limiter_url`: `memory://` or `redis://…` shared by every process; or pass `limiter`
      (`limiter=manager.limiter` shares the one the Starlette backend and the FastAPI
      dependency use by default).
    - `realm`: the realm of the `WWW-Authenticate` challenge.
    - `public`: exact paths under `protect` served without a key (an API's own OpenAPI
      document, say), so that everything else under the prefix, unknown paths included,
      is authenticated.
    - `unmapped`: what a restricted key may do on a protected route that no rule covers:
      `"deny"` (the default: 403 `insufficient_scope`) or `"allow"`. Full-access keys pass
      either way.
    - `header`: where the key is read. `"Authorization"` (the default, in any case) reads
      `Authorization: Bearer <key>`. Another header name, such as `"X-API-Key"`, reads the
      bare key from that one header (spaces and tabs around it ignored) and never reads
      Authorization; two headers of that name are `malformed_api_key`. For clients that
      cannot send Authorization. Refusals still carry `WWW-Authenticate: Bearer realm=…`.
      A name that is not a valid HTTP header name raises `ConfigurationError`.

    - `costs`: what a request costs in credits, by route (`{"POST /api/v1/campaigns/{id}/
      trigger": 5}`, the rules of `scopes`); 1 where no rule matches. For keys with credits.
    - `trusted_proxies`: how many proxies in front of the app append to `X-Forwarded-For`;
      the client address, checked against a key's `allowed_ips`, is then the one they wrote
      (counting from the right). 0 (the default) uses the connection's address and never
      reads the header.
    - `legacy_schemes`: Authorization schemes read besides Bearer while a migration lasts,
      for imported keys only (`("Api-Key",)`: djangorestframework-api-key's clients keep
      their header). A key apikeys issued is refused under them (401 `malformed_api_key`);
      each request under one is counted in the key's usage as `legacy_scheme`
      (docs/migrating.md). None by default.

    A key's policies are checked in this order: its address (403 `ip_not_allowed`, charged
    to nothing), its rate limits (429 `rate_limited`), its scopes (403
    `insufficient_scope`), then one of its credits is spent (429 `credits_exhausted`, and
    the rate limits charged for the request are given back).

    On `lifespan.shutdown` it writes the manager's buffered usage counts.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        manager: KeyManager,
        scopes: Mapping[str, str | Sequence[str]] | None = None,
        protect: str | Sequence[str] = "/",
        rate_limit: str | Mapping[str, str] | None = None,
        limiter_url: str = "memory://",
        limiter: RateLimiter | None = None,
        realm: str = "api",
        policy_name: str = "default",
        unmapped: Literal["deny", "allow"] = "deny",
        public: Sequence[str] = (),
        header: str = "Authorization",
        trusted_proxies: int = 0,
        costs: Mapping[str, int] | None = None,
        legacy_schemes: Sequence[str] = (),
    ) -> None:
        self.app = app
        self.manager = manager
        self.protect = (protect,) if isinstance(protect, str) else tuple(protect)
        if not all(prefix.startswith("/") for prefix in self.protect):
            raise ConfigurationError("protect takes path prefixes that start with '/'")
        if isinstance(public, str) or not all(path.startswith("/") for path in public):
            raise ConfigurationError("public takes a list of paths that start with '/'")
        self.public = frozenset(public)
        self._owns_limiter = limiter is None
        self.limiter = limiter or RateLimiter(rate_limit, limiter_url)
        self.realm = check_realm(realm)
        self.gate = Gate(
            manager,
            limiter=self.limiter,
            scopes=ScopeTable(scopes),
            unmapped=unmapped,
            costs=costs,
            header=header,
            policy_name=policy_name,
            trusted_proxies=trusted_proxies,
            legacy_schemes=legacy_schemes,
        )
        """The request path, which every entry point shares (`apikeys.gate`)."""
        self._rules = (dict(scopes or {}), dict(costs or {}))
        # Starlette's CORSMiddleware inside: a preflight without a key is answered here as it
        # would answer it, and the app is not called (nothing of it runs without a key).
        self._cors = preflight_answerer(app)

    @property
    def header(self) -> str:
        """The header the key is read from, as given."""
        return self.gate.header

    @property
    def policy_name(self) -> str:
        """How the `RateLimit` headers name a key's one unnamed limit."""
        return self.gate.policy_name

    @property
    def scopes(self) -> ScopeTable | None:
        """The route table of the scopes each request needs."""
        return self.gate.scopes

    @property
    def costs(self) -> CostTable | None:
        """The route table of what requests cost in credits (None: 1 each)."""
        return self.gate.costs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope_type = scope["type"]
        if scope_type != "http":
            if scope_type == "lifespan":
                await self._lifespan(scope, receive, send)
                return
            if scope_type != "websocket":
                await self.app(scope, receive, send)
                return
        # route_path(scope), without its call when no root path is set (the usual case).
        path = route_path(scope) if scope.get("root_path") else scope["path"]
        if not path.startswith(self.protect) or path in self.public:
            await self.app(scope, receive, send)
            return
        gate = self.gate
        if self._cors is not None and is_preflight(scope) and not self._has_key(scope):
            headers = StarletteHeaders(scope=scope)
            await self._cors.preflight_response(request_headers=headers)(scope, receive, send)
            return
        try:
            # Gate.admit, without its coroutine when the core answers at once (the usual case).
            rate_headers = gate.decide(scope, path)
            if type(rate_headers) is not list:
                rate_headers = await gate.complete(scope, path, (), rate_headers)
        except AuthenticationError as exc:
            await self._refuse(scope, send, exc)
            return
        if scope_type == "websocket":
            await self.app(scope, receive, send)
            return

        # A plain function that hands back send's awaitable: no coroutine of its own per
        # message, on the path of every response.
        def send_with_rate_headers(message: Message) -> Awaitable[None]:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *rate_headers]
            return send(message)

        await self.app(scope, receive, send_with_rate_headers)

    def _has_key(self, scope: Scope) -> bool:
        wanted = self.gate.header_name
        return any(name == wanted for name, _ in scope["headers"])

    async def _refuse(self, scope: Scope, send: Send, exc: AuthenticationError) -> None:
        if scope["type"] == "websocket":
            # Closing before accepting makes the server answer the handshake with 403.
            await send({"type": "websocket.close", "code": 1008, "reason": exc.code})
            return
        await send_problem(send, exc, self.realm)

    async def _shutdown(self) -> None:
        try:
            await self.manager.flush()
        except Exception as exc:
            logger.error(
                "apikeys: could not write usage counts at shutdown (%s): %s",
                type(exc).__name__,
                self.manager.usage_buffer.describe_unwritten(),
            )
        if self._owns_limiter:
            try:
                await self.limiter.aclose()
            except Exception as exc:
                logger.warning("apikeys: could not close the limiter: %s", type(exc).__name__)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = False

        async def lifespan_receive() -> Message:
            nonlocal received
            received = True
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._check_routes()
            elif message["type"] == "lifespan.shutdown":
                await self._shutdown()
            return message

        try:
            await self.app(scope, lifespan_receive, send)
        except Exception:
            if received:
                raise  # the app speaks lifespan and failed: that is the server's to report
            # The app does not speak lifespan at all (it refused the scope before reading
            # a message): speak it here, so usage is still written on graceful shutdown.
            await self._own_lifespan(receive, send)

    def _check_routes(self) -> None:
        """At start: the rules held against the app's routes (`routes.check_routes`: a rule
        no route answers, or one a trailing slash away, is warned about)."""
        check_routes(self.app, scopes=self._rules[0], costs=self._rules[1])

    async def _own_lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._check_routes()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return
