"""The Starlette AuthenticationBackend: requires() with our scopes, problem+json refusals."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.authentication import requires
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from apikeys import APIKeyMiddleware, Hasher, KeyManager, MemoryStore, RateLimiter, generate_key
from apikeys.errors import ConfigurationError
from apikeys.integrations.starlette import APIKeyBackend, on_auth_error
from apikeys.routes import RouteRuleWarning, is_preflight, serves_cors
from apikeys.testing import TEST_PEPPER


@requires("contacts:read")
async def contacts(request: Request) -> JSONResponse:
    return JSONResponse({"id": request.user.identity, "workspace": request.user.workspace})


async def anyone(request: Request) -> JSONResponse:
    return JSONResponse({"authenticated": request.user.is_authenticated})


def build(
    manager: KeyManager, limiter: RateLimiter | None = None, header: str = "Authorization"
) -> Starlette:
    backend = APIKeyBackend(manager, limiter=limiter, header=header)
    return Starlette(
        routes=[Route("/contacts", contacts), Route("/anyone", anyone)],
        middleware=[Middleware(AuthenticationMiddleware, backend=backend, on_error=on_auth_error)],
    )


@pytest.fixture
async def client(memory_manager: KeyManager) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build(memory_manager))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        yield http


async def test_if_key_valid_then_requires_passes_with_wildcards(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    for scopes in (["contacts:read"], ["contacts:*"]):
        created = await memory_manager.create(name="n", workspace="acme", scopes=scopes)
        response = await client.get("/contacts", headers={"Authorization": f"Bearer {created.key}"})
        assert response.json() == {"id": created.record.id, "workspace": "acme"}


async def test_if_scope_missing_then_requires_refuses(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", scopes=["campaigns:read"])
    response = await client.get("/contacts", headers={"Authorization": f"Bearer {created.key}"})
    assert response.status_code == 403


async def test_if_no_header_then_anonymous(client: httpx.AsyncClient) -> None:
    assert (await client.get("/anyone")).json() == {"authenticated": False}
    assert (await client.get("/contacts")).status_code == 403


async def test_if_key_revoked_then_problem_401(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", full_access=True)
    await memory_manager.revoke(created.record.id)
    response = await client.get("/anyone", headers={"Authorization": f"Bearer {created.key}"})
    assert response.status_code == 401
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["code"] == "key_revoked"
    assert 'error="invalid_token"' in response.headers["www-authenticate"]


async def test_if_limiter_given_then_429_after_limit(memory_manager: KeyManager) -> None:
    created = await memory_manager.create(name="n", workspace="acme", full_access=True)
    transport = httpx.ASGITransport(app=build(memory_manager, RateLimiter("1/minute")))
    headers = {"Authorization": f"Bearer {created.key}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert (await http.get("/anyone", headers=headers)).status_code == 200
        limited = await http.get("/anyone", headers=headers)
    assert limited.status_code == 429
    assert limited.json()["code"] == "rate_limited"


async def test_if_realm_given_then_challenge_names_it(memory_manager: KeyManager) -> None:
    backend = APIKeyBackend(memory_manager, realm="contacts")
    app = Starlette(
        routes=[Route("/anyone", anyone)],
        middleware=[Middleware(AuthenticationMiddleware, backend=backend, on_error=on_auth_error)],
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        response = await http.get("/anyone", headers={"Authorization": "Bearer nope"})
    assert response.headers["www-authenticate"] == 'Bearer realm="contacts", error="invalid_token"'


async def test_if_store_fails_unexpectedly_then_503_not_500(hasher: Hasher) -> None:
    class BrokenStore(MemoryStore):
        def get_for_verification_now(self, key_id: str) -> None:
            raise RuntimeError("the store broke in a way nobody foresaw")

    async with KeyManager(BrokenStore(), hasher=hasher) as manager:
        transport = httpx.ASGITransport(app=build(manager))
        token = generate_key().token
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            response = await http.get("/anyone", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 503
    assert response.json()["code"] == "auth_unavailable"


@pytest.fixture
async def header_client(memory_manager: KeyManager) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build(memory_manager, header="X-API-Key"))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        yield http


async def test_if_header_named_then_the_key_is_read_from_it(
    header_client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", scopes=["contacts:read"])
    response = await header_client.get("/contacts", headers={"X-API-Key": f" {created.key}\t"})
    assert response.json() == {"id": created.record.id, "workspace": "acme"}


async def test_if_header_named_then_authorization_is_never_read(
    header_client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", full_access=True)
    headers = {"Authorization": f"Bearer {created.key}"}
    assert (await header_client.get("/anyone", headers=headers)).json() == {"authenticated": False}
    headers["X-API-Key"] = "nope"
    response = await header_client.get("/anyone", headers=headers)
    assert response.status_code == 401
    assert response.json()["code"] == "malformed_api_key"


async def test_if_default_header_then_x_api_key_is_never_read(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", full_access=True)
    response = await client.get("/anyone", headers={"X-API-Key": created.key})
    assert response.json() == {"authenticated": False}


@pytest.mark.parametrize(
    "headers",
    [
        [("X-API-Key", "nope")],
        [("X-API-Key", "Bearer {key}")],
        [("X-API-Key", "{key}"), ("X-API-Key", "{key}")],
        [("X-API-Key", "a" * 5000)],
    ],
)
async def test_if_named_header_malformed_then_problem_401(
    header_client: httpx.AsyncClient, memory_manager: KeyManager, headers: list[tuple[str, str]]
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", full_access=True)
    sent = [(name, value.format(key=created.key)) for name, value in headers]
    response = await header_client.get("/anyone", headers=sent)
    assert response.status_code == 401
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["code"] == "malformed_api_key"
    assert "X-API-Key" in response.json()["detail"]
    assert response.headers["www-authenticate"] == 'Bearer realm="api", error="invalid_token"'


async def test_if_named_header_sent_as_non_ascii_then_problem_401(
    memory_manager: KeyManager,
) -> None:
    app = build(memory_manager, header="X-API-Key")
    created = await memory_manager.create(name="n", workspace="acme", full_access=True)
    value = created.key.encode() + "\u00e9".encode()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        response = await http.get("/anyone", headers=[(b"X-API-Key", value)])
    assert response.status_code == 401
    assert response.json()["code"] == "malformed_api_key"


async def test_if_key_in_query_string_then_never_read(
    header_client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", full_access=True)
    response = await header_client.get("/anyone", params={"api_key": created.key})
    assert response.json() == {"authenticated": False}


@pytest.mark.parametrize("header", ["", "X API Key", "X-API-Key:", "Schlüssel"])
def test_if_header_is_not_an_http_header_name_then_refused(
    memory_manager: KeyManager, header: str
) -> None:
    with pytest.raises(ConfigurationError, match="not an HTTP header name"):
        APIKeyBackend(memory_manager, header=header)


async def test_if_key_has_several_policies_then_429_names_the_violated_one(
    memory_manager: KeyManager,
) -> None:
    created = await memory_manager.create(
        name="n", workspace="acme", full_access=True, rate_limit="burst=1/minute, daily=5/day"
    )
    transport = httpx.ASGITransport(app=build(memory_manager, RateLimiter()))
    headers = {"Authorization": f"Bearer {created.key}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert (await http.get("/anyone", headers=headers)).status_code == 200
        limited = await http.get("/anyone", headers=headers)
    assert limited.status_code == 429
    assert limited.json()["violated_policies"] == ["burst"]
    assert limited.headers["ratelimit-policy"] == '"burst";q=1;w=60, "daily";q=5;w=86400'
    burst, daily = limited.headers["ratelimit"].split(", ")
    assert burst == f'"burst";r=0;t={limited.headers["retry-after"]}'
    assert daily.startswith('"daily";r=4;t=')


async def test_policies_hold_in_the_backend_too(memory_manager: KeyManager) -> None:
    app = build(memory_manager)
    fenced = await memory_manager.create(
        name="fenced", scopes=["contacts:read"], allowed_ips=["10.0.0.0/8"]
    )
    metered = await memory_manager.create(name="metered", scopes=["contacts:read"], credits=1)
    transport = httpx.ASGITransport(app=app, client=("192.0.2.1", 1234))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        outside = await http.get("/contacts", headers={"Authorization": f"Bearer {fenced.key}"})
        assert outside.status_code == 403
        assert outside.json()["code"] == "ip_not_allowed"
        assert (
            await http.get("/contacts", headers={"Authorization": f"Bearer {metered.key}"})
        ).status_code == 200
        second = await http.get("/contacts", headers={"Authorization": f"Bearer {metered.key}"})
        assert second.status_code == 429
        assert second.json()["code"] == "credits_exhausted"


def test_if_no_limiter_given_then_the_managers_shared_one_is_used(
    memory_manager: KeyManager,
) -> None:
    assert APIKeyBackend(memory_manager).limiter is memory_manager.limiter


@pytest.mark.parametrize(
    "options",
    [
        {"scopes": {"GET /contacts": []}},
        {"scopes": {"FETCH /contacts": "contacts:read"}},
        {"costs": {"POST /trigger": 0}},
        {"unmapped": "maybe"},
    ],
)
def test_if_a_route_table_is_wrong_then_refused_when_built(
    memory_manager: KeyManager, options: dict[str, Any]
) -> None:
    with pytest.raises(ConfigurationError):
        APIKeyBackend(memory_manager, **options)


# -- scope rules held against the app's routes, CORS ----------------------------------------


@pytest.mark.parametrize(
    ("rule", "spelling"),
    [
        ("GET /api/v1/contacts/<int:pk>/", "'GET /api/v1/contacts/{pk:int}/'"),
        ("GET /files/<path:name>", "'GET /files/{name:path}'"),
        ("GET /tags/<slug:tag>", "'GET /tags/{tag}'"),
        ("DELETE /api/v1/contacts/<pk>", "'DELETE /api/v1/contacts/{pk}'"),
        ("GET /^api/v1/contacts/(?P<pk>[0-9]+)/$", "'GET /api/v1/contacts/{pk}/'"),
    ],
)
def test_if_a_rule_is_in_another_frameworks_syntax_then_refused_with_ours(
    memory_manager: KeyManager, rule: str, spelling: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        APIKeyBackend(memory_manager, scopes={rule: "contacts:read"})
    assert f"write it as {spelling}" in str(caught.value)


def _rules_app(manager: KeyManager, scopes: dict[str, str], costs: dict[str, int]) -> Starlette:
    backend = APIKeyBackend(manager, scopes=scopes, costs=costs)
    return Starlette(
        routes=[
            Route("/api/v1/contacts/", anyone),
            Route("/api/v1/contacts/{id:int}", anyone, methods=["GET", "DELETE"]),
            Mount("/files", routes=[Route("/{name}", anyone)]),
        ],
        middleware=[Middleware(AuthenticationMiddleware, backend=backend, on_error=on_auth_error)],
    )


async def test_if_rules_match_no_route_then_warned_once_with_what_is_wrong(
    memory_manager: KeyManager, caplog: pytest.LogCaptureFixture
) -> None:
    app = _rules_app(
        memory_manager,
        scopes={
            "GET /api/v1/contacts": "contacts:read",  # the route ends with a slash
            "GET /api/v1/contacts/{pk}": "contacts:read",
            "DELETE /api/v1/contacts/{id:int}": "contacts:write",
            "GET /files/{rest:path}": "files:read",
            "POST /api/v1/contacts/{id}": "contacts:write",  # no such method there
        },
        costs={"GET /api/v1/campaigns": 3},
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        with pytest.warns(RouteRuleWarning) as caught:
            await http.get("/api/v1/contacts/")
        await http.get("/api/v1/contacts/")  # filterwarnings = error: a second warning fails
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 3
    assert "scope rule 'GET /api/v1/contacts'" in messages[0]
    assert "trailing slash" in messages[0]
    assert "'GET /api/v1/contacts/'" in messages[0]
    assert "scope rule 'POST /api/v1/contacts/{id}' matches no route" in messages[1]
    assert "cost rule 'GET /api/v1/campaigns' matches no route" in messages[2]
    assert [record.getMessage() for record in caplog.records if "rule" in record.getMessage()] == [
        f"apikeys: {message}" for message in messages
    ]


async def test_if_rules_match_the_routes_then_nothing_is_said(memory_manager: KeyManager) -> None:
    app = _rules_app(
        memory_manager, scopes={"GET /api/v1/contacts/": "contacts:read"}, costs={"* /files/a": 2}
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert (await http.get("/api/v1/contacts/")).status_code == 200


@pytest.mark.parametrize("cors_outside", [True, False])
async def test_if_the_app_serves_cors_then_a_preflight_passes_without_a_key(
    memory_manager: KeyManager, cors_outside: bool
) -> None:
    backend = APIKeyBackend(memory_manager)
    auth = Middleware(AuthenticationMiddleware, backend=backend, on_error=on_auth_error)
    cors = Middleware(
        CORSMiddleware, allow_origins=["https://app.example"], allow_headers=["Authorization"]
    )
    app = Starlette(
        routes=[Route("/contacts", contacts)],
        middleware=[cors, auth] if cors_outside else [auth, cors],
    )
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "GET"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        answered = await http.options("/contacts", headers=preflight)
        refused = await http.get("/contacts", headers={"Origin": "https://app.example"})
        bad_key = await http.options(
            "/contacts", headers={**preflight, "Authorization": "Bearer nope"}
        )
    assert answered.status_code == 200
    assert answered.headers["access-control-allow-origin"] == "https://app.example"
    assert refused.status_code == 403  # requires(): anonymous is not enough
    # A request that sends a key is checked, preflight or not.
    assert bad_key.status_code == (200 if cors_outside else 401)


def test_serves_cors_finds_cors_middleware_inside_an_app() -> None:
    cors = Middleware(CORSMiddleware, allow_origins=["https://app.example"])
    with_cors = Starlette(routes=[Route("/contacts", contacts)], middleware=[cors])
    without = Starlette(routes=[Route("/contacts", contacts)])
    assert serves_cors(with_cors)
    assert serves_cors(CORSMiddleware(without, allow_origins=["*"]))
    assert serves_cors(APIKeyMiddleware(with_cors, manager=KeyManager(MemoryStore())))
    assert not serves_cors(without)
    assert not serves_cors(APIKeyMiddleware(without, manager=KeyManager(MemoryStore())))


@pytest.mark.parametrize(
    ("method", "headers", "preflight"),
    [
        ("OPTIONS", [(b"origin", b"https://a"), (b"access-control-request-method", b"GET")], True),
        ("OPTIONS", [(b"origin", b"https://a")], False),  # a plain OPTIONS, DRF's metadata
        ("GET", [(b"origin", b"https://a"), (b"access-control-request-method", b"GET")], False),
    ],
)
def test_is_preflight_is_an_options_with_origin_and_requested_method(
    method: str, headers: list[tuple[bytes, bytes]], preflight: bool
) -> None:
    assert is_preflight({"type": "http", "method": method, "headers": headers}) is preflight


# -- what APIKeyMiddleware is to do with the same helpers (its call sites are not there yet) --


async def test_if_the_middlewares_rules_match_no_route_then_warned_at_start() -> None:
    manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER))
    app = APIKeyMiddleware(
        Starlette(routes=[Route("/api/v1/contacts/", anyone)]),
        manager=manager,
        scopes={"GET /api/v1/contacts": "contacts:read"},
        protect="/api/",
    )
    try:
        with pytest.warns(RouteRuleWarning, match="trailing slash"):
            await _start(app)
    finally:
        await manager.aclose()


async def test_if_cors_is_inside_the_middleware_then_a_keyless_preflight_passes() -> None:
    manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER))
    cors = Middleware(CORSMiddleware, allow_origins=["https://app.example"])
    app = APIKeyMiddleware(
        Starlette(routes=[Route("/api/v1/contacts", anyone)], middleware=[cors]),
        manager=manager,
        protect="/api/",
    )
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "GET"}
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            answered = await http.options("/api/v1/contacts", headers=preflight)
            plain = await http.options("/api/v1/contacts")
        assert plain.status_code == 401  # not a preflight: a key is needed
        assert answered.status_code == 200
    finally:
        await manager.aclose()


async def _start(app: Any) -> None:
    """Run `app`'s lifespan startup and shutdown, as a server does."""
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> dict[str, str]:
        return messages.pop(0)

    async def send(message: Any) -> None:
        assert not message["type"].endswith(".failed"), message

    await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)


async def test_if_cors_wraps_the_middleware_then_a_keyless_preflight_passes() -> None:
    # What docs/integrations.md advises: CORSMiddleware outside APIKeyMiddleware.
    manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER))
    app = CORSMiddleware(
        APIKeyMiddleware(
            Starlette(routes=[Route("/api/v1/contacts", anyone)]),
            manager=manager,
            protect="/api/",
        ),
        allow_origins=["https://app.example"],
    )
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "GET"}
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            answered = await http.options("/api/v1/contacts", headers=preflight)
            refused = await http.get("/api/v1/contacts", headers={"Origin": "https://app.example"})
        assert answered.status_code == 200
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == "https://app.example"
    finally:
        await manager.aclose()


class _MethodOverride:
    """A middleware that honours X-HTTP-Method-Override, as some apps add before CORS."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"x-http-method-override":
                    scope = {**scope, "method": value.decode()}
        await self.app(scope, receive, send)


async def test_a_keyless_preflight_is_answered_without_running_anything_of_the_app() -> None:
    ran: list[str] = []

    async def handler(request: Request) -> JSONResponse:
        ran.append(request.method)
        return JSONResponse({"secret": "data"})

    manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER))
    cors = Middleware(CORSMiddleware, allow_origins=["https://app.example"], allow_methods=["GET"])
    inner = Starlette(
        routes=[Route("/api/data", handler, methods=["GET", "OPTIONS", "DELETE"])],
        middleware=[Middleware(_MethodOverride), cors],
    )
    app = APIKeyMiddleware(inner, manager=manager, protect="/api/")
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "GET"}
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            answered = await http.options("/api/data", headers=preflight)
            overridden = await http.options(
                "/api/data", headers={**preflight, "X-HTTP-Method-Override": "DELETE"}
            )
            other_origin = await http.options(
                "/api/data", headers={**preflight, "Origin": "https://evil.example"}
            )
        assert answered.status_code == 200
        assert answered.headers["access-control-allow-origin"] == "https://app.example"
        assert overridden.status_code == 200
        assert "secret" not in overridden.text
        assert other_origin.status_code == 400  # CORSMiddleware's own answer
        assert ran == []  # no middleware of the app and no endpoint ran for a preflight
    finally:
        await manager.aclose()


def test_a_websocket_scope_is_never_a_preflight() -> None:
    headers = [(b"origin", b"https://app.example"), (b"access-control-request-method", b"GET")]
    assert is_preflight({"type": "http", "method": "OPTIONS", "headers": headers})
    assert not is_preflight({"type": "websocket", "method": "OPTIONS", "headers": headers})
