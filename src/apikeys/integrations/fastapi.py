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

The dependency returns the `KeyRecord`, checks the scopes FastAPI collects in
`SecurityScopes` (with `resource:*` grants and full access), applies the key's rate limit
(`limiter` defaults to `RateLimiter()`; `RateLimit` headers go on every response), and shows the
Bearer scheme in FastAPI's OpenAPI. `install_error_handler` makes every refusal the same
problem+json response `APIKeyMiddleware` sends; without it, refusals still arrive with the
right status as FastAPI's usual `{"detail": …}` body.

With `APIKeySecurity(manager, header="X-API-Key")` the key is read bare from that one header
instead, never from Authorization, and OpenAPI shows an apiKey scheme in that header.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.security import APIKeyHeader, HTTPBearer, SecurityScopes

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
from apikeys.problems import encode_problem, problem_body, problem_headers
from apikeys.ratelimit import RateLimiter
from apikeys.scopes import grants_for
from apikeys.types import KeyRecord

__all__ = ["APIKeySecurity", "install_error_handler", "problem_response"]

logger = logging.getLogger("apikeys")

# Where a request admitted by the dependency keeps its key: the dependency may appear several
# times in one request's dependency tree (router and endpoint), and charges only once.
_ADMITTED = "apikeys.admitted"


class APIKeySecurity(HTTPBearer):
    """A `Security` dependency that authenticates the request's API key.

    Use it as `Security(api_key, scopes=[...])`; it returns the request's `KeyRecord` and
    sets `request.scope["apikey"]`, `request.auth` and `request.user`.

    `header="X-API-Key"` reads the bare key from that one header instead, and never reads
    Authorization, as `APIKeyMiddleware(header=…)` does; OpenAPI then shows an `apiKey`
    scheme in that header (FastAPI's `APIKeyHeader`) instead of HTTP Bearer.
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
    ) -> None:
        header_name = _key_header(header)
        bearer = header_name == b"authorization"
        if description is None:
            value = "Bearer ak_…" if bearer else "ak_…"
            description = f"An API key: `{'Authorization' if bearer else header}: {value}`."
        super().__init__(bearerFormat="apikeys", scheme_name=scheme_name, description=description)
        if not bearer:
            # What FastAPI's APIKeyHeader documents: {"type": "apiKey", "in": "header", …}.
            scheme = APIKeyHeader(name=header, scheme_name=scheme_name, description=description)
            self.model = scheme.model  # type: ignore[assignment]
        self.manager = manager
        self.limiter = limiter if limiter is not None else RateLimiter()
        self.realm = realm
        self.trusted_proxies = trusted_proxies
        self.header = header
        self._header_name = header_name
        self._bearer = bearer

    async def __call__(  # type: ignore[override]
        self, request: Request, response: Response, security_scopes: SecurityScopes
    ) -> KeyRecord:
        try:
            try:
                return await self._authenticate(request, response, security_scopes.scopes)
            except errors.AuthenticationError:
                raise
            except Exception:
                # An unforeseen store or limiter error: fail closed, as the middleware does.
                logger.exception("apikeys: unexpected error while authenticating; answering 503")
                raise errors.AuthUnavailable() from None
        except errors.AuthenticationError as exc:
            if not self._bearer:
                exc = _header_error(exc, self.header)
            request.scope["apikeys.realm"] = self.realm
            if errors.AuthenticationError in request.app.exception_handlers:
                raise
            raise HTTPException(
                exc.status,
                detail=problem_body(exc),
                headers={
                    name.decode(): value.decode()
                    for name, value in problem_headers(exc, self.realm)
                },
            ) from None

    async def _authenticate(
        self, request: Request, response: Response, required: list[str]
    ) -> KeyRecord:
        admitted = request.scope.get(_ADMITTED)
        if admitted is not None:
            # The dependency already ran for this request (on the router, say, and again on
            # the endpoint with its scopes): the request was charged once; check the scopes.
            record, grants = admitted
            if required and not grants.covers(required):
                raise errors.InsufficientScope(required)
            return record  # type: ignore[no-any-return]
        header_name = self._header_name
        values = [value for name, value in request.scope["headers"] if name == header_name]
        if self._bearer:
            record = await self.manager.verify(bearer_token(values))
        else:
            record = await self.manager.verify(header_token(values, self.header))
        if record.allowed_ips:
            try:
                check_address(request.scope, record, self.trusted_proxies)  # before any charge
            except errors.IPNotAllowed:
                self.manager.usage_buffer.refused(record.id, "ip_not_allowed")
                raise
        headers, limited = await check_rate_limits(self.limiter, record)
        refusal: errors.AuthenticationError | None = limited
        grants = grants_for(record.scopes, record.access == "full")
        if refusal is None and required and not grants.covers(required):
            refusal = errors.InsufficientScope(required)
        if refusal is None and record.credits is not None:
            try:
                headers = await spend_credit(self.manager, self.limiter, record, headers)
            except errors.CreditsExhausted as exhausted:
                refusal = exhausted
        rate_headers = tuple(headers)
        if refusal is not None:
            self.manager.usage_buffer.refused(record.id, refusal.code)
            refusal.headers = rate_headers
            raise refusal
        for name, value in rate_headers:
            response.headers[name.decode()] = value.decode()
        request.scope["apikey"] = record
        request.scope["auth"] = APIKeyAuth(grants)
        request.scope["user"] = APIKeyUser(record)
        request.scope[_ADMITTED] = (record, grants)
        return record


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
