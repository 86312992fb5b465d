"""apikeys as a FastAPI security dependency.

```python
from fastapi import FastAPI, Security

from apikeys import KeyManager, KeyRecord
from apikeys.integrations.fastapi import APIKeySecurity, install_error_handler

manager = KeyManager("sqlite:///apikeys.db")
api_key = APIKeySecurity(manager)
app = FastAPI()
install_error_handler(app)


@app.get("/api/v1/contacts")
async def contacts(key: KeyRecord = Security(api_key, scopes=["contacts:read"])):
    return {"workspace": key.workspace}
```

The dependency returns the `KeyRecord`, and runs the request through the same `Gate` as
`APIKeyMiddleware` (address, rate limits, scopes, credits, the same usage counts): the scopes
are those FastAPI collects in `SecurityScopes` (with `resource:*` grants and full access),
the rate limits are held in `limiter` (default: `manager.limiter`, shared by the manager's
integrations; `RateLimit` headers go on every response), and `costs` says what a route
costs in credits. It shows the Bearer scheme in FastAPI's OpenAPI. However many times the
dependency appears in a request's dependencies (router and endpoint), the request is
charged once. With `optional=True` a request without a key gets None (anonymous) and one
with a key is checked as usual: a bad key is still refused.

`install_error_handler` makes every refusal the same problem+json response `APIKeyMiddleware`
sends; without it, refusals still arrive with the right status as FastAPI's usual
`{"detail": …}` body.

With `APIKeySecurity(manager, header="X-API-Key")` the key is read bare from that one header
instead, never from Authorization, and OpenAPI shows an apiKey scheme in that header.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NoReturn

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.security import APIKeyHeader, HTTPBearer, SecurityScopes

from apikeys import errors
from apikeys.credentials import key_header
from apikeys.gate import Gate, route_path
from apikeys.manager import KeyManager
from apikeys.problems import encode_problem, problem_body, problem_headers
from apikeys.ratelimit import RateLimiter
from apikeys.types import KeyRecord

__all__ = ["APIKeySecurity", "install_error_handler", "problem_response"]


class APIKeySecurity(HTTPBearer):
    """A `Security` dependency that authenticates the request's API key.

    Use it as `Security(api_key, scopes=[...])`; it returns the request's `KeyRecord` and
    sets `request.scope["apikey"]`, `request.auth` and `request.user`.

    - `limiter`: where the keys' rate limits are held; default `manager.limiter`, the one
      the manager's integrations share (`APIKEYS_LIMITER_URL` names a Redis to share it
      across processes).
    - `costs`: what a request costs in credits by route, `{"POST /api/v1/campaigns/{id}/
      trigger": 5}` (the rules of `APIKeyMiddleware`'s `costs`); 1 where no rule matches.
    - `optional`: with True, a request without the key's header is anonymous and the
      dependency returns None; a key that is sent is checked as usual (a bad one is
      refused, never taken for anonymous).
    - `header="X-API-Key"` reads the bare key from that one header instead, and never reads
      Authorization, as `APIKeyMiddleware(header=…)` does; OpenAPI then shows an `apiKey`
      scheme in that header (FastAPI's `APIKeyHeader`) instead of HTTP Bearer.
    - `realm`, `policy_name`, `trusted_proxies` and `legacy_schemes` are the middleware's.
    """

    def __init__(
        self,
        manager: KeyManager,
        *,
        limiter: RateLimiter | None = None,
        scheme_name: str = "APIKey",
        description: str | None = None,
        realm: str = "api",
        header: str = "Authorization",
        trusted_proxies: int = 0,
        costs: Mapping[str, int] | None = None,
        optional: bool = False,
        policy_name: str = "default",
        legacy_schemes: Sequence[str] = (),
    ) -> None:
        bearer = key_header(header) == b"authorization"
        if description is None:
            value = "Bearer ak_…" if bearer else "ak_…"
            description = f"An API key: `{'Authorization' if bearer else header}: {value}`."
        super().__init__(
            bearerFormat="apikeys",
            scheme_name=scheme_name,
            description=description,
            auto_error=not optional,
        )
        if not bearer:
            # What FastAPI's APIKeyHeader documents: {"type": "apiKey", "in": "header", …}.
            scheme = APIKeyHeader(name=header, scheme_name=scheme_name, description=description)
            self.model = scheme.model  # type: ignore[assignment]
        self.manager = manager
        self.realm = realm
        self.optional = optional
        self.gate = Gate(
            manager,
            limiter=limiter,
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

    async def __call__(  # type: ignore[override]
        self, request: Request, response: Response, security_scopes: SecurityScopes
    ) -> KeyRecord | None:
        scope = request.scope
        required = security_scopes.scopes
        record: KeyRecord | None = scope.get("apikey")
        if record is not None:
            # Admitted already (the dependency on the router and again on the endpoint, or
            # APIKeyMiddleware in front): charged once; only the scopes are left to check.
            if required and not scope["auth"].scopes.covers(required):
                self._refuse(request, self.gate.refused(record, errors.InsufficientScope(required)))
            return record
        if self.optional:
            wanted = self.gate.header_name
            if not any(name == wanted for name, _ in scope["headers"]):
                return None
        try:
            headers = await self.gate.admit(scope, route_path(scope), required)
        except errors.AuthenticationError as exc:
            self._refuse(request, exc)
        for name, value in headers:
            response.headers[name.decode("latin-1")] = value.decode("latin-1")
        admitted: KeyRecord = scope["apikey"]
        return admitted

    def _refuse(self, request: Request, exc: errors.AuthenticationError) -> NoReturn:
        request.scope["apikeys.realm"] = self.realm
        if errors.AuthenticationError in request.app.exception_handlers:
            raise exc
        raise HTTPException(
            exc.status,
            detail=problem_body(exc),
            headers={
                name.decode("latin-1"): value.decode("latin-1")
                for name, value in problem_headers(exc, self.realm)
            },
        ) from None


def problem_response(request: Request, exc: Exception) -> Response:
    """The problem+json response for an apikeys `AuthenticationError`."""
    error = exc if isinstance(exc, errors.AuthenticationError) else errors.InvalidAPIKey()
    headers, body = encode_problem(error, request.scope.get("apikeys.realm", "api"))
    result = Response(body, status_code=error.status)
    result.raw_headers = headers
    return result


def install_error_handler(app: FastAPI) -> None:
    """Answer every apikeys refusal in `app` with its problem+json response."""
    app.add_exception_handler(errors.AuthenticationError, problem_response)
