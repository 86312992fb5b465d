"""apikeys as a FastAPI security dependency.

```python
from fastapi import FastAPI, Security

from apikeys import KeyManager, KeyRecord
from apikeys.integrations.fastapi import APIKeySecurity, install_error_handler

manager = KeyManager("sqlite:///apikeys.db")
api_key = APIKeySecurity(manager)
app = FastAPI(lifespan=api_key.lifespan)  # opens the manager in effect, a test's override too
install_error_handler(app)


@app.get("/api/v1/contacts")
async def contacts(key: KeyRecord = Security(api_key, scopes=["contacts:read"])):
    return {"workspace": key.workspace}
```

The dependency returns the `KeyRecord` (also `request.scope["apikey"]`): `key.identity` is
the id of the identity the key belongs to (None for a key of none), `key.environment` its
`live` or `test`. It runs the request through the same `Gate` as
`APIKeyMiddleware` (address, rate limits, scopes, credits, the same usage counts): the scopes
are those FastAPI collects in `SecurityScopes` (with `resource:*` grants and full access),
the rate limits are held in `limiter` (default: `manager.limiter`, shared by the manager's
integrations; `RateLimit` headers go on every response), and `costs` says what a route
costs in credits. It shows the Bearer scheme in FastAPI's OpenAPI. However many times the
dependency appears in a request's dependencies (router and endpoint), the request is
charged once. With `optional=True` a request without a key gets None (anonymous) and one
with a key is checked as usual: a bad key is still refused.

`install_error_handler` makes every refusal the same problem+json response `APIKeyMiddleware`
sends, and declares those answers (401, 403, 429, 503) in the app's OpenAPI document for
every operation that uses an `APIKeySecurity`; without it, refusals still arrive with the
right status as FastAPI's usual `{"detail": …}` body.

`api_key.lifespan` (the app's `lifespan=`, or `async with api_key.lifespan(app):` inside
a lifespan of your own) opens the manager of the dependency in effect: the one a test put
in `app.dependency_overrides[api_key]` (`APIKeySecurity(test_manager)`) rather than the
module's, so a test's `TestClient` never opens the module's store. It also checks the
`costs` rules against the app's routes (`apikeys.routes.check_routes`); without it, the
first request does.

With `APIKeySecurity(manager, header="X-API-Key")` the key is read bare from that one header
instead, never from Authorization, and OpenAPI shows an apiKey scheme in that header.

`include_management_api(app, manager, path="/v1/api-keys")` mounts the management API
(`apikeys.api.ManagementAPI`) in the app and lists its operations in the app's own OpenAPI
document, and so in `/docs`: FastAPI's `include_router` keeps no mounted app, and FastAPI
writes its document from its own routes only. The API stays one ASGI app, with its own
`APIKeyMiddleware`, answering exactly as it does alone; its operations join the document
under `path` (`apikeys.api.merging`), after the answers `install_error_handler` declares,
whichever of the two is called first.
"""

from __future__ import annotations

import contextlib
import copy
import re
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, NoReturn

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.security import APIKeyHeader, HTTPBearer, SecurityScopes
from starlette.routing import Mount

from apikeys import errors
from apikeys.api.app import ManagementAPI
from apikeys.api.merging import merge_document, mount_prefix
from apikeys.credentials import key_header
from apikeys.gate import Gate, route_path
from apikeys.manager import KeyManager
from apikeys.problems import check_realm, encode_problem, problem_body, problem_headers
from apikeys.ratelimit import RateLimiter
from apikeys.routes import check_routes
from apikeys.types import KeyRecord

__all__ = [
    "APIKeySecurity",
    "declare_problems",
    "include_management_api",
    "install_error_handler",
    "problem_response",
]

# Every APIKeySecurity made: their scheme names mark the operations they guard in OpenAPI.
_INSTANCES: weakref.WeakSet[APIKeySecurity] = weakref.WeakSet()


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
        _INSTANCES.add(self)
        self.manager = manager
        self.realm = check_realm(realm)
        self.optional = optional
        self.costs = dict(costs or {})
        self._unchecked = bool(self.costs)  # the costs rules, held against the app's routes
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
        if self._unchecked:  # no api_key.lifespan did it at start: the first request does
            self._unchecked = False
            check_routes(scope.get("app"), costs=self.costs)
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

    def in_effect(self, app: FastAPI) -> APIKeySecurity | None:
        """The `APIKeySecurity` that answers for this one in `app`: the override a test put
        in `app.dependency_overrides`, else this one; None when the override is something
        else (a function returning a record)."""
        found = app.dependency_overrides.get(self, self)
        return found if isinstance(found, APIKeySecurity) else None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """Open the manager of the dependency in effect in `app` for the app's life.

        `FastAPI(lifespan=api_key.lifespan)`, or `async with api_key.lifespan(app):` in a
        lifespan of your own. With `app.dependency_overrides[api_key] =
        APIKeySecurity(test_manager)` it opens `test_manager`, never the module's manager
        (whose store a test must not touch, and whose pepper check would fail); with an
        override that is no `APIKeySecurity`, it opens nothing. The `costs` rules are
        checked against the app's routes first (a warning for a rule that matches none).
        """
        effective = self.in_effect(app)
        if effective is None:
            yield
            return
        if effective._unchecked:
            effective._unchecked = False
            check_routes(app, costs=effective.costs)
        async with effective.manager:
            yield

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
    """Answer every apikeys refusal in `app` with its problem+json response, and declare
    those answers in `app.openapi()` for every operation that uses an `APIKeySecurity`."""
    app.add_exception_handler(errors.AuthenticationError, problem_response)
    _document_steps(app).append((0, declare_problems))


def include_management_api(
    app: FastAPI,
    manager: KeyManager,
    *,
    path: str = "/v1/api-keys",
    include_in_schema: bool = True,
    **options: Any,
) -> ManagementAPI:
    """Mount the management API of `manager`'s keys in `app` at `path`, list its operations
    in `app.openapi()` (and so in `/docs`) under `path`, and return it.

    `options` are `ManagementAPI`'s (`operators`, `rate_limit`, `workspace_fields`, …).
    In the app's document each operation is tagged with the API's `title`; its schemas and
    security scheme join the app's, a name the app already uses renamed (`APIKeysProblem`)
    and the references to it rewritten, so the app's own schemas stay as they were. With
    `include_in_schema=False` the API is mounted but left out of the app's document (it
    still serves its own at `{path}/openapi.json`). A route of the app at one of the API's
    paths is a `ConfigurationError` when the document is made.
    """
    mount_prefix(path)
    api = ManagementAPI(manager, **options)
    app.router.routes.append(_WholePathMount(path, app=api))
    if include_in_schema:
        tags = [api.document["info"]["title"]]

        def merge(schema: dict[str, Any]) -> None:
            merge_document(schema, api.document, path, tags=tags)

        _document_steps(app).append((1, merge))
    return api


class _WholePathMount(Mount):
    """A `Mount` that hands the mounted app every path under its own, a path with a line
    break in it too: Starlette's pattern for the rest of the path (`.*`) stops at one, so
    the app around would answer such a path with its own 404 rather than the API's."""

    def __init__(self, path: str, app: ManagementAPI) -> None:
        super().__init__(path, app=app)
        self.path_regex = re.compile(self.path_regex.pattern, re.DOTALL)


class _Document:
    """`app.openapi` with steps that complete the document FastAPI writes, in a fixed
    order however they were added (the problem answers first, then mounted APIs)."""

    def __init__(self, app: FastAPI, generate: Callable[[], dict[str, Any]]) -> None:
        self.app = app
        self.generate = generate
        self.steps: list[tuple[int, Callable[[dict[str, Any]], None]]] = []

    def append(self, step: tuple[int, Callable[[dict[str, Any]], None]]) -> None:
        self.steps.append(step)
        self.app.openapi_schema = None  # made again, with this step too

    def __call__(self) -> dict[str, Any]:
        if self.app.openapi_schema is not None:
            return self.app.openapi_schema
        try:
            schema = self.generate()
            for _, step in sorted(self.steps, key=lambda entry: entry[0]):
                step(schema)
        except BaseException:
            self.app.openapi_schema = None  # never a document half made
            raise
        self.app.openapi_schema = schema
        return schema


def _document_steps(app: FastAPI) -> _Document:
    document = app.openapi
    if not isinstance(document, _Document):
        document = _Document(app, app.openapi)
        app.openapi = document  # type: ignore[method-assign]
    return document


# What an operation guarded by the dependency may answer besides its own responses.
_PROBLEMS = {
    "401": "No usable API key: `missing_api_key`, `malformed_api_key`, `invalid_api_key`, "
    "`key_disabled`, `key_revoked` or `key_expired`.",
    "403": "The key lacks a scope the operation requires (`insufficient_scope`) or the client "
    "address is outside the key's allowlist (`ip_not_allowed`).",
    "429": "A rate limit of the key is exhausted (`rate_limited`), or its credits "
    "(`credits_exhausted`); `Retry-After` says when to try again.",
    "503": "The key store cannot be reached (`auth_unavailable`); `Retry-After` says when to "
    "try again.",
}
_PROBLEM_SCHEMA: dict[str, Any] = {
    "title": "Problem",
    "description": "An RFC 9457 problem document; `code` says which refusal it is.",
    "type": "object",
    "required": ["type", "title", "status", "code"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "code": {"type": "string"},
        "required_scopes": {"type": "array", "items": {"type": "string"}},
        "violated_policies": {"type": "array", "items": {"type": "string"}},
        "retry_after": {"type": "integer"},
    },
}


def declare_problems(schema: dict[str, Any]) -> None:
    """Add the problem+json answers (401, 403, 429, 503) to every operation of `schema` (the
    app's OpenAPI document) that an `APIKeySecurity` guards, and the `Problem` schema.

    FastAPI lists a dependency's security scheme in the `security` of every operation that
    uses it (on the endpoint, the router or the app): those are the operations it guards.
    """
    ours = {security.scheme_name for security in list(_INSTANCES)}
    declared = False
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            requirements = operation.get("security", []) if isinstance(operation, dict) else []
            if not any(ours & set(requirement) for requirement in requirements):
                continue
            responses = operation.setdefault("responses", {})
            for status, description in _PROBLEMS.items():
                responses.setdefault(status, _problem_response(description))
            declared = True
    if declared:
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas.setdefault("Problem", copy.deepcopy(_PROBLEM_SCHEMA))


def _problem_response(description: str) -> dict[str, Any]:
    reference = {"$ref": "#/components/schemas/Problem"}
    return {
        "description": description,
        "content": {"application/problem+json": {"schema": reference}},
    }
