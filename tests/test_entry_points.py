"""Every entry point answers every request the same way: one table of behaviours.

The same app (a contacts list that needs `contacts:read`, a campaign trigger that needs
`campaigns:trigger` and costs 5 credits) is served through each entry point: the ASGI
middleware, Starlette's `AuthenticationMiddleware` with `APIKeyBackend` and `requires()`,
the FastAPI dependency, and the Django middleware (through Django's ASGI handler). Each
behaviour below runs through each of them and checks what the client sees and what the
key's usage history and the telemetry record.

The one difference is the Starlette backend's, by Starlette's design: a request with no key
is anonymous, and `requires()` answers it (403, or a redirect).
"""

from __future__ import annotations

import django
from django.conf import settings

if not settings.configured:  # as tests/integrations/test_django.py configures it
    settings.configure(
        DEBUG=False,
        SECRET_KEY="apikeys-tests-not-secret",
        ALLOWED_HOSTS=["testserver", "t"],
        ROOT_URLCONF=__name__,
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "rest_framework"],
        MIDDLEWARE=[],
        DATABASES={},
    )
    django.setup()

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpRequest
from django.http import JsonResponse as DjangoJSON
from django.test import override_settings
from django.urls import path as django_path
from fastapi import FastAPI, Security
from starlette.applications import Starlette
from starlette.authentication import requires
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import apikeys
from apikeys import (
    APIKeyMiddleware,
    Hasher,
    KeyManager,
    KeyRecord,
    MemoryStore,
    RateLimiter,
    generate_key,
)
from apikeys.errors import LimiterUnavailable
from apikeys.integrations import django as django_integration
from apikeys.integrations.fastapi import APIKeySecurity, install_error_handler
from apikeys.integrations.starlette import APIKeyBackend, on_auth_error
from apikeys.ratelimit import Plan
from apikeys.sync import KeyManager as SyncKeyManager
from apikeys.telemetry import TelemetryEvent
from apikeys.types import DailyUsage
from tests.conftest import TEST_PEPPER
from tests.public_surface import assert_all_is_complete, assert_exports_are_documented

SCOPES = {
    "GET /api/contacts": "contacts:read",
    "POST /api/campaigns/{id}/trigger": "campaigns:trigger",
}
COSTS = {"POST /api/campaigns/{id}/trigger": 5}
CONTACTS, TRIGGER = "/api/contacts", "/api/campaigns/7/trigger"


def middleware_app(manager: KeyManager, limiter: RateLimiter | None) -> Any:
    async def contacts(request: Request) -> JSONResponse:
        return JSONResponse({"key": request.scope["apikey"].id})

    async def trigger(request: Request) -> JSONResponse:
        return JSONResponse({"key": request.scope["apikey"].id})

    app = Starlette(
        routes=[
            Route("/api/contacts", contacts),
            Route("/api/campaigns/{id}/trigger", trigger, methods=["POST"]),
        ]
    )
    return APIKeyMiddleware(
        app,
        manager=manager,
        scopes=SCOPES,
        costs=COSTS,
        protect="/api/",
        limiter=limiter if limiter is not None else manager.limiter,
    )


def starlette_app(manager: KeyManager, limiter: RateLimiter | None) -> Any:
    @requires("contacts:read")
    async def contacts(request: Request) -> JSONResponse:
        return JSONResponse({"key": request.user.identity})

    @requires("campaigns:trigger")
    async def trigger(request: Request) -> JSONResponse:
        return JSONResponse({"key": request.user.identity})

    backend = APIKeyBackend(manager, limiter=limiter, scopes=SCOPES, costs=COSTS)
    return Starlette(
        routes=[
            Route("/api/contacts", contacts),
            Route("/api/campaigns/{id}/trigger", trigger, methods=["POST"]),
        ],
        middleware=[Middleware(AuthenticationMiddleware, backend=backend, on_error=on_auth_error)],
    )


def fastapi_app(manager: KeyManager, limiter: RateLimiter | None) -> Any:
    api_key = APIKeySecurity(manager, limiter=limiter, costs=COSTS)
    app = FastAPI()
    install_error_handler(app)

    @app.get("/api/contacts")
    async def contacts(key: KeyRecord = Security(api_key, scopes=["contacts:read"])) -> Any:
        return {"key": key.id}

    @app.post("/api/campaigns/{id}/trigger")
    async def trigger(
        id: int, key: KeyRecord = Security(api_key, scopes=["campaigns:trigger"])
    ) -> Any:
        return {"key": key.id}

    return app


def django_view(request: HttpRequest, id: int | None = None) -> DjangoJSON:
    return DjangoJSON({"key": request.apikey.id})  # type: ignore[attr-defined]


urlpatterns = [
    django_path("api/contacts", django_view),
    django_path("api/campaigns/<int:id>/trigger", django_view),
]


ENTRY_POINTS: dict[str, Callable[[KeyManager, RateLimiter | None], Any]] = {
    "middleware": middleware_app,
    "starlette": starlette_app,
    "fastapi": fastapi_app,
    "django": lambda manager, limiter: ASGIHandler(),
}


@dataclass
class Served:
    """One entry point serving the app: its client, its manager and what it reported."""

    name: str
    manager: Any  # a KeyManager, or Django's awaited on its own loop
    http: httpx.AsyncClient
    events: list[TelemetryEvent] = field(default_factory=list)

    async def create(self, **options: Any) -> tuple[str, KeyRecord]:
        options.setdefault("scopes", ["contacts:read", "campaigns:trigger"])
        created = await self.manager.create(name="k", workspace="acme", **options)
        return created.key, created.record

    async def usage(self, key_id: str) -> DailyUsage:
        await self.manager.flush()
        (today,) = await self.manager.usage(key_id, days=1)
        return today

    def limited(self) -> list[str | None]:
        return [event.outcome for event in self.events if event.kind == "limited"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


Serve = Callable[..., Awaitable[Served]]


class OnItsLoop:
    """Django's manager, awaited from the test's loop: its methods run on its own loop."""

    def __init__(self, manager: SyncKeyManager) -> None:
        self._sync = manager

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self._sync.manager, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self._sync.loop_thread.acall(method, *args, **kwargs)

        return call


@pytest.fixture(params=sorted(ENTRY_POINTS))
async def serve(
    request: pytest.FixtureRequest, hasher: Hasher, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Serve]:
    """Serve the app through the entry point of the param, on a fresh memory store."""
    managers: list[KeyManager] = []
    clients: list[httpx.AsyncClient] = []
    stack = contextlib.ExitStack()

    async def start(store: MemoryStore | None = None, limiter: RateLimiter | None = None) -> Served:
        events: list[TelemetryEvent] = []
        if request.param == "django":
            manager: Any = start_django(stack, monkeypatch, store, limiter, events)
        else:
            manager = KeyManager(
                store or MemoryStore(),
                hasher=hasher,
                usage_flush_interval=0.05,
                on_event=events.append,
            )
            managers.append(manager)
        app = ENTRY_POINTS[request.param](manager, limiter)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        clients.append(http)
        return Served(request.param, manager, http, events)

    yield start
    for http in clients:
        await http.aclose()
    for manager in managers:
        await manager.aclose()
    await asyncio.to_thread(stack.close)


def start_django(
    stack: contextlib.ExitStack,
    monkeypatch: pytest.MonkeyPatch,
    store: MemoryStore | None,
    limiter: RateLimiter | None,
    events: list[TelemetryEvent],
) -> OnItsLoop:
    """Django's settings for the app; its manager (made from them, on its own loop)."""
    if store is not None:
        monkeypatch.setattr(django_integration, "store_from_url", lambda url, **_: store)
    if limiter is not None:

        async def given_limiter(rate_limit: str | None, url: str) -> RateLimiter:
            return limiter

        monkeypatch.setattr(django_integration, "_limiter", given_limiter)
    stack.callback(django_integration.reset)
    stack.enter_context(
        override_settings(
            ROOT_URLCONF=__name__,
            ALLOWED_HOSTS=["t"],
            MIDDLEWARE=["apikeys.integrations.django.APIKeyMiddleware"],
            APIKEYS={
                "STORE_URL": "memory://",
                "PEPPER": TEST_PEPPER,
                "PROTECT": "/api/",
                "SCOPES": SCOPES,
                "COSTS": COSTS,
                "MANAGER_OPTIONS": {"usage_flush_interval": 0.05, "on_event": events.append},
            },
        )
    )
    return OnItsLoop(django_integration.get_manager())


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["code"] == code
    return body


async def test_if_key_has_the_scope_then_admitted_with_ratelimit_headers(serve: Serve) -> None:
    served = await serve()
    key, record = await served.create()
    response = await served.http.get(CONTACTS, headers=bearer(key))
    assert response.status_code == 200
    assert response.json() == {"key": record.id}
    if served.name != "starlette":  # the backend cannot add headers to a response
        assert response.headers["ratelimit"] == '"default";r=99;t=60'
        assert response.headers["ratelimit-policy"] == '"default";q=100;w=60'
    usage = await served.usage(record.id)
    assert (usage.admitted, dict(usage.refused)) == (1, {})


async def test_if_no_key_then_401_missing_api_key(serve: Serve) -> None:
    served = await serve()
    response = await served.http.get(CONTACTS)
    if served.name == "starlette":
        # Anonymous, as AuthenticationBackend means it: requires() answers.
        assert response.status_code == 403
        return
    assert_problem(response, 401, "missing_api_key")
    assert response.headers["www-authenticate"] == 'Bearer realm="api"'


@pytest.mark.parametrize(
    ("token", "code"),
    [
        ("nope", "malformed_api_key"),
        ("ak_3xK9pQ2mZ7aB_" + "V" * 32 + "000000", "malformed_api_key"),  # bad checksum
    ],
)
async def test_if_key_malformed_then_401(serve: Serve, token: str, code: str) -> None:
    served = await serve()
    response = await served.http.get(CONTACTS, headers=bearer(token))
    assert_problem(response, 401, code)
    assert response.headers["www-authenticate"] == 'Bearer realm="api", error="invalid_token"'


async def test_if_key_unknown_then_401_invalid_api_key(serve: Serve) -> None:
    served = await serve()
    response = await served.http.get(CONTACTS, headers=bearer(generate_key().token))
    assert_problem(response, 401, "invalid_api_key")
    assert response.headers["www-authenticate"] == 'Bearer realm="api", error="invalid_token"'


@pytest.mark.parametrize("change", ["revoke", "disable"])
async def test_if_key_revoked_or_disabled_then_401(serve: Serve, change: str) -> None:
    served = await serve()
    key, record = await served.create()
    assert (await served.http.get(CONTACTS, headers=bearer(key))).status_code == 200
    await getattr(served.manager, change)(record.id)
    response = await served.http.get(CONTACTS, headers=bearer(key))
    assert_problem(response, 401, "key_revoked" if change == "revoke" else "key_disabled")


async def test_if_scope_missing_then_403_counted_as_refused_and_no_credit_spent(
    serve: Serve,
) -> None:
    served = await serve()
    key, record = await served.create(scopes=["contacts:read"], credits=10)
    response = await served.http.post(TRIGGER, headers=bearer(key))
    body = assert_problem(response, 403, "insufficient_scope")
    assert body["required_scopes"] == ["campaigns:trigger"]
    assert (
        'error="insufficient_scope", scope="campaigns:trigger"'
        in (response.headers["www-authenticate"])
    )
    assert (await served.manager.get(record.id)).credits == 10
    usage = await served.usage(record.id)
    assert (usage.admitted, dict(usage.refused)) == (0, {"insufficient_scope": 1})
    assert (await served.manager.get(record.id)).request_count == 1


async def test_if_rate_limited_then_429_with_headers_counted_and_reported(serve: Serve) -> None:
    served = await serve()
    key, record = await served.create(rate_limit="2/minute")
    for remaining in (1, 0):
        response = await served.http.get(CONTACTS, headers=bearer(key))
        assert response.status_code == 200
        if served.name != "starlette":
            assert response.headers["ratelimit"] == f'"default";r={remaining};t=60'
    response = await served.http.get(CONTACTS, headers=bearer(key))
    body = assert_problem(response, 429, "rate_limited")
    assert body["violated_policies"] == ["default"]
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert response.headers["ratelimit-policy"] == '"default";q=2;w=60'
    assert response.headers["ratelimit"].startswith('"default";r=0;t=')
    usage = await served.usage(record.id)
    assert (usage.admitted, dict(usage.refused)) == (2, {"rate_limited": 1})
    assert served.limited() == ["rate_limited"]


async def test_if_one_of_several_policies_exhausted_then_429_names_it(serve: Serve) -> None:
    served = await serve()
    key, _ = await served.create(rate_limit="burst=1/minute, daily=100/day")
    assert (await served.http.get(CONTACTS, headers=bearer(key))).status_code == 200
    response = await served.http.get(CONTACTS, headers=bearer(key))
    assert assert_problem(response, 429, "rate_limited")["violated_policies"] == ["burst"]
    assert response.headers["ratelimit-policy"] == '"burst";q=1;w=60, "daily";q=100;w=86400'


async def test_if_route_has_a_cost_then_credits_spent_once_by_it(serve: Serve) -> None:
    served = await serve()
    key, record = await served.create(credits=12)
    assert (await served.http.post(TRIGGER, headers=bearer(key))).status_code == 200
    assert (await served.manager.get(record.id)).credits == 7
    assert (await served.http.get(CONTACTS, headers=bearer(key))).status_code == 200
    assert (await served.manager.get(record.id)).credits == 6
    assert (await served.http.post(TRIGGER, headers=bearer(key))).status_code == 200
    response = await served.http.post(TRIGGER, headers=bearer(key))
    assert_problem(response, 429, "credits_exhausted")
    assert (await served.manager.get(record.id)).credits == 1
    usage = await served.usage(record.id)
    assert (usage.admitted, dict(usage.refused)) == (3, {"credits_exhausted": 1})
    assert served.limited() == ["credits_exhausted"]


async def test_if_address_outside_allowlist_then_403_charged_to_nothing(serve: Serve) -> None:
    served = await serve()
    key, record = await served.create(allowed_ips=["10.0.0.0/8"], credits=5, rate_limit="1/minute")
    for _ in range(2):  # charged to no limit: the second is refused for its address again
        response = await served.http.get(CONTACTS, headers=bearer(key))
        assert_problem(response, 403, "ip_not_allowed")
    assert (await served.manager.get(record.id)).credits == 5
    usage = await served.usage(record.id)
    assert (usage.admitted, dict(usage.refused)) == (0, {"ip_not_allowed": 2})
    assert served.limited() == []


class BrokenStore(MemoryStore):
    def get_for_verification_now(self, key_id: str) -> None:
        raise RuntimeError("the store broke in a way nobody foresaw")


async def test_if_store_breaks_then_503_never_500(serve: Serve) -> None:
    served = await serve(store=BrokenStore())
    response = await served.http.get(CONTACTS, headers=bearer(generate_key().token))
    assert_problem(response, 503, "auth_unavailable")


class DownLimiter(RateLimiter):
    def charge(self, plan: Plan, cost: int = 1) -> Any:
        raise LimiterUnavailable(ConnectionError("limiter down"))


class BrokenLimiter(RateLimiter):
    def charge(self, plan: Plan, cost: int = 1) -> Any:
        raise RuntimeError("the limiter broke in a way nobody foresaw")


@pytest.mark.parametrize("limiter", [DownLimiter, BrokenLimiter])
async def test_if_limiter_fails_then_503_and_history_has_no_auth_unavailable(
    serve: Serve, limiter: type[RateLimiter]
) -> None:
    served = await serve(limiter=limiter())
    key, record = await served.create()
    response = await served.http.get(CONTACTS, headers=bearer(key))
    assert_problem(response, 503, "auth_unavailable")
    usage = await served.usage(record.id)
    assert "auth_unavailable" not in usage.refused
    assert usage.total == 1
    assert served.limited() == []


@pytest.mark.parametrize(
    "name", ["apikeys.gate", "apikeys.routes", "apikeys.credentials", "apikeys.middleware"]
)
def test_the_request_path_modules_export_and_document_what_they_define(name: str) -> None:
    assert_all_is_complete(name)
    assert_exports_are_documented(name)


def test_what_users_imported_from_the_middleware_is_still_there() -> None:
    from apikeys import middleware, routes

    assert middleware.ScopeTable is routes.ScopeTable is apikeys.ScopeTable
    assert middleware.CostTable is routes.CostTable
    for name in ("bearer_token", "header_token", "check_address", "spend_credit"):
        assert callable(getattr(middleware, name))
