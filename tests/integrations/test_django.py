"""The Django integration with Django's own test clients: the middleware (WSGI and ASGI), the
Django REST framework classes (APIClient), and the settings."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import django
import httpx
import pytest
from django.conf import settings

if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="apikeys-tests-not-secret",
        ALLOWED_HOSTS=["testserver"],
        ROOT_URLCONF=__name__,
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "rest_framework"],
        MIDDLEWARE=[],
        DATABASES={},
    )
    django.setup()

from asgiref.sync import iscoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import AsyncClient, AsyncRequestFactory, Client, override_settings
from django.urls import path
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter
from rest_framework.test import APIClient
from rest_framework.views import APIView
from rest_framework.viewsets import ViewSet

from apikeys import APIKeyMiddleware as ASGIMiddleware
from apikeys import ConfigurationError
from apikeys.hashing import Hasher
from apikeys.integrations import django as integration
from apikeys.integrations.django import (
    APIKeyAuthentication,
    APIKeyMiddleware,
    HasScopes,
    check_request,
    checks,
    current_realm,
    get_manager,
)
from apikeys.integrations.django.management.commands.apikeys import Command as ApikeysCommand
from apikeys.integrations.django.testing import make_key
from apikeys.sync import KeyManager
from tests.conftest import TEST_PEPPER, delete_redis_prefix
from tests.public_surface import assert_all_is_complete, assert_exports_are_documented


def contacts(request: HttpRequest) -> JsonResponse:
    key = request.apikey  # type: ignore[attr-defined]
    return JsonResponse(
        {
            "key": key.id,
            "workspace": key.workspace,
            "environment": key.environment,
            "identity": key.identity,
        }
    )


async def async_contacts(request: HttpRequest) -> JsonResponse:
    return contacts(request)


def checked(request: HttpRequest) -> HttpResponse:
    """A plain view (not under PROTECT) that checks the key itself, for one scope."""
    outcome = check_request(request, ("notes:read",))
    if outcome is None:
        return JsonResponse({"anonymous": True})
    if not outcome.passed:
        return outcome.refusal().response()
    assert outcome.record is not None
    return JsonResponse({"key": outcome.record.id})


def health(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True, "key": hasattr(request, "apikey")})


class DRFContacts(APIView):
    authentication_classes = (APIKeyAuthentication,)
    permission_classes = (HasScopes,)
    required_scopes: ClassVar = {"GET": ["contacts:read"], "POST": ["contacts:write"]}

    def get(self, request: Request) -> Response:
        return Response({"key": request.user.record.id, "scopes": list(request.auth.scopes)})

    def post(self, request: Request) -> Response:
        return Response({"written": True}, status=201)


class DRFAnyKey(APIView):
    authentication_classes = (APIKeyAuthentication,)
    permission_classes = (HasScopes,)
    required_scopes = ()

    def get(self, request: Request) -> Response:
        return Response({"key": request.user.record.id})


class DRFUndeclared(APIView):
    authentication_classes = (APIKeyAuthentication,)
    permission_classes = (HasScopes,)

    def get(self, request: Request) -> Response:  # pragma: no cover - never reached
        return Response({})


class DRFNotes(APIView):
    """Under PROTECT, with no SCOPES rule: its required_scopes are its route's rule."""

    authentication_classes = (APIKeyAuthentication,)
    permission_classes = (HasScopes,)
    required_scopes: ClassVar = {"GET": ["notes:read"], "POST": ["notes:write"]}

    def get(self, request: Request, pk: int) -> Response:
        return Response({"note": pk, "key": request.user.record.id})

    def post(self, request: Request, pk: int) -> Response:
        return Response({"written": pk}, status=201)


class DRFReadsTheKey(APIView):
    authentication_classes = (APIKeyAuthentication,)
    permission_classes = (HasScopes,)
    required_scopes = ()

    def get(self, request: Request) -> Response:
        return Response(
            {
                "apikey": request.apikey.id,  # type: ignore[attr-defined]
                "user.record": request.user.record.id,
                "identity": request.apikey.identity,  # type: ignore[attr-defined]
            }
        )


class DRFTags(ViewSet):
    """Routed by DRF's router (regular expressions), under PROTECT with no SCOPES rule."""

    authentication_classes = (APIKeyAuthentication,)
    permission_classes = (HasScopes,)
    required_scopes: ClassVar = {"GET": ["tags:read"]}

    def retrieve(self, request: Request, pk: str) -> Response:
        return Response({"tag": pk})


tags = SimpleRouter()
tags.register("api/v1/tags", DRFTags, basename="tag")


def preflight(request: HttpRequest) -> HttpResponse:
    # What a CORS layer answers to a preflight (it never reaches a view that serves data).
    return HttpResponse(status=200, headers={"Access-Control-Allow-Origin": "*"})


OLD_SERVICE_KEY = "Pq9ZXb3k.old-service-key-that-only-the-old-class-reads"


class OldAPIKeyAuthentication(BaseAuthentication):  # type: ignore[misc]
    """Stands in for djangorestframework-api-key's check of `Api-Key <key>`."""

    def authenticate(self, request: Request) -> tuple[None, str] | None:
        value = request.META.get("HTTP_AUTHORIZATION", "")
        scheme, _, key = value.partition(" ")
        if scheme.lower() != "api-key":
            return None
        if key != OLD_SERVICE_KEY:
            raise AuthenticationFailed("unknown old key")
        return None, "old"

    def authenticate_header(self, request: Request) -> str:
        return "Api-Key"


class AnyAuthenticated(BasePermission):  # type: ignore[misc]
    def has_permission(self, request: Request, view: Any) -> bool:
        return request.auth is not None


class DRFBoth(APIView):
    """A view served to new and old clients while a migration lasts."""

    authentication_classes = (APIKeyAuthentication, OldAPIKeyAuthentication)
    permission_classes = (AnyAuthenticated,)

    def get(self, request: Request) -> Response:
        if isinstance(request.auth, str):
            return Response({"by": "old"})
        return Response({"by": "apikeys", "key": request.user.record.id})


urlpatterns = [
    path("drf/both", DRFBoth.as_view()),
    path("api/v1/contacts", contacts),
    path("api/v1/notes/<int:pk>/", DRFNotes.as_view()),
    path("api/v1/cors", preflight),
    path("api/v1/reads", DRFReadsTheKey.as_view()),
    path("drf/reads", DRFReadsTheKey.as_view()),
    *tags.urls,
    path("api/v1/async", async_contacts),
    path("api/v1/drf", DRFContacts.as_view()),
    path("health", health),
    path("checked", checked),
    path("drf/contacts", DRFContacts.as_view()),
    path("drf/any", DRFAnyKey.as_view()),
    path("drf/undeclared", DRFUndeclared.as_view()),
]

SCOPES = {
    "GET /api/v1/contacts": "contacts:read",
    "GET /api/v1/async": "contacts:read",
    "* /api/v1/drf": "contacts:read",
}
MIDDLEWARE = ["apikeys.integrations.django.APIKeyMiddleware"]
REST_FRAMEWORK = {
    "EXCEPTION_HANDLER": "apikeys.integrations.django.exception_handler",
    "UNAUTHENTICATED_USER": None,
}


def apikeys_settings(store_url: str = "memory://", **more: Any) -> dict[str, Any]:
    return {
        "STORE_URL": store_url,
        "PEPPER": TEST_PEPPER,
        "PROTECT": "/api/",
        "SCOPES": SCOPES,
        "MANAGER_OPTIONS": {"usage_flush_interval": 3600},
        **more,
    }


@pytest.fixture
def django_settings() -> Iterator[dict[str, Any]]:
    """The project's settings for one test, on a fresh manager; closed afterwards."""
    chosen = apikeys_settings()
    with override_settings(
        ROOT_URLCONF=__name__,
        MIDDLEWARE=MIDDLEWARE,
        REST_FRAMEWORK=REST_FRAMEWORK,
        APIKEYS=chosen,
    ):
        try:
            yield chosen
        finally:
            integration.reset()


@pytest.fixture
def on_every_store(store_url: str, store_options: dict[str, str]) -> Iterator[dict[str, Any]]:
    """The same, on each store of the table."""
    chosen = apikeys_settings(store_url, STORE_OPTIONS=store_options)
    try:
        with override_settings(
            ROOT_URLCONF=__name__,
            MIDDLEWARE=MIDDLEWARE,
            REST_FRAMEWORK=REST_FRAMEWORK,
            APIKEYS=chosen,
        ):
            yield chosen
    finally:
        integration.reset()
        if "key_prefix" in store_options:
            asyncio.run(delete_redis_prefix(store_url, store_options["key_prefix"]))


def bearer(key: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def problem(response: HttpResponse) -> dict[str, Any]:
    assert response["Content-Type"] == "application/problem+json"
    body: dict[str, Any] = json.loads(response.content)
    return body


# -- the middleware --------------------------------------------------------------------------


def test_the_middleware_on_every_store(on_every_store: dict[str, Any]) -> None:
    manager = get_manager()
    reader = manager.create(name="r", workspace="acme", scopes=["contacts:read"])
    other = manager.create(name="o", workspace="acme", scopes=["billing:read"])
    client = Client()

    admitted = client.get("/api/v1/contacts", **bearer(reader.key))
    assert admitted.status_code == 200
    assert admitted.json() == {
        "key": reader.record.id,
        "workspace": "acme",
        "environment": "live",
        "identity": None,
    }
    assert admitted["RateLimit"].startswith('"default";r=')
    assert "RateLimit-Policy" in admitted

    missing = client.get("/api/v1/contacts")
    assert missing.status_code == 401
    assert problem(missing)["code"] == "missing_api_key"
    assert missing["WWW-Authenticate"] == 'Bearer realm="api"'

    refused = client.get("/api/v1/contacts", **bearer(other.key))
    assert refused.status_code == 403
    assert problem(refused)["required_scopes"] == ["contacts:read"]

    assert client.get("/health").json() == {"ok": True, "key": False}  # not under PROTECT

    manager.revoke(reader.record.id)
    revoked = client.get("/api/v1/contacts", **bearer(reader.key))
    assert problem(revoked)["code"] == "key_revoked"

    # Counted as the ASGI middleware counts: one admitted request, one refused by scope.
    manager.flush()
    assert manager.get(reader.record.id).request_count == 1
    day = manager.usage(other.record.id, days=1)[-1]
    assert day.refused == {"insufficient_scope": 1}


REFUSALS = [
    pytest.param({}, id="missing"),
    pytest.param({"authorization": "Bearer nonsense"}, id="malformed"),
    pytest.param({"authorization": "Basic dXNlcjpwYXNz"}, id="another-scheme"),
    pytest.param({"authorization": "Bearer ak_live_0000000000000000000000000"}, id="invalid"),
]


@pytest.mark.parametrize("headers", REFUSALS)
def test_refusals_are_the_asgi_middleware_s_own(
    django_settings: dict[str, Any], headers: dict[str, str]
) -> None:
    manager = get_manager()
    asgi = ASGIMiddleware(_ok, manager=manager.manager, scopes=SCOPES, protect="/api/")

    async def through_asgi() -> httpx.Response:
        transport = httpx.ASGITransport(app=asgi)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            return await http.get("/api/v1/contacts", headers=headers)

    expected = manager.loop_thread.call(through_asgi)
    meta = {f"HTTP_{name.upper()}": value for name, value in headers.items()}
    answer = Client().get("/api/v1/contacts", **meta)
    assert answer.status_code == expected.status_code
    assert answer.content == expected.content
    for name in ("content-type", "www-authenticate", "cache-control"):
        assert answer.get(name) == expected.headers.get(name)


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_rate_limits_and_credits(django_settings: dict[str, Any]) -> None:
    with override_settings(APIKEYS=apikeys_settings(RATE_LIMIT="2/minute")):
        rate_limits_and_credits()


def rate_limits_and_credits() -> None:
    manager = get_manager()
    limited = manager.create(name="l", scopes=["contacts:read"])
    client = Client()
    for _ in range(2):
        assert client.get("/api/v1/contacts", **bearer(limited.key)).status_code == 200
    refused = client.get("/api/v1/contacts", **bearer(limited.key))
    assert refused.status_code == 429
    assert problem(refused)["code"] == "rate_limited"
    assert int(refused["Retry-After"]) >= 1

    paying = manager.create(name="p", scopes=["contacts:read"], credits=1)
    spent = client.get("/api/v1/contacts", **bearer(paying.key))
    assert spent.status_code == 200
    assert '"credits";r=0' in spent["RateLimit"]
    exhausted = client.get("/api/v1/contacts", **bearer(paying.key))
    assert problem(exhausted)["code"] == "credits_exhausted"


def test_a_view_routes_by_request_apikey_environment(django_settings: dict[str, Any]) -> None:
    with override_settings(APIKEYS=apikeys_settings()):
        sandbox = get_manager().create(name="s", scopes=["contacts:read"], environment="test")
        answer = Client().get("/api/v1/contacts", **bearer(sandbox.key))
    assert answer.status_code == 200
    assert answer.json()["environment"] == "test"


def test_views_read_the_keys_identity_as_request_apikey_identity(
    django_settings: dict[str, Any],
) -> None:
    manager = get_manager()
    manager.create_identity("cust_42", workspace="default")
    created = manager.create(name="g", scopes=["contacts:read"], identity="cust_42")
    plain = Client().get("/api/v1/contacts", **bearer(created.key))
    assert plain.json()["identity"] == "cust_42"
    for where in ("/api/v1/reads", "/drf/reads"):
        answer = APIClient().get(where, HTTP_AUTHORIZATION=f"Bearer {created.key}")
        assert answer.json()["identity"] == "cust_42"


def test_the_management_command_manages_identities(
    django_settings: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    # On disk: the command line opens the store anew (a memory:// store is its own).
    with override_settings(APIKEYS=apikeys_settings(f"sqlite:///{tmp_path / 'keys.db'}")):
        call_command(
            ApikeysCommand(), "identities", "create", "cust_7", "--workspace", "acme", "--json"
        )
        made = json.loads(capsys.readouterr().out)
        assert (made["id"], made["workspace"], made["status"]) == ("cust_7", "acme", "active")
        call_command(ApikeysCommand(), "identities", "disable", "cust_7")
        capsys.readouterr()
        call_command(ApikeysCommand(), "identities", "list", "--json")
        listed = json.loads(capsys.readouterr().out)
        assert [(one["id"], one["status"]) for one in listed] == [("cust_7", "disabled")]
        assert get_manager().get_identity("cust_7").state == "disabled"
        with pytest.raises(CommandError) as refused:
            call_command(ApikeysCommand(), "identities", "show", "cust_404")
        assert refused.value.returncode == 1


def test_the_middleware_from_many_threads(django_settings: dict[str, Any]) -> None:
    manager = get_manager()
    created = manager.create(name="n", scopes=["contacts:read"], rate_limit="1000/minute")
    statuses: list[int] = []

    def work() -> None:
        client = Client()
        for _ in range(5):
            statuses.append(client.get("/api/v1/contacts", **bearer(created.key)).status_code)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == [200] * 30
    manager.flush()
    assert manager.get(created.record.id).request_count == 30


async def test_the_middleware_served_over_asgi(django_settings: dict[str, Any]) -> None:
    manager = get_manager()
    created = await asyncio.to_thread(manager.create, name="n", scopes=["contacts:read"])
    client = AsyncClient()
    admitted = await client.get("/api/v1/async", headers={"Authorization": f"Bearer {created.key}"})
    assert admitted.status_code == 200
    assert admitted.json()["key"] == created.record.id
    assert "RateLimit" in admitted
    missing = await client.get("/api/v1/async")
    assert problem(missing)["code"] == "missing_api_key"


async def test_the_middleware_is_async_under_an_async_handler(
    django_settings: dict[str, Any],
) -> None:
    async def view(request: HttpRequest) -> HttpResponse:
        return HttpResponse(request.apikey.id)  # type: ignore[attr-defined]

    middleware = APIKeyMiddleware(view)
    assert iscoroutinefunction(middleware)
    manager = get_manager()
    created = await asyncio.to_thread(manager.create, name="n", scopes=["contacts:read"])
    request = AsyncRequestFactory().get(
        "/api/v1/contacts", headers={"Authorization": f"Bearer {created.key}"}
    )
    response = await middleware(request)
    assert response.content == created.record.id.encode()
    assert not iscoroutinefunction(APIKeyMiddleware(lambda request: HttpResponse()))


# -- Django REST framework -------------------------------------------------------------------


def test_drf_leaves_schemes_it_does_not_read_to_the_next_class(
    django_settings: dict[str, Any],
) -> None:
    manager = get_manager()
    new = manager.create(name="n", full_access=True)
    client = APIClient()
    assert client.get("/drf/both", **bearer(new.key)).json() == {
        "by": "apikeys",
        "key": new.record.id,
    }
    old = client.get("/drf/both", HTTP_AUTHORIZATION=f"Api-Key {OLD_SERVICE_KEY}")
    assert old.status_code == 200
    assert old.json() == {"by": "old"}
    # A wrong key under the old scheme is the old class's to refuse, not a 500.
    assert client.get("/drf/both", HTTP_AUTHORIZATION="Api-Key nope").status_code == 401
    # Bearer is ours: a bad Bearer key is refused by apikeys, never passed on.
    bad = client.get("/drf/both", HTTP_AUTHORIZATION="Bearer nonsense")
    assert problem(bad)["code"] == "malformed_api_key"
    # No header at all: anonymous for both, refused by the permission.
    assert client.get("/drf/both").status_code == 401


def _import_old_key(key: str) -> str:
    from apikeys.importing import ForeignKey, import_keys

    manager = get_manager()
    row = ForeignKey(
        row=1,
        name="Zapier",
        hashed="sha512$$" + hashlib.sha512(key.encode()).hexdigest(),
        prefix=key.split(".")[0],
    )
    report = manager.loop_thread.call(
        import_keys,
        manager.manager,
        [row],
        source="drf-api-key",
        workspace="acme",
        full_access=True,
    )
    return report.imported[0].id


def test_legacy_scheme_setting_reads_imported_keys_in_middleware_and_drf(
    django_settings: dict[str, Any],
) -> None:
    old_key = "Zz8Yy7Xx.imported-from-drf-api-key-0123456789"
    with override_settings(APIKEYS=apikeys_settings(LEGACY_SCHEMES=["Api-Key"])):
        key_id = _import_old_key(old_key)
        own = get_manager().create(name="n", full_access=True)
        legacy = {"HTTP_AUTHORIZATION": f"Api-Key {old_key}"}
        # The Django middleware, on a protected path.
        admitted = Client().get("/api/v1/contacts", **legacy)
        assert admitted.status_code == 200
        assert admitted.json()["key"] == key_id
        refused = Client().get("/api/v1/contacts", HTTP_AUTHORIZATION=f"Api-Key {own.key}")
        assert problem(refused)["code"] == "malformed_api_key"
        # DRF: the imported key under the old scheme is apikeys' now.
        through_drf = APIClient().get("/drf/both", **legacy)
        assert through_drf.json() == {"by": "apikeys", "key": key_id}
        manager = get_manager()
        manager.flush()
        assert manager.usage(key_id, days=1)[-1].legacy_scheme == 2


def test_drf_authentication_and_scopes_by_method(django_settings: dict[str, Any]) -> None:
    manager = get_manager()
    reader = manager.create(name="r", scopes=["contacts:read"])
    writer = manager.create(name="w", scopes=["contacts:*"])
    client = APIClient()

    missing = client.get("/drf/contacts")
    assert missing.status_code == 401
    assert problem(missing)["code"] == "missing_api_key"
    assert missing["WWW-Authenticate"] == 'Bearer realm="api"'

    client.credentials(HTTP_AUTHORIZATION=f"Bearer {reader.key}")
    read = client.get("/drf/contacts")
    assert read.status_code == 200
    assert read.json()["key"] == reader.record.id
    assert "RateLimit" in read  # the middleware adds what the authentication noted
    cannot_write = client.post("/drf/contacts")
    assert cannot_write.status_code == 403
    assert problem(cannot_write)["required_scopes"] == ["contacts:write"]

    client.credentials(HTTP_AUTHORIZATION=f"Bearer {writer.key}")
    assert client.post("/drf/contacts").status_code == 201
    client.credentials(HTTP_AUTHORIZATION="Bearer nonsense")
    assert problem(client.get("/drf/any"))["code"] == "malformed_api_key"


def test_drf_checks_scopes_before_it_spends_credits(django_settings: dict[str, Any]) -> None:
    manager = get_manager()
    created = manager.create(name="c", scopes=["billing:read"], credits=3)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {created.key}")
    assert client.get("/drf/contacts").status_code == 403
    assert manager.get(created.record.id).credits == 3
    assert client.get("/drf/any").status_code == 200
    assert manager.get(created.record.id).credits == 2


def test_a_request_the_middleware_admitted_is_charged_once(
    django_settings: dict[str, Any],
) -> None:
    # /api/v1/drf is under PROTECT (the middleware charges it) and a DRF view (which must not).
    manager = get_manager()
    created = manager.create(name="c", scopes=["contacts:read"], credits=5)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {created.key}")
    answer = client.get("/api/v1/drf")
    assert answer.status_code == 200
    assert manager.get(created.record.id).credits == 4
    assert answer["RateLimit"].count('"credits"') == 1
    # The view's own scopes still hold for a key the middleware let through.
    assert problem(client.post("/api/v1/drf"))["code"] == "insufficient_scope"
    manager.flush()
    assert manager.get(created.record.id).request_count == 2
    # Counted in the key's history as refused, as every entry point counts it.
    (today,) = manager.usage(created.record.id, days=1)
    assert (today.admitted, dict(today.refused)) == (1, {"insufficient_scope": 1})


def test_drf_without_the_exception_handler_keeps_status_body_and_challenge(
    django_settings: dict[str, Any],
) -> None:
    manager = get_manager()
    created = manager.create(name="r", scopes=["billing:read"], rate_limit="1/minute")
    with override_settings(REST_FRAMEWORK={"UNAUTHENTICATED_USER": None}):
        client = APIClient()
        missing = client.get("/drf/contacts")
        assert missing.status_code == 401
        assert missing.json()["code"] == "missing_api_key"
        assert missing.json()["status"] == 401
        assert missing["WWW-Authenticate"] == 'Bearer realm="api"'
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {created.key}")
        assert client.get("/drf/any").status_code == 200
        limited = client.get("/drf/any")
        assert limited.status_code == 429
        assert limited.json()["code"] == "rate_limited"
        assert int(limited["Retry-After"]) >= 1


def test_a_view_without_required_scopes_is_a_configuration_error(
    django_settings: dict[str, Any],
) -> None:
    created = get_manager().create(name="r", full_access=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {created.key}")
    with pytest.raises(ImproperlyConfigured, match="required_scopes"):
        client.get("/drf/undeclared")


def test_a_plain_view_checks_a_key_for_its_scopes_with_check_request(
    django_settings: dict[str, Any],
) -> None:
    manager = get_manager()
    reader = manager.create(name="r", scopes=["notes:read"], credits=2)
    other = manager.create(name="o", scopes=["contacts:read"], credits=2)
    client = Client()

    assert client.get("/checked").json() == {"anonymous": True}
    assert client.get("/checked", **bearer(reader.key)).json() == {"key": reader.record.id}
    assert manager.get(reader.record.id).credits == 1
    refused = client.get("/checked", **bearer(other.key))
    assert refused.status_code == 403
    assert problem(refused)["required_scopes"] == ["notes:read"]
    assert manager.get(other.record.id).credits == 2  # scopes are checked before credits
    assert problem(client.get("/checked", **bearer("nonsense")))["code"] == "malformed_api_key"
    assert current_realm() == "api"


def test_the_django_module_exports_and_documents_what_it_defines() -> None:
    # The DRF classes (apikeys/integrations/django/drf.py) import check_request, current_realm and
    # Outcome from here: they are public names of this module, not private ones.
    assert_all_is_complete("apikeys.integrations.django")
    assert_exports_are_documented("apikeys.integrations.django")


# -- settings --------------------------------------------------------------------------------


def test_the_store_is_the_command_line_s(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    monkeypatch.setenv("APIKEYS_STORE_URL", url)
    monkeypatch.setenv("APIKEYS_PEPPER", TEST_PEPPER)
    chosen = {"PROTECT": "/api/", "SCOPES": SCOPES}
    try:
        with override_settings(ROOT_URLCONF=__name__, MIDDLEWARE=MIDDLEWARE, APIKEYS=chosen):
            made = KeyManager(url)
            try:
                created = made.create(name="from a script", scopes=["contacts:read"])
            finally:
                made.close()
            answer = Client().get("/api/v1/contacts", **bearer(created.key))
            assert answer.status_code == 200
    finally:
        integration.reset()


def test_unknown_settings_are_refused() -> None:
    try:
        with (
            override_settings(APIKEYS={"STORE": "memory://"}),
            pytest.raises(ConfigurationError, match="unknown APIKEYS setting"),
        ):
            get_manager()
    finally:
        integration.reset()


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"RATE_LIMIT": 5}, "RATE_LIMIT"),
        ({"PROTECT": None}, "PROTECT"),
        ({"PUBLIC": [1, 2]}, "PUBLIC"),
        ({"SCOPES": ["GET /x"]}, "SCOPES"),
        ({"SCOPES": {"GET /x": 5}}, "GET /x"),
        ({"TRUSTED_PROXIES": "1"}, "TRUSTED_PROXIES"),
        ({"STORE_OPTIONS": {"nope": 1}}, "STORE_OPTIONS"),
        ({"MANAGER_OPTIONS": {"nope": 1}}, "MANAGER_OPTIONS"),
    ],
)
def test_a_setting_of_the_wrong_kind_is_a_configuration_error_naming_it(
    given: dict[str, object], named: str
) -> None:
    # As apikeys_settings() promises: not a TypeError or AttributeError from deep inside.
    try:
        with (
            override_settings(APIKEYS={"STORE_URL": "memory://", **given}),
            pytest.raises(ConfigurationError, match=re.escape(named)),
        ):
            get_manager()
    finally:
        integration.reset()


def test_a_realm_no_challenge_can_carry_is_refused_at_startup() -> None:
    try:
        with (
            override_settings(APIKEYS={"REALM": "api\r\nSet-Cookie: a=b"}),
            pytest.raises(ConfigurationError, match="realm"),
        ):
            get_manager()
    finally:
        integration.reset()


@pytest.mark.parametrize(
    ("module", "imported", "extra"),
    [
        ("rest_framework", "from apikeys.integrations.django import HasScopes", "drf"),
        ("django", "import apikeys.integrations.django", "django"),
        (
            "click",
            "import django; from django.conf import settings; settings.configure(); "
            "django.setup(); from django.core.management import call_command; "
            "from apikeys.integrations.django.management.commands.apikeys import Command; "
            "call_command(Command(), 'list')",
            "cli",
        ),
    ],
)
def test_a_missing_extra_names_its_pip_line(module: str, imported: str, extra: str) -> None:
    code = f"import sys; sys.modules[{module!r}] = None\n{imported}\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode != 0
    assert f"pip install 'apikeys[{extra}]'" in result.stderr


DJANGO_PAGES = ["integrations.md", "testing.md"]


def django_samples() -> list[Any]:
    from pathlib import Path

    from tests.test_docs import blocks

    root = Path(__file__).resolve().parents[2] / "docs"
    return [
        pytest.param(block, id=block.where)
        for page in DJANGO_PAGES
        for block in blocks(root / page)
        if block.language == "python" and "apikeys.integrations.django" in block.code
    ]


@pytest.mark.sqlite
@pytest.mark.parametrize("sample", django_samples())
def test_the_django_samples_in_the_docs_run_as_pasted(sample: Any, tmp_path: Any) -> None:
    # Not run by tests/test_docs.py (Django's settings are global to a process): here, in a
    # process of its own, in an empty directory, with only the pepper set.
    assert sample.directive == "not-run"
    env = {name: value for name, value in os.environ.items() if not name.startswith("APIKEYS_")}
    result = subprocess.run(
        [sys.executable, "-c", sample.code],
        cwd=tmp_path,
        env={**env, "APIKEYS_PEPPER": TEST_PEPPER},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "apikeys.db").exists() == ("memory://" not in sample.code)


def test_every_page_has_its_django_samples() -> None:
    assert len(django_samples()) == 3


# -- start: the pepper -------------------------------------------------------------------------


OTHER_PEPPER = "q7Jd0o3u0w8mF2Zc9yX5kVtH1aLrN6sPeBgUi4WQ-zE"


@pytest.fixture
def peppered_store(tmp_path: Any) -> Iterator[tuple[str, str]]:
    """A SQLite store whose keys are hashed with TEST_PEPPER, and one of its keys."""
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    with KeyManager(url, hasher=Hasher(pepper=TEST_PEPPER)) as manager:
        created = manager.create(name="k", scopes=["contacts:read"])
    yield url, created.key
    integration.reset()


@pytest.mark.sqlite
def test_another_pepper_stops_django_at_start_with_the_store_s_message(
    peppered_store: tuple[str, str],
) -> None:
    url, key = peppered_store
    wrong = apikeys_settings(url, PEPPER=OTHER_PEPPER)
    with override_settings(ROOT_URLCONF=__name__, MIDDLEWARE=MIDDLEWARE, APIKEYS=wrong):
        # The middleware is loaded when the server starts (here, the test client's handler).
        with pytest.raises(ConfigurationError, match="hashed with a pepper of fingerprint"):
            Client().get("/api/v1/contacts", **bearer(key))
        # get_manager() and DRF (which reaches the manager through it) refuse alike.
        with pytest.raises(ConfigurationError, match="hashed with a pepper of fingerprint"):
            get_manager()
        with override_settings(MIDDLEWARE=[]), pytest.raises(ConfigurationError):
            APIClient().get("/drf/contacts", HTTP_AUTHORIZATION=f"Bearer {key}")
        (error,) = checks.check_store()
        assert error.id == "apikeys.E002"
        assert "hashed with a pepper of fingerprint" in error.msg
    with override_settings(
        ROOT_URLCONF=__name__, MIDDLEWARE=MIDDLEWARE, APIKEYS=apikeys_settings(url)
    ):
        assert checks.check_store() == []
        assert Client().get("/api/v1/contacts", **bearer(key)).status_code == 200


@pytest.mark.sqlite
def test_the_sync_manager_checks_the_pepper_at_first_use(
    peppered_store: tuple[str, str],
) -> None:
    url, key = peppered_store
    manager = KeyManager(url, hasher=Hasher(pepper=OTHER_PEPPER))  # no `with`
    try:
        with pytest.raises(ConfigurationError, match="hashed with a pepper of fingerprint"):
            manager.verify(key)
    finally:
        manager.close()
    right = KeyManager(url, hasher=Hasher(pepper=TEST_PEPPER))
    try:
        assert right.verify(key).scopes == ("contacts:read",)
    finally:
        right.close()


def test_a_store_that_cannot_be_made_is_a_check_error(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    with override_settings(APIKEYS=apikeys_settings(url, STORE_OPTIONS={"no_such": 1})):
        (error,) = checks.check_store()
    assert error.id == "apikeys.E002"
    assert error.msg.startswith('APIKEYS["STORE_OPTIONS"]: ')
    assert "no_such" in error.msg
    integration.reset()


# -- rules and routes ----------------------------------------------------------------------------


def test_a_rule_in_django_s_syntax_is_refused_with_the_right_spelling() -> None:
    rules = {"GET /api/v1/notes/<int:pk>/": "notes:read", "GET /api/v1/contacts": "c:read"}
    with override_settings(ROOT_URLCONF=__name__, APIKEYS=apikeys_settings(SCOPES=rules)):
        (error,) = checks.check_store()
        assert error.id == "apikeys.E001"
        assert "'GET /api/v1/notes/{pk:int}/'" in error.msg
        with pytest.raises(ConfigurationError, match=r"'GET /api/v1/notes/\{pk:int\}/'"):
            get_manager()
    costs = {"POST /api/v1/notes/<pk>/": 5}
    with (
        override_settings(ROOT_URLCONF=__name__, APIKEYS=apikeys_settings(COSTS=costs)),
        pytest.raises(ConfigurationError, match=r"'POST /api/v1/notes/\{pk\}/'"),
    ):
        get_manager()
    integration.reset()


def test_rules_that_match_no_route_are_warned_about() -> None:
    rules = {
        "GET /api/v1/contacts": "contacts:read",  # matches
        "GET /api/v1/notes/{pk:int}/": "notes:read",  # matches
        "GET /api/v1/contacts/": "contacts:read",  # Django's route has no slash
        "GET /api/v1/notes/{pk:int}": "notes:read",  # Django's route has one
        "GET /api/v1/nothing/{id}": "contacts:read",  # nothing
        "* /api/{rest:path}": "api:any",  # everything under /api/: routes lie there
        "* /nowhere/{rest:path}": "api:any",  # no route under /nowhere/
    }
    with override_settings(ROOT_URLCONF=__name__, APIKEYS=apikeys_settings(SCOPES=rules)):
        warnings = checks.check_routes()
    assert sorted((warning.id, warning.msg, warning.hint) for warning in warnings) == [
        (
            "apikeys.W002",
            f"APIKEYS['SCOPES'] rule {rule!r} matches no route of the URLconf",
            checks.W002_HINT,
        )
        for rule in ["* /nowhere/{rest:path}", "GET /api/v1/nothing/{id}"]
    ] + [
        (
            "apikeys.W003",
            "APIKEYS['SCOPES'] rule 'GET /api/v1/contacts/' matches no route: "
            "Django's route has no trailing slash",
            "write it GET /api/v1/contacts",
        ),
        (
            "apikeys.W003",
            "APIKEYS['SCOPES'] rule 'GET /api/v1/notes/{pk:int}' matches no "
            "route: Django's route ends with a trailing slash",
            "write it GET /api/v1/notes/{pk:int}/",
        ),
    ]
    integration.reset()


def test_a_drf_view_s_required_scopes_are_its_route_s_rule(
    django_settings: dict[str, Any],
) -> None:
    manager = get_manager()
    reader = manager.create(name="r", scopes=["notes:read"])
    writer = manager.create(name="w", scopes=["notes:write"])
    client = APIClient()
    # No SCOPES rule covers /api/v1/notes/{pk}/, which is under PROTECT ("/api/").
    admitted = client.get("/api/v1/notes/7/", HTTP_AUTHORIZATION=f"Bearer {reader.key}")
    assert admitted.status_code == 200
    assert admitted.json() == {"note": 7, "key": reader.record.id}
    refused = client.get("/api/v1/notes/7/", HTTP_AUTHORIZATION=f"Bearer {writer.key}")
    assert refused.status_code == 403
    assert problem(refused)["required_scopes"] == ["notes:read"]
    written = client.post("/api/v1/notes/7/", HTTP_AUTHORIZATION=f"Bearer {writer.key}")
    assert written.status_code == 201
    # DRF's metadata (OPTIONS): the view requires no scope for it, so any key may ask.
    metadata = client.options("/api/v1/notes/7/", HTTP_AUTHORIZATION=f"Bearer {reader.key}")
    assert metadata.status_code == 200
    assert metadata.json()["name"] == "Drf Notes"
    # Still a key: without one, the middleware refuses.
    assert client.options("/api/v1/notes/7/").status_code == 401
    # Checked before credits are spent, charged once.
    manager.flush()
    assert manager.get(reader.record.id).request_count == 2


def test_a_drf_router_s_routes_take_their_view_s_required_scopes(
    django_settings: dict[str, Any],
) -> None:
    manager = get_manager()
    reader = manager.create(name="r", scopes=["tags:read"])
    other = manager.create(name="o", scopes=["notes:read"])
    client = APIClient()
    admitted = client.get("/api/v1/tags/red/", HTTP_AUTHORIZATION=f"Bearer {reader.key}")
    assert admitted.status_code == 200
    assert admitted.json() == {"tag": "red"}
    refused = client.get("/api/v1/tags/red/", HTTP_AUTHORIZATION=f"Bearer {other.key}")
    assert problem(refused)["required_scopes"] == ["tags:read"]


@pytest.mark.parametrize("where", ["/api/v1/reads", "/drf/reads"])
def test_drf_views_read_the_key_as_request_apikey(
    django_settings: dict[str, Any], where: str
) -> None:
    # Behind the middleware (/api/) or authenticated by APIKeyAuthentication alone.
    created = get_manager().create(name="k", scopes=["contacts:read"])
    answer = APIClient().get(where, HTTP_AUTHORIZATION=f"Bearer {created.key}")
    assert answer.json() == {
        "apikey": created.record.id,
        "user.record": created.record.id,
        "identity": None,
    }


def test_a_new_urlconf_keeps_the_store_and_its_keys(django_settings: dict[str, Any]) -> None:
    created = make_key(scopes=["contacts:read"])
    with override_settings(MIDDLEWARE=[*MIDDLEWARE], ROOT_URLCONF=__name__):
        answer = Client().get("/api/v1/contacts", **bearer(created.key))
    assert answer.status_code == 200


PREFLIGHT = {"HTTP_ORIGIN": "https://app.example", "HTTP_ACCESS_CONTROL_REQUEST_METHOD": "GET"}


def test_cors_preflights_pass_without_a_key_when_the_app_serves_cors(
    django_settings: dict[str, Any],
) -> None:
    # By default ("auto") only when django-cors-headers' middleware answers them.
    refused = Client().options("/api/v1/cors", **PREFLIGHT)
    assert refused.status_code == 401
    with override_settings(APIKEYS={**django_settings, "CORS_PREFLIGHT": True}):
        passed = Client().options("/api/v1/cors", **PREFLIGHT)
        assert passed.status_code == 200
        assert passed["Access-Control-Allow-Origin"] == "*"
        # An OPTIONS that is not a preflight still needs a key.
        assert Client().options("/api/v1/cors").status_code == 401
    # django-cors-headers answers the preflights of the paths its CORS_URLS_REGEX matches.
    with override_settings(MIDDLEWARE=["corsheaders.middleware.CorsMiddleware"]):
        paths = integration._preflight_paths(integration.apikeys_settings())
        assert paths is not None
        assert paths.match("/api/v1/cors")
        with override_settings(CORS_URLS_REGEX=r"^/api/v1/public/"):
            paths = integration._preflight_paths(integration.apikeys_settings())
            assert paths is not None
            assert not paths.match("/api/v1/cors")
    # ... and only when it comes right after ours: a middleware in between would run for a
    # request without a key (a method override, say).
    between = [*MIDDLEWARE, "tests.some.MethodOverride", "corsheaders.middleware.CorsMiddleware"]
    with override_settings(MIDDLEWARE=between):
        assert integration._preflight_paths(integration.apikeys_settings()) is None
    with override_settings(MIDDLEWARE=[*MIDDLEWARE, "corsheaders.middleware.CorsMiddleware"]):
        assert integration._preflight_paths(integration.apikeys_settings()) is not None
    with override_settings(APIKEYS={**django_settings, "CORS_PREFLIGHT": False}):
        assert integration._preflight_paths(integration.apikeys_settings()) is None
    with (
        override_settings(APIKEYS={**django_settings, "CORS_PREFLIGHT": "yes"}),
        pytest.raises(ConfigurationError, match="CORS_PREFLIGHT"),
    ):
        get_manager()
    integration.reset()


# -- tests of a Django project -------------------------------------------------------------------


@pytest.mark.sqlite
def test_make_key_and_the_management_command_use_the_settings_store(
    django_settings: dict[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    # On disk: the command line opens the store anew (a memory:// store is its own).
    with override_settings(APIKEYS=apikeys_settings(f"sqlite:///{tmp_path / 'keys.db'}")):
        make_key_and_the_management_command(capsys)


def make_key_and_the_management_command(capsys: pytest.CaptureFixture[str]) -> None:
    revoked = make_key(status="revoked", scopes=["contacts:read"])
    active = make_key(scopes=["contacts:read"], rate_limit="1000/second")
    client = Client()
    assert problem(client.get("/api/v1/contacts", **bearer(revoked.key)))["code"] == "key_revoked"
    for _ in range(150):  # past the default limit of 100/minute
        assert client.get("/api/v1/contacts", **bearer(active.key)).status_code == 200
    call_command(ApikeysCommand(), "list", "--json")
    listed = json.loads(capsys.readouterr().out)
    assert {row["id"] for row in listed} == {revoked.record.id, active.record.id}
    with pytest.raises(CommandError) as refused:
        call_command(ApikeysCommand(), "show", "3xK9pQ2mZ7aB")
    assert refused.value.returncode == 1


FORK_TEST = """
import os, sys
import django
from django.conf import settings
from django.http import JsonResponse
from django.urls import path

settings.configure(
    ROOT_URLCONF=__name__,
    ALLOWED_HOSTS=["testserver"],
    MIDDLEWARE=["apikeys.integrations.django.APIKeyMiddleware"],
    APIKEYS={"PROTECT": "/api/", "SCOPES": {"GET /api/v1/contacts": "contacts:read"}},
)
django.setup()
from django.test import Client
from apikeys.integrations.django import get_manager

urlpatterns = [path("api/v1/contacts", lambda request: JsonResponse({"id": request.apikey.id}))]

# A pre-forking server that loaded the app, and made the manager, before it forked.
created = get_manager().create(name="n", scopes=["contacts:read"])
child = os.fork()
if child == 0:
    answer = Client().get("/api/v1/contacts", headers={"Authorization": f"Bearer {created.key}"})
    sys.stdout.write(f"child {answer.status_code}\\n")
    sys.stdout.flush()
    os._exit(0)
_, status = os.waitpid(child, 0)
assert os.waitstatus_to_exitcode(status) == 0
print("parent", get_manager().verify(created.key).id == created.record.id)
"""


@pytest.mark.sqlite
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_process_forked_after_the_manager_was_made_makes_its_own(tmp_path: Any) -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith("APIKEYS_")}
    env.update(APIKEYS_PEPPER=TEST_PEPPER, APIKEYS_STORE_URL=f"sqlite:///{tmp_path / 'keys.db'}")
    result = subprocess.run(
        [sys.executable, "-c", FORK_TEST],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["child 200", "parent True"]
