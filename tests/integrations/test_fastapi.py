"""The FastAPI security dependency: records, SecurityScopes, OpenAPI, problem+json."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Request, Security
from fastapi.testclient import TestClient
from starlette.middleware.cors import CORSMiddleware

from apikeys import Hasher, KeyManager, KeyRecord, MemoryStore, RateLimiter, generate_key
from apikeys.errors import ConfigurationError
from apikeys.integrations.fastapi import APIKeySecurity, install_error_handler
from apikeys.routes import RouteRuleWarning
from apikeys.testing import TEST_PEPPER, KeyFactory, in_memory_manager
from apikeys.testing.factory import close_manager


def build(
    manager: KeyManager,
    *,
    handler: bool = True,
    limiter: RateLimiter | None = None,
    header: str = "Authorization",
) -> FastAPI:
    api_key = APIKeySecurity(manager, limiter=limiter, header=header)
    app = FastAPI()
    if handler:
        install_error_handler(app)

    @app.get("/contacts")
    async def contacts(
        key: KeyRecord = Security(api_key, scopes=["contacts:read"]),
    ) -> dict[str, str]:
        return {"id": key.id, "workspace": key.workspace}

    @app.post("/contacts")
    async def add(key: KeyRecord = Security(api_key, scopes=["contacts:write"])) -> dict[str, str]:
        return {"id": key.id}

    @app.get("/me")
    async def me(key: KeyRecord = Security(api_key)) -> dict[str, str]:
        return {"name": key.name}

    return app


@pytest.fixture
async def client(memory_manager: KeyManager) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build(memory_manager))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        yield http


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_if_key_has_scope_then_dependency_returns_its_record(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", scopes=["contacts:*"])
    response = await client.get("/contacts", headers=bearer(created.key))
    assert response.status_code == 200
    assert response.json() == {"id": created.record.id, "workspace": "acme"}
    assert (await client.post("/contacts", headers=bearer(created.key))).status_code == 200


async def test_if_scope_missing_then_403_problem(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", scopes=["contacts:read"])
    response = await client.post("/contacts", headers=bearer(created.key))
    assert response.status_code == 403
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["required_scopes"] == ["contacts:write"]


@pytest.mark.parametrize(
    ("headers", "code"),
    [({}, "missing_api_key"), ({"Authorization": "Bearer nope"}, "malformed_api_key")],
)
async def test_if_credentials_bad_then_401_problem(
    client: httpx.AsyncClient, headers: dict[str, str], code: str
) -> None:
    response = await client.get("/me", headers=headers)
    assert response.status_code == 401
    assert response.json()["code"] == code
    assert response.headers["www-authenticate"].startswith('Bearer realm="api"')


async def test_if_revoked_then_401_key_revoked(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", full_access=True)
    assert (await client.get("/me", headers=bearer(created.key))).status_code == 200
    await memory_manager.revoke(created.record.id)
    response = await client.get("/me", headers=bearer(created.key))
    assert response.json()["code"] == "key_revoked"


async def test_if_no_error_handler_then_status_and_code_still_right(
    memory_manager: KeyManager,
) -> None:
    transport = httpx.ASGITransport(app=build(memory_manager, handler=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        response = await http.get("/me")
    assert response.status_code == 401
    assert response.json()["detail"]["code"] == "missing_api_key"
    assert response.headers["www-authenticate"] == 'Bearer realm="api"'


async def test_if_limiter_given_then_headers_and_429(memory_manager: KeyManager) -> None:
    app = build(memory_manager, limiter=RateLimiter("2/minute"))
    created = await memory_manager.create(name="n", workspace="acme", full_access=True)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        first = await http.get("/me", headers=bearer(created.key))
        assert first.headers["ratelimit"] == '"default";r=1;t=60'
        await http.get("/me", headers=bearer(created.key))
        limited = await http.get("/me", headers=bearer(created.key))
    assert limited.status_code == 429
    assert int(limited.headers["retry-after"]) >= 1


def test_openapi_shows_the_bearer_scheme_and_scopes(memory_manager: KeyManager) -> None:
    schema = build(memory_manager).openapi()
    assert schema["components"]["securitySchemes"]["APIKey"] == {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "apikeys",
        "description": "An API key: `Authorization: Bearer ak_…`.",
    }
    assert schema["paths"]["/contacts"]["get"]["security"] == [{"APIKey": ["contacts:read"]}]


async def test_if_refused_after_counting_then_ratelimit_headers_are_kept(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", scopes=["contacts:read"])
    response = await client.post("/contacts", headers=bearer(created.key))
    assert response.status_code == 403
    assert response.headers["ratelimit-policy"] == '"default";q=100;w=60'


async def test_if_realm_given_then_challenge_names_it(memory_manager: KeyManager) -> None:
    app = FastAPI()
    install_error_handler(app)
    api_key = APIKeySecurity(memory_manager, realm="contacts")

    @app.get("/me")
    async def me(key: KeyRecord = Security(api_key)) -> dict[str, str]:
        return {"name": key.name}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        response = await http.get("/me")
    assert response.headers["www-authenticate"] == 'Bearer realm="contacts"'


async def test_if_store_fails_unexpectedly_then_503_not_500(hasher: Hasher) -> None:
    class BrokenStore(MemoryStore):
        def get_for_verification_now(self, key_id: str) -> None:
            raise RuntimeError("the store broke in a way nobody foresaw")

    async with KeyManager(BrokenStore(), hasher=hasher) as manager:
        transport = httpx.ASGITransport(app=build(manager))
        token = generate_key().token
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            response = await http.get("/me", headers=bearer(token))
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
    response = await header_client.get("/contacts", headers={"X-API-Key": f"\t{created.key} "})
    assert response.status_code == 200
    assert response.json() == {"id": created.record.id, "workspace": "acme"}
    assert response.headers["ratelimit"] == '"default";r=99;t=60'
    refused = await header_client.post("/contacts", headers={"X-API-Key": created.key})
    assert refused.status_code == 403
    assert refused.json()["required_scopes"] == ["contacts:write"]


async def test_if_header_named_then_authorization_is_never_read(
    header_client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", full_access=True)
    response = await header_client.get("/me", headers=bearer(created.key))
    assert response.status_code == 401
    assert response.json()["code"] == "missing_api_key"
    assert response.json()["detail"] == "Send the API key in the X-API-Key header."
    assert response.headers["www-authenticate"] == 'Bearer realm="api"'


async def test_if_default_header_then_x_api_key_is_never_read(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", full_access=True)
    response = await client.get("/me", headers={"X-API-Key": created.key})
    assert response.status_code == 401
    assert response.json()["code"] == "missing_api_key"


@pytest.mark.parametrize(
    "headers",
    [
        [("X-API-Key", "nope")],
        [("X-API-Key", "Bearer {key}")],
        [("X-API-Key", "{key}"), ("X-API-Key", "{key}")],
        [("X-API-Key", "a" * 5000)],
    ],
)
async def test_if_named_header_malformed_then_401_problem(
    header_client: httpx.AsyncClient, memory_manager: KeyManager, headers: list[tuple[str, str]]
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", full_access=True)
    sent = [(name, value.format(key=created.key)) for name, value in headers]
    response = await header_client.get("/me", headers=sent)
    assert response.status_code == 401
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["code"] == "malformed_api_key"
    assert response.headers["www-authenticate"] == 'Bearer realm="api", error="invalid_token"'


async def test_if_header_named_and_no_error_handler_then_status_and_code_still_right(
    memory_manager: KeyManager,
) -> None:
    transport = httpx.ASGITransport(app=build(memory_manager, handler=False, header="X-API-Key"))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        missing = await http.get("/me")
        malformed = await http.get("/me", headers={"X-API-Key": "nope"})
    assert missing.status_code == 401
    assert missing.json()["detail"]["code"] == "missing_api_key"
    assert missing.headers["www-authenticate"] == 'Bearer realm="api"'
    assert malformed.json()["detail"]["code"] == "malformed_api_key"


async def test_if_key_in_query_string_then_never_read(
    header_client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", full_access=True)
    response = await header_client.get("/me", params={"api_key": created.key})
    assert response.status_code == 401
    assert response.json()["code"] == "missing_api_key"


def test_if_header_named_then_openapi_shows_an_api_key_header_scheme(
    memory_manager: KeyManager,
) -> None:
    schema = build(memory_manager, header="X-API-Key").openapi()
    assert schema["components"]["securitySchemes"] == {
        "APIKey": {
            "type": "apiKey",
            "in": "header",
            "name": "X-API-Key",
            "description": "An API key: `X-API-Key: ak_…`.",
        }
    }
    assert schema["paths"]["/contacts"]["get"]["security"] == [{"APIKey": ["contacts:read"]}]


def test_if_header_is_authorization_in_any_case_then_openapi_keeps_the_bearer_scheme(
    memory_manager: KeyManager,
) -> None:
    schema = build(memory_manager, header="authorization").openapi()
    assert schema["components"]["securitySchemes"]["APIKey"]["type"] == "http"
    assert schema["components"]["securitySchemes"]["APIKey"]["scheme"] == "bearer"


def test_if_scheme_name_and_description_given_then_the_header_scheme_uses_them(
    memory_manager: KeyManager,
) -> None:
    api_key = APIKeySecurity(
        memory_manager, header="X-Token", scheme_name="Token", description="Your token."
    )
    app = FastAPI()

    @app.get("/me")
    async def me(key: KeyRecord = Security(api_key)) -> dict[str, str]:
        return {"name": key.name}

    assert app.openapi()["components"]["securitySchemes"] == {
        "Token": {"type": "apiKey", "in": "header", "name": "X-Token", "description": "Your token."}
    }


@pytest.mark.parametrize("header", ["", "X API Key", "X-API-Key:", "Schlüssel"])
def test_if_header_is_not_an_http_header_name_then_refused(
    memory_manager: KeyManager, header: str
) -> None:
    with pytest.raises(ConfigurationError, match="not an HTTP header name"):
        APIKeySecurity(memory_manager, header=header)


async def test_if_key_has_several_policies_then_headers_list_them_and_429_names_one(
    memory_manager: KeyManager,
) -> None:
    app = build(memory_manager, limiter=RateLimiter())
    created = await memory_manager.create(
        name="n",
        workspace="acme",
        full_access=True,
        rate_limits={"burst": "1/minute", "daily": "5/day"},
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        first = await http.get("/me", headers=bearer(created.key))
        limited = await http.get("/me", headers=bearer(created.key))
    assert first.headers["ratelimit-policy"] == '"burst";q=1;w=60, "daily";q=5;w=86400'
    assert first.headers["ratelimit"].startswith('"burst";r=0;t=60, "daily";r=4;t=')
    assert limited.status_code == 429
    assert limited.json()["violated_policies"] == ["burst"]
    assert int(limited.headers["retry-after"]) >= 1


async def test_policies_hold_in_the_dependency_too(memory_manager: KeyManager) -> None:
    app = build(memory_manager)
    fenced = await memory_manager.create(
        name="fenced", scopes=["contacts:read"], allowed_ips=["10.0.0.0/8"]
    )
    metered = await memory_manager.create(name="metered", scopes=["contacts:read"], credits=1)
    transport = httpx.ASGITransport(app=app, client=("192.0.2.1", 1234))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        outside = await http.get("/contacts", headers=bearer(fenced.key))
        assert outside.status_code == 403
        assert outside.json()["code"] == "ip_not_allowed"
        first = await http.get("/contacts", headers=bearer(metered.key))
        assert first.status_code == 200
        assert '"credits";r=0' in first.headers["ratelimit"]
        second = await http.get("/contacts", headers=bearer(metered.key))
        assert second.status_code == 429
        assert second.json()["code"] == "credits_exhausted"


async def test_if_the_dependency_is_on_the_router_and_the_endpoint_then_a_request_is_charged_once(
    memory_manager: KeyManager,
) -> None:
    from fastapi import APIRouter

    api_key = APIKeySecurity(memory_manager, limiter=RateLimiter("10/minute"))
    router = APIRouter(dependencies=[Security(api_key)])

    @router.get("/contacts")
    async def contacts(
        key: KeyRecord = Security(api_key, scopes=["contacts:read"]),
    ) -> dict[str, str]:
        return {"id": key.id}

    @router.post("/contacts")
    async def add(key: KeyRecord = Security(api_key, scopes=["contacts:write"])) -> dict[str, str]:
        return {"id": key.id}

    app = FastAPI()
    install_error_handler(app)
    app.include_router(router)
    created = await memory_manager.create(
        name="n", workspace="acme", scopes=["contacts:read"], credits=100
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        first = await http.get("/contacts", headers=bearer(created.key))
        second = await http.get("/contacts", headers=bearer(created.key))
        # The endpoint's own scopes are still checked on the later appearance.
        refused = await http.post("/contacts", headers=bearer(created.key))
    assert first.status_code == second.status_code == 200
    assert first.headers["ratelimit"] == '"default";r=9;t=60, "credits";r=99'
    assert second.headers["ratelimit"] == '"default";r=8;t=60, "credits";r=98'
    assert refused.status_code == 403
    assert refused.json()["code"] == "insufficient_scope"
    await memory_manager.flush()
    assert (await memory_manager.get(created.record.id)).request_count == 3


def optional_app(manager: KeyManager) -> FastAPI:
    api_key = APIKeySecurity(manager, optional=True)
    app = FastAPI()
    install_error_handler(app)

    @app.get("/greeting")
    async def greeting(key: KeyRecord | None = Security(api_key)) -> dict[str, str | None]:
        return {"key": None if key is None else key.id}

    @app.get("/contacts")
    async def contacts(
        key: KeyRecord | None = Security(api_key, scopes=["contacts:read"]),
    ) -> dict[str, str | None]:
        return {"key": None if key is None else key.id}

    return app


async def test_if_optional_and_no_key_then_anonymous_and_a_key_sent_is_still_checked(
    memory_manager: KeyManager,
) -> None:
    created = await memory_manager.create(name="n", workspace="acme", scopes=["other:read"])
    transport = httpx.ASGITransport(app=optional_app(memory_manager))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        anonymous = await http.get("/greeting")
        assert anonymous.status_code == 200
        assert anonymous.json() == {"key": None}
        assert "ratelimit" not in anonymous.headers
        # Anonymous also where scopes are asked for: the endpoint decides what None may see.
        assert (await http.get("/contacts")).json() == {"key": None}
        known = await http.get("/greeting", headers=bearer(created.key))
        assert known.json() == {"key": created.record.id}
        assert known.headers["ratelimit"] == '"default";r=99;t=60'
        bad = await http.get("/greeting", headers=bearer("nope"))
        assert bad.status_code == 401
        assert bad.json()["code"] == "malformed_api_key"
        unknown = await http.get("/greeting", headers=bearer(generate_key().token))
        assert unknown.json()["code"] == "invalid_api_key"
        narrow = await http.get("/contacts", headers=bearer(created.key))
        assert narrow.status_code == 403
        assert narrow.json()["code"] == "insufficient_scope"


async def test_if_optional_with_a_named_header_then_only_that_header_makes_a_key(
    memory_manager: KeyManager,
) -> None:
    api_key = APIKeySecurity(memory_manager, optional=True, header="X-API-Key")
    app = FastAPI()
    install_error_handler(app)

    @app.get("/greeting")
    async def greeting(key: KeyRecord | None = Security(api_key)) -> dict[str, str | None]:
        return {"key": None if key is None else key.id}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert (await http.get("/greeting", headers=bearer("nope"))).json() == {"key": None}
        bad = await http.get("/greeting", headers={"X-API-Key": "nope"})
    assert bad.status_code == 401
    assert bad.json()["detail"] == "The X-API-Key header is not exactly one well-formed API key."


async def test_if_no_limiter_given_then_dependencies_share_the_managers_limiter(
    memory_manager: KeyManager,
) -> None:
    first, second = APIKeySecurity(memory_manager), APIKeySecurity(memory_manager)
    assert first.limiter is second.limiter is memory_manager.limiter
    app = FastAPI()
    install_error_handler(app)

    @app.get("/one")
    async def one(key: KeyRecord = Security(first)) -> dict[str, str]:
        return {"id": key.id}

    @app.get("/two")
    async def two(key: KeyRecord = Security(second)) -> dict[str, str]:
        return {"id": key.id}

    created = await memory_manager.create(name="n", full_access=True, rate_limit="1/minute")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert (await http.get("/one", headers=bearer(created.key))).status_code == 200
        limited = await http.get("/two", headers=bearer(created.key))
    assert limited.status_code == 429
    assert limited.json()["code"] == "rate_limited"


async def test_if_the_middleware_admitted_the_request_then_the_dependency_charges_nothing(
    memory_manager: KeyManager,
) -> None:
    from apikeys import APIKeyMiddleware

    api_key = APIKeySecurity(memory_manager)
    app = FastAPI()
    install_error_handler(app)

    @app.get("/api/contacts")
    async def contacts(
        key: KeyRecord = Security(api_key, scopes=["contacts:read"]),
    ) -> dict[str, str]:
        return {"id": key.id}

    @app.post("/api/contacts")
    async def add(key: KeyRecord = Security(api_key, scopes=["contacts:write"])) -> dict[str, str]:
        return {"id": key.id}

    served = APIKeyMiddleware(
        app, manager=memory_manager, limiter=memory_manager.limiter, unmapped="allow"
    )
    created = await memory_manager.create(name="n", scopes=["contacts:read"], credits=10)
    transport = httpx.ASGITransport(app=served)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        response = await http.get("/api/contacts", headers=bearer(created.key))
        refused = await http.post("/api/contacts", headers=bearer(created.key))
    assert response.status_code == 200
    assert response.headers.get_list("ratelimit") == ['"default";r=99;t=60, "credits";r=9']
    assert refused.status_code == 403
    assert refused.json()["code"] == "insufficient_scope"
    await memory_manager.flush()
    # One credit for each request, spent by the middleware; none by the dependency.
    assert (await memory_manager.get(created.record.id)).credits == 8
    (today,) = await memory_manager.usage(created.record.id, days=1)
    assert (today.admitted, dict(today.refused)) == (1, {"insufficient_scope": 1})


def test_if_a_cost_rule_is_wrong_then_refused_when_built(memory_manager: KeyManager) -> None:
    with pytest.raises(ConfigurationError, match="cost rule"):
        APIKeySecurity(memory_manager, costs={"POST /trigger": 0})


# -- the lifespan, the OpenAPI document, CORS and route rules ---------------------------------


def _module_app(tmp_path: Path) -> tuple[FastAPI, APIKeySecurity, KeyManager]:
    """The README's FastAPI app: a module-level manager on a store of its own."""
    manager = KeyManager(f"sqlite:///{tmp_path / 'apikeys.db'}", hasher=Hasher(pepper=OTHER))
    api_key = APIKeySecurity(manager)
    app = FastAPI(lifespan=api_key.lifespan)
    install_error_handler(app)

    @app.get("/api/v1/contacts")
    async def contacts(
        key: KeyRecord = Security(api_key, scopes=["contacts:read"]),
    ) -> dict[str, str]:
        return {"workspace": key.workspace}

    return app, api_key, manager


OTHER = "dRq0N5hYF2l4Yl1m1wF9mQ4vT6cKpZr3Xs8uBa7eJhE"


async def _record_pepper(url: str, pepper: str) -> None:
    async with KeyManager(url, hasher=Hasher(pepper=pepper)):
        pass  # the store now records that pepper's fingerprint


def test_if_overridden_then_the_lifespan_opens_the_test_manager_not_the_modules(
    tmp_path: Path,
) -> None:
    # The module's store was made under a pepper the test process does not have: opening it
    # fails on the fingerprint. A TestClient with the dependency overridden never opens it.
    import asyncio

    asyncio.run(_record_pepper(f"sqlite:///{tmp_path / 'apikeys.db'}", TEST_PEPPER))
    app, api_key, _ = _module_app(tmp_path)
    test_manager = in_memory_manager()
    app.dependency_overrides[api_key] = APIKeySecurity(test_manager)
    created = KeyFactory(test_manager).sync(scopes=["contacts:read"], workspace="acme")
    with TestClient(app) as client:
        response = client.get("/api/v1/contacts", headers=bearer(created.key))
    assert response.status_code == 200
    assert response.json() == {"workspace": "acme"}


def test_if_not_overridden_then_the_lifespan_refuses_a_store_of_another_pepper(
    tmp_path: Path,
) -> None:
    import asyncio

    asyncio.run(_record_pepper(f"sqlite:///{tmp_path / 'apikeys.db'}", TEST_PEPPER))
    app, _, _ = _module_app(tmp_path)
    with pytest.raises(ConfigurationError, match="pepper"), TestClient(app):
        pass


def test_if_overridden_by_a_function_then_the_lifespan_opens_nothing(tmp_path: Path) -> None:
    import asyncio

    asyncio.run(_record_pepper(f"sqlite:///{tmp_path / 'apikeys.db'}", TEST_PEPPER))
    app, api_key, _ = _module_app(tmp_path)
    test_manager = in_memory_manager()
    record = KeyFactory(test_manager).sync(scopes=["contacts:read"]).record
    close_manager(test_manager)
    app.dependency_overrides[api_key] = lambda: record
    with TestClient(app) as client:
        assert client.get("/api/v1/contacts").json() == {"workspace": "default"}


def test_if_error_handler_installed_then_openapi_declares_the_problem_answers(
    memory_manager: KeyManager,
) -> None:
    app = build(memory_manager)

    @app.get("/public")
    async def public() -> dict[str, str]:
        return {}

    document = app.openapi()
    for path, method in [("/contacts", "get"), ("/contacts", "post"), ("/me", "get")]:
        responses = document["paths"][path][method]["responses"]
        assert {"200", "401", "403", "429", "503"} <= set(responses), (path, method)
        problem = responses["401"]["content"]["application/problem+json"]["schema"]
        assert problem == {"$ref": "#/components/schemas/Problem"}
    assert set(document["paths"]["/public"]["get"]["responses"]) == {"200"}
    schema = document["components"]["schemas"]["Problem"]
    assert {"type", "title", "status", "code"} <= set(schema["properties"])
    assert app.openapi() is document


def test_if_the_dependency_is_on_the_router_then_openapi_declares_the_problems_too(
    memory_manager: KeyManager,
) -> None:
    api_key = APIKeySecurity(memory_manager)
    router = APIRouter(dependencies=[Security(api_key)])

    @router.get("/items")
    async def items() -> list[str]:
        return []

    app = FastAPI()
    app.include_router(router)
    install_error_handler(app)
    assert "429" in app.openapi()["paths"]["/items"]["get"]["responses"]


async def test_if_cors_middleware_serves_the_app_then_a_preflight_passes_without_a_key(
    memory_manager: KeyManager,
) -> None:
    # CORSMiddleware (outside the dependency, as every FastAPI middleware is) answers the
    # preflight itself; the request that follows still needs its key.
    app = build(memory_manager)
    app.add_middleware(
        CORSMiddleware, allow_origins=["https://app.example"], allow_headers=["Authorization"]
    )
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "GET",
        "Access-Control-Request-Headers": "authorization",
    }
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        answered = await http.options("/contacts", headers=preflight)
        plain = await http.options("/contacts", headers={"Origin": "https://app.example"})
        refused = await http.get("/contacts", headers={"Origin": "https://app.example"})
    assert answered.status_code == 200
    assert answered.headers["access-control-allow-origin"] == "https://app.example"
    assert plain.status_code == 405  # not a preflight: the route, which has no OPTIONS
    assert refused.status_code == 401


def test_if_a_cost_rule_matches_no_route_then_the_lifespan_warns(
    memory_manager: KeyManager,
) -> None:
    api_key = APIKeySecurity(
        memory_manager, costs={"POST /campaigns/{id}/trigger": 5, "GET /contacts/": 2}
    )
    app = FastAPI(lifespan=api_key.lifespan)

    @app.get("/contacts")
    async def contacts(key: KeyRecord = Security(api_key)) -> dict[str, str]:
        return {}

    with pytest.warns(RouteRuleWarning) as caught, TestClient(app):
        pass
    messages = sorted(str(warning.message) for warning in caught)
    assert len(messages) == 2
    assert "'GET /contacts/'" in messages[0]
    assert "trailing slash" in messages[0]
    assert "'POST /campaigns/{id}/trigger' matches no route" in messages[1]


def test_if_a_cost_rule_names_a_route_of_an_included_router_then_no_warning(
    memory_manager: KeyManager,
) -> None:
    api_key = APIKeySecurity(memory_manager, costs={"POST /api/v1/campaigns/{id}/trigger": 5})
    router = APIRouter(prefix="/v1")

    @router.post("/campaigns/{campaign:int}/trigger")
    async def trigger(campaign: int, key: KeyRecord = Security(api_key)) -> dict[str, str]:
        return {}

    app = FastAPI(lifespan=api_key.lifespan)
    app.include_router(router, prefix="/api")
    with TestClient(app):
        pass  # filterwarnings = error: a RouteRuleWarning would fail the test


async def test_if_no_lifespan_checks_the_cost_rules_then_the_first_request_does(
    memory_manager: KeyManager,
) -> None:
    api_key = APIKeySecurity(memory_manager, costs={"GET /contact": 2})
    app = FastAPI()

    @app.get("/contacts")
    async def contacts(key: KeyRecord = Security(api_key)) -> dict[str, str]:
        return {}

    created = await memory_manager.create(name="n", full_access=True)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        with pytest.warns(RouteRuleWarning, match="'GET /contact' matches no route"):
            await http.get("/contacts", headers=bearer(created.key))
        await http.get("/contacts", headers=bearer(created.key))  # said once


async def test_the_dependency_and_the_scope_give_the_keys_identity(
    memory_manager: KeyManager,
) -> None:
    api_key = APIKeySecurity(memory_manager)
    app = FastAPI()
    install_error_handler(app)

    @app.get("/whose")
    async def whose(request: Request, key: KeyRecord = Security(api_key)) -> dict[str, str | None]:
        return {"identity": key.identity, "in_scope": request.scope["apikey"].identity}

    await memory_manager.create_identity("cust_42", workspace="acme")
    grouped = await memory_manager.create(
        name="g", workspace="acme", full_access=True, identity="cust_42"
    )
    alone = await memory_manager.create(name="a", workspace="acme", full_access=True)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        of_identity = await http.get("/whose", headers=bearer(grouped.key))
        of_none = await http.get("/whose", headers=bearer(alone.key))
    assert of_identity.json() == {"identity": "cust_42", "in_scope": "cust_42"}
    assert of_none.json() == {"identity": None, "in_scope": None}
