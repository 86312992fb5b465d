"""APIKeyMiddleware over HTTP: every row of the contract's status table, headers, scopes."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any, Literal

import http_sf
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.authentication import requires
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from apikeys import (
    APIKeyMiddleware,
    KeyManager,
    MemoryStore,
    RateLimiter,
    ScopeTable,
    store_from_url,
)
from apikeys.errors import ConfigurationError, InvalidKeyParameters, StoreUnavailable
from apikeys.hashing import Hasher
from apikeys.keys import ParsedKey, generate_key, parse_key
from apikeys.middleware import bearer_token, header_token
from apikeys.types import StoredKey
from tests.conftest import delete_redis_keys, redis_prefix
from tests.test_manager import wrong_secret

SCOPES = {
    "GET /api/v1/contacts": "contacts:read",
    "POST /api/v1/contacts": "contacts:write",
    "GET /api/v1/contacts/{id}": "contacts:read",
    "POST /api/v1/campaigns/{id}/trigger": "campaigns:trigger",
}


async def whoami(request: Request) -> JSONResponse:
    record = request.scope["apikey"]
    return JSONResponse(
        {
            "id": record.id,
            "user": request.user.display_name,
            "authenticated": request.user.is_authenticated,
            "scopes": list(request.auth.scopes),
            "path_id": request.path_params.get("id"),
        }
    )


@requires("contacts:write")
async def guarded(request: Request) -> PlainTextResponse:
    return PlainTextResponse("written")


async def public(request: Request) -> PlainTextResponse:
    return PlainTextResponse("public")


async def echo_socket(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text(websocket.scope["apikey"].id)
    await websocket.close()


def build_app(manager: KeyManager, **options: Any) -> APIKeyMiddleware:
    inner = Starlette(
        routes=[
            Route("/api/v1/contacts", whoami, methods=["GET", "POST"]),
            Route("/api/v1/contacts/{id}", whoami),
            Route("/api/v1/campaigns/{id}/trigger", whoami, methods=["POST"]),
            Route("/api/v1/guarded", guarded, methods=["POST"]),
            Route("/health", public),
            WebSocketRoute("/api/v1/socket", echo_socket),
        ]
    )
    settings = {"scopes": SCOPES, "protect": "/api/", "rate_limit": "1000/minute", **options}
    return APIKeyMiddleware(inner, manager=manager, **settings)


@pytest.fixture
def app(memory_manager: KeyManager) -> APIKeyMiddleware:
    return build_app(memory_manager)


@pytest.fixture
async def client(app: APIKeyMiddleware) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        yield http


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    assert body["code"] == code
    assert {"type", "title", "detail"} <= set(body)
    if status == 401:
        challenge = response.headers["www-authenticate"]
        assert challenge.startswith('Bearer realm="api"')
    return body


class TestStatusTable:
    async def test_if_no_authorization_then_401_missing(self, client: httpx.AsyncClient) -> None:
        response = await client.get("/api/v1/contacts")
        assert_problem(response, 401, "missing_api_key")
        assert response.headers["www-authenticate"] == 'Bearer realm="api"'

    async def test_if_key_in_query_string_then_ignored(
        self, client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        response = await client.get("/api/v1/contacts", params={"api_key": created.key})
        assert_problem(response, 401, "missing_api_key")

    @pytest.mark.parametrize(
        "value",
        [
            "",
            "Bearer",
            "Bearer ",
            "Basic dXNlcjpwYXNz",
            "Token ak_x",
            "Bearer not-a-key",
            "Bearer  {key}",
            "Bearer\t{key}",
            "{key}",
            "Bearer {key} extra",
            "Bearer {key}x",
            "Bearer " + "a" * 5000,
        ],
    )
    async def test_if_header_malformed_then_401_malformed(
        self, client: httpx.AsyncClient, memory_manager: KeyManager, value: str
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        response = await client.get(
            "/api/v1/contacts", headers={"Authorization": value.format(key=created.key)}
        )
        body = assert_problem(response, 401, "malformed_api_key")
        assert 'error="invalid_token"' in response.headers["www-authenticate"]
        assert parse_key(created.key).secret not in json.dumps(body)

    @pytest.mark.parametrize("scheme", ["bearer", "BEARER", "bEaReR"])
    async def test_if_scheme_word_in_any_case_then_accepted(
        self, client: httpx.AsyncClient, memory_manager: KeyManager, scheme: str
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        response = await client.get(
            "/api/v1/contacts", headers={"Authorization": f"{scheme} {created.key}"}
        )
        assert response.status_code == 200

    async def test_if_two_authorization_headers_then_malformed(
        self, client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        headers = [("Authorization", f"Bearer {created.key}"), ("Authorization", "Bearer x")]
        response = await client.get("/api/v1/contacts", headers=headers)
        assert_problem(response, 401, "malformed_api_key")

    async def test_if_secret_wrong_then_401_invalid(
        self, client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        response = await client.get("/api/v1/contacts", headers=bearer(wrong_secret(created.key)))
        assert_problem(response, 401, "invalid_api_key")
        assert 'error="invalid_token"' in response.headers["www-authenticate"]

    async def test_if_id_unknown_then_401_invalid(self, client: httpx.AsyncClient) -> None:
        token = ParsedKey("ak", "A" * 12, "b" * 32).token
        response = await client.get("/api/v1/contacts", headers=bearer(token))
        assert_problem(response, 401, "invalid_api_key")

    @pytest.mark.parametrize(
        ("action", "code"), [("disable", "key_disabled"), ("revoke", "key_revoked")]
    )
    async def test_if_key_not_usable_then_401_with_its_state(
        self, client: httpx.AsyncClient, memory_manager: KeyManager, action: str, code: str
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        assert (await client.get("/api/v1/contacts", headers=bearer(created.key))).is_success
        await getattr(memory_manager, action)(created.record.id)
        response = await client.get("/api/v1/contacts", headers=bearer(created.key))
        assert_problem(response, 401, code)
        assert 'error="invalid_token"' in response.headers["www-authenticate"]

    async def test_if_key_expired_then_401_expired(
        self, client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        await memory_manager.roll(created.record.id, grace=timedelta(0))
        response = await client.get("/api/v1/contacts", headers=bearer(created.key))
        assert_problem(response, 401, "key_expired")

    async def test_if_scope_missing_then_403_listing_required_scopes(
        self, client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        response = await client.post("/api/v1/contacts", headers=bearer(created.key))
        body = assert_problem(response, 403, "insufficient_scope")
        assert body["required_scopes"] == ["contacts:write"]
        assert response.headers["www-authenticate"] == (
            'Bearer realm="api", error="insufficient_scope", scope="contacts:write"'
        )
        assert "ratelimit" in response.headers

    async def test_if_path_has_parameters_then_rule_still_applies(
        self, client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        reader = await memory_manager.create(name="r", workspace="w", scopes=["contacts:read"])
        response = await client.get("/api/v1/contacts/c_123", headers=bearer(reader.key))
        assert response.status_code == 200
        assert response.json()["path_id"] == "c_123"
        trigger = await client.post("/api/v1/campaigns/7/trigger", headers=bearer(reader.key))
        assert_problem(trigger, 403, "insufficient_scope")

    async def test_if_rate_limit_exhausted_then_429_with_retry_after_then_admitted(
        self, memory_manager: KeyManager
    ) -> None:
        app = build_app(memory_manager, rate_limit="2/second")
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            statuses = [
                (await http.get("/api/v1/contacts", headers=bearer(created.key))).status_code
                for _ in range(2)
            ]
            assert statuses == [200, 200]
            limited = await http.get("/api/v1/contacts", headers=bearer(created.key))
            body = assert_problem(limited, 429, "rate_limited")
            retry_after = int(limited.headers["retry-after"])
            assert retry_after >= 1
            assert body["retry_after"] == retry_after
            assert limited.headers["ratelimit"] == f'"default";r=0;t={retry_after}'
            await asyncio.sleep(retry_after + 0.05)
            again = await http.get("/api/v1/contacts", headers=bearer(created.key))
            assert again.status_code == 200

    async def test_if_key_has_own_rate_limit_then_it_overrides_default(
        self, client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(
            name="n", workspace="w", scopes=["contacts:read"], rate_limit="1/minute"
        )
        first = await client.get("/api/v1/contacts", headers=bearer(created.key))
        assert first.headers["ratelimit-policy"] == '"default";q=1;w=60'
        second = await client.get("/api/v1/contacts", headers=bearer(created.key))
        assert_problem(second, 429, "rate_limited")

    async def test_if_policy_named_then_both_headers_carry_the_name_without_quotes(
        self, memory_manager: KeyManager
    ) -> None:
        app = build_app(memory_manager, policy_name='contacts "api"', rate_limit="2/minute")
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            response = await http.get("/api/v1/contacts", headers=bearer(created.key))
        assert response.headers["ratelimit-policy"] == '"contacts api";q=2;w=60'
        assert response.headers["ratelimit"] == '"contacts api";r=1;t=60'

    async def test_if_store_unreachable_then_503_fail_closed(self) -> None:
        pytest.importorskip("redis")
        manager = KeyManager(store_from_url("redis://127.0.0.1:1/0"))
        transport = httpx.ASGITransport(app=build_app(manager))
        token = generate_key().token
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            response = await http.get("/api/v1/contacts", headers=bearer(token))
        assert_problem(response, 503, "auth_unavailable")
        assert response.headers["retry-after"] == "1"
        await manager.aclose()

    async def test_if_limiter_unreachable_then_503_fail_closed(
        self, memory_manager: KeyManager
    ) -> None:
        pytest.importorskip("redis")
        app = build_app(memory_manager, limiter_url="redis://127.0.0.1:1/0")
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            response = await http.get("/api/v1/contacts", headers=bearer(created.key))
        assert_problem(response, 503, "auth_unavailable")
        await app.limiter.aclose()


class TestAuthenticatedRequests:
    async def test_if_key_valid_then_app_sees_record_user_and_scopes(
        self, client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="Zapier", workspace="w", scopes=["contacts:*"])
        response = await client.get("/api/v1/contacts", headers=bearer(created.key))
        assert response.status_code == 200
        assert response.json() == {
            "id": created.record.id,
            "user": "Zapier",
            "authenticated": True,
            "scopes": ["contacts:*"],
            "path_id": None,
        }
        assert response.headers["ratelimit-policy"] == '"default";q=1000;w=60'
        assert response.headers["ratelimit"] == '"default";r=999;t=60'

    async def test_if_starlette_requires_then_wildcard_and_full_access_pass(
        self, memory_manager: KeyManager
    ) -> None:
        # The route has no rule: the app lets unmapped routes through and checks in code.
        app = build_app(memory_manager, unmapped="allow")
        wildcard = await memory_manager.create(name="w", workspace="w", scopes=["contacts:*"])
        full = await memory_manager.create(name="f", workspace="w", full_access=True)
        reader = await memory_manager.create(name="r", workspace="w", scopes=["contacts:read"])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for created in (wildcard, full):
                response = await client.post("/api/v1/guarded", headers=bearer(created.key))
                assert response.status_code == 200, response.text
            refused = await client.post("/api/v1/guarded", headers=bearer(reader.key))
        assert refused.status_code == 403

    async def test_if_full_access_then_every_scope_passes_even_new_ones(
        self, memory_manager: KeyManager
    ) -> None:
        full = await memory_manager.create(name="f", workspace="w", full_access=True)
        app = build_app(memory_manager, scopes={**SCOPES, "GET /api/v2/new": "brand:new"})
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            for method, path in [("POST", "/api/v1/contacts"), ("GET", "/api/v2/new")]:
                response = await http.request(method, path, headers=bearer(full.key))
                assert response.status_code != 403

    async def test_if_path_not_protected_then_no_key_needed(
        self, client: httpx.AsyncClient
    ) -> None:
        response = await client.get("/health")
        assert response.status_code == 200
        assert "ratelimit" not in response.headers

    async def test_if_revoked_then_very_next_request_is_401(
        self, client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        for _ in range(3):
            assert (await client.get("/api/v1/contacts", headers=bearer(created.key))).is_success
        await memory_manager.revoke(created.record.id)
        response = await client.get("/api/v1/contacts", headers=bearer(created.key))
        assert_problem(response, 401, "key_revoked")

    async def test_if_many_concurrent_requests_then_count_exact_including_403_and_429(
        self, memory_manager: KeyManager
    ) -> None:
        app = build_app(memory_manager, rate_limit="150/minute")
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            responses = await asyncio.gather(
                *(http.get("/api/v1/contacts", headers=bearer(created.key)) for _ in range(150)),
                *(http.post("/api/v1/contacts", headers=bearer(created.key)) for _ in range(50)),
            )
        statuses = [response.status_code for response in responses]
        assert statuses.count(200) + statuses.count(403) == 150
        assert statuses.count(429) == 50
        await memory_manager.flush()
        assert (await memory_manager.get(created.record.id)).request_count == 200


class TestLifespanAndWebSocket:
    def test_if_app_shuts_down_then_usage_is_flushed(self, hasher: Any) -> None:
        store = MemoryStore()
        manager = KeyManager(store, hasher=hasher, usage_flush_interval=3600)
        app = build_app(manager)
        with TestClient(app) as http:
            created = http.portal.call(
                lambda: manager.create(name="n", workspace="w", scopes=["contacts:read"])
            )
            for _ in range(5):
                assert http.get("/api/v1/contacts", headers=bearer(created.key)).is_success
            stored = http.portal.call(store.get, created.record.id)
            assert stored is not None
            assert stored.record.request_count == 0  # still buffered
        final = asyncio.run(store.get(created.record.id))
        assert final is not None
        assert final.record.request_count == 5
        asyncio.run(manager.aclose())

    def test_if_websocket_under_protect_then_key_required(self, hasher: Any) -> None:
        manager = KeyManager(MemoryStore(), hasher=hasher)
        app = build_app(manager)
        with TestClient(app) as http:
            created = http.portal.call(
                lambda: manager.create(name="n", workspace="w", full_access=True)
            )
            with http.websocket_connect("/api/v1/socket", headers=bearer(created.key)) as ws:
                assert ws.receive_text() == created.record.id
            with (
                pytest.raises(WebSocketDisconnect),
                http.websocket_connect("/api/v1/socket") as ws,
            ):
                ws.receive_text()
            http.portal.call(manager.aclose)


class CountingStore(MemoryStore):
    """A memory store that counts lookups, to prove garbage never reaches a store."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0

    async def get(self, key_id: str) -> StoredKey | None:
        self.gets += 1
        return await super().get(key_id)

    def get_for_verification_now(self, key_id: str) -> StoredKey | Literal[False] | None:
        self.gets += 1
        return super().get_for_verification_now(key_id)

    async def get_for_verification(self, key_id: str) -> StoredKey | None:
        self.gets += 1
        return await super().get_for_verification(key_id)


header_bytes = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda tail: b"Bearer " + tail, st.binary(max_size=120)),
    st.builds(
        lambda text: b"Bearer " + text.encode("utf-8", "surrogatepass"),
        st.text(max_size=80),
    ),
    st.builds(lambda text: text.encode(), st.from_regex(r"ak_[0-9A-Za-z_]{0,60}", fullmatch=True)),
)


class TestHostileHeaders:
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(value=header_bytes)
    def test_if_header_is_arbitrary_bytes_then_401_without_store_lookup(self, value: bytes) -> None:
        store = CountingStore()
        manager = KeyManager(store, hasher=_HASHER)
        app = build_app(manager)
        status, body = asyncio.run(_call(app, [(b"authorization", value)]))
        assert status == 401
        assert body["code"] in ("malformed_api_key", "missing_api_key")
        assert store.gets == 0

    @settings(max_examples=100, deadline=None)
    @given(data=st.data())
    def test_if_valid_key_damaged_anywhere_then_refused_never_500(self, data: Any) -> None:
        store = CountingStore()
        manager = KeyManager(store, hasher=_HASHER)
        app = build_app(manager)

        async def scenario() -> tuple[int, dict[str, Any]]:
            async with manager:
                created = await manager.create(name="n", workspace="w", full_access=True)
                key = created.key
                position = data.draw(st.integers(0, len(key) - 1))
                replacement = data.draw(
                    st.characters(codec="ascii").filter(lambda c: c != key[position])
                )
                damaged = key[:position] + replacement + key[position + 1 :]
                return await _call(app, [(b"authorization", b"Bearer " + damaged.encode())])

        status, body = asyncio.run(scenario())
        assert status == 401
        assert body["code"] == "malformed_api_key"


_HASHER = Hasher(pepper="1awuN_rKweVSoRxFr2EKGuIxfESTX_x8eXJses89j20")


async def _call(
    app: Callable[..., Any], headers: list[tuple[bytes, bytes]]
) -> tuple[int, dict[str, Any]]:
    return await _call_scope(app, {"path": "/api/v1/contacts", "headers": headers})


class TestMountedApps:
    async def test_if_mounted_under_a_prefix_then_protect_and_rules_still_apply(
        self, memory_manager: KeyManager
    ) -> None:
        inner = build_app(
            memory_manager, protect="/v1/", scopes={"POST /v1/contacts": "contacts:write"}
        )
        outer = Starlette(routes=[Mount("/api", app=inner)])
        reader = await memory_manager.create(name="r", workspace="w", scopes=["campaigns:read"])
        transport = httpx.ASGITransport(app=outer)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            anonymous = await http.get("/api/v1/contacts")
            refused = await http.post("/api/v1/contacts", headers=bearer(reader.key))
        assert_problem(anonymous, 401, "missing_api_key")
        assert_problem(refused, 403, "insufficient_scope")

    async def test_if_served_with_a_root_path_then_protect_still_applies(
        self, app: APIKeyMiddleware
    ) -> None:
        status, body = await _call_scope(
            app, {"path": "/svc/api/v1/contacts", "root_path": "/svc", "headers": []}
        )
        assert (status, body["code"]) == (401, "missing_api_key")

    async def test_if_root_path_is_only_a_lookalike_prefix_then_path_is_kept(
        self, app: APIKeyMiddleware
    ) -> None:
        status, body = await _call_scope(
            app, {"path": "/svcx/api/v1/contacts", "root_path": "/svc", "headers": []}
        )
        assert status == 404 or body.get("code") == "missing_api_key"


class TestShutdown:
    def test_if_app_does_not_speak_lifespan_then_usage_is_still_flushed(
        self, hasher: Hasher
    ) -> None:
        async def http_only(scope: Any, receive: Any, send: Any) -> None:
            assert scope["type"] == "http"
            await PlainTextResponse("ok")(scope, receive, send)

        store = MemoryStore()
        manager = KeyManager(store, hasher=hasher, usage_flush_interval=3600)
        app = APIKeyMiddleware(http_only, manager=manager, protect="/")
        with TestClient(app) as http:
            created = http.portal.call(
                lambda: manager.create(name="n", workspace="w", full_access=True)
            )
            for _ in range(3):
                assert http.get("/", headers=bearer(created.key)).status_code == 200
        stored = asyncio.run(store.get(created.record.id))
        assert stored is not None
        assert stored.record.request_count == 3
        asyncio.run(manager.aclose())

    async def test_if_usage_cannot_be_written_at_shutdown_then_the_counts_are_logged(
        self, hasher: Hasher, caplog: pytest.LogCaptureFixture
    ) -> None:
        with socket.socket() as probe:  # a loopback port where nothing listens
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        manager = KeyManager(
            store_from_url(f"redis://127.0.0.1:{port}/0"), hasher=hasher, usage_flush_interval=3600
        )

        async def lifespan_app(scope: Any, receive: Any, send: Any) -> None:
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})

        app = APIKeyMiddleware(lifespan_app, manager=manager, limiter_url="memory://")
        messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])

        async def receive() -> dict[str, Any]:
            return next(messages)

        async def send(message: dict[str, Any]) -> None:
            pass

        for key_id in ("k1", "k1", "k2"):
            manager.usage_buffer.record(key_id)
        with caplog.at_level("WARNING", logger="apikeys"):
            await app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
            with pytest.raises(StoreUnavailable):
                await manager.aclose()
        told = [r.getMessage() for r in caplog.records if "usage counts" in r.getMessage()]
        assert len(told) == 2  # at shutdown, and when the manager closes
        assert all("3 request(s) of 2 key(s)" in line for line in told)

    async def test_if_app_fails_its_own_startup_then_the_failure_is_not_hidden(
        self, hasher: Hasher
    ) -> None:
        async def failing(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            raise RuntimeError("no database")

        app = APIKeyMiddleware(failing, manager=KeyManager(MemoryStore(), hasher=hasher))
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "lifespan.startup"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        with pytest.raises(RuntimeError, match="no database"):
            await app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
        assert sent == []


async def _call_scope(app: Any, overrides: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "query_string": b"",
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
        **overrides,
    }
    scope["raw_path"] = scope["path"].encode()
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await app(scope, receive, send)
    body = messages[1].get("body", b"")
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = {}
    return messages[0]["status"], parsed


# -- the security review: method spellings, rule shapes, unmapped routes, whitespace -------

SECRETS_RULES = {
    "GET /api/secrets": "secrets:read",
    "GET /api/other": "other:read",
    "* /api/admin/{rest:path}": "admin:*",
}


def _rules_app(manager: KeyManager, rules: dict[str, Any], **options: Any) -> APIKeyMiddleware:
    async def ok(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    settings = {"scopes": rules, "protect": "/api/", "rate_limit": "100000/minute", **options}
    return APIKeyMiddleware(ok, manager=manager, **settings)


def _auth(key: str, value: str | None = None) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", (value if value is not None else f"Bearer {key}").encode())]


class TestSecurityReview:
    async def test_if_method_is_lower_case_then_it_needs_what_upper_case_needs(
        self, memory_manager: KeyManager
    ) -> None:
        # Finding 1: `get /api/secrets` (h11, hypercorn pass it through) skipped the rule.
        app = _rules_app(memory_manager, SECRETS_RULES)
        other = await memory_manager.create(name="o", workspace="w", scopes=["other:read"])
        for method in ("GET", "get", "Get", "gEt"):
            status, body = await _call_scope(
                app, {"method": method, "path": "/api/secrets", "headers": _auth(other.key)}
            )
            assert status == 403, method
            assert body["required_scopes"] == ["secrets:read"]

    @given(
        method=st.sampled_from(["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]),
        flips=st.lists(st.booleans(), min_size=7, max_size=7),
        path=st.sampled_from(["/api/secrets", "/api/other", "/api/admin/x/y", "/api/none"]),
    )
    def test_if_method_spelled_in_any_case_then_same_rule(
        self, method: str, flips: list[bool], path: str
    ) -> None:
        table = ScopeTable(SECRETS_RULES)
        spelled = "".join(c.lower() if flip else c for c, flip in zip(method, flips, strict=False))
        assert table.required(spelled, path) == table.required(method, path)

    @given(method=st.text(max_size=12))
    def test_if_method_is_anything_then_at_least_the_catch_all_rule_applies(
        self, method: str
    ) -> None:
        table = ScopeTable(SECRETS_RULES)
        # Whatever the method, the `*` rule covers it, and nothing weaker ever does.
        assert table.required(method, "/api/admin/keys") == ("admin:*",)

    @pytest.mark.parametrize(
        ("rule", "path", "expected"),
        [
            ("DELETE /api/invoices/{invoice_id:int}", "/api/invoices/42", True),
            ("DELETE /api/invoices/{invoice_id:int}", "/api/invoices/abc", False),
            ("GET /api/things/{id:uuid}", "/api/things/0b4e5a1c-1f2d-4c3b-9a8e-7d6c5b4a3f2e", True),
            ("GET /api/things/{id:uuid}", "/api/things/not-a-uuid", False),
            ("GET /api/things/{id:str}", "/api/things/abc", True),
            ("GET /api/prices/{value:float}", "/api/prices/1.5", True),
            ("GET /api/files/{rest:path}", "/api/files/a/b/c.txt", True),
            ("GET /api/v{version:int}/items", "/api/v2/items", True),
        ],
    )
    def test_if_rule_uses_a_starlette_converter_then_it_matches_as_the_route(
        self, rule: str, path: str, expected: bool
    ) -> None:
        # Finding 2: a converter made the rule a literal path that never matched.
        method = rule.split(" ", 1)[0]
        found = ScopeTable({rule: "things:read"}).required(method, path)
        assert (found == ("things:read",)) is expected

    @pytest.mark.parametrize(
        "rule",
        [
            "GET /api/x/{id:nope}",
            "GET /api/x/{id",
            "GET /api/x/id}",
            "GET /api/{rest:path}/more",
            "GET /api/x/{}",
        ],
    )
    def test_if_rule_cannot_be_understood_then_refused_when_built(self, rule: str) -> None:
        with pytest.raises(ConfigurationError):
            ScopeTable({rule: "x:read"})

    @pytest.mark.parametrize("scopes", [[], ()])
    def test_if_rule_names_no_scope_then_refused_when_built(self, scopes: Any) -> None:
        with pytest.raises(ConfigurationError, match="names no scope"):
            ScopeTable({"GET /api/x": scopes})

    def test_if_a_catch_all_comes_first_then_the_specific_rule_still_wins(self) -> None:
        rules = {
            "GET /api/v1/{rest:path}": "api:read",
            "GET /api/v1/admin/users/{user_id}": "admin:read",
            "* /api/v1/admin/{rest:path}": "admin:*",
        }
        table = ScopeTable(rules)
        assert table.required("GET", "/api/v1/admin/users/5") == ("admin:read",)
        assert table.required("GET", "/api/v1/admin/other") == ("admin:*",)
        assert table.required("GET", "/api/v1/contacts") == ("api:read",)

    @given(data=st.data())
    def test_if_rules_are_given_in_any_order_then_the_answers_are_the_same(self, data: Any) -> None:
        rules = [
            ("GET /api/v1/{rest:path}", "api:read"),
            ("* /api/v1/{rest:path}", "api:*"),
            ("GET /api/v1/admin/{rest:path}", "admin:read"),
            ("GET /api/v1/admin/users/{user_id}", "users:read"),
            ("GET /api/v1/admin/users/{user_id:int}", "users:int"),
            ("GET /api/v1/admin/users/me", "users:me"),
            ("GET /api/v1/{section}/users/{user_id}", "section:read"),
            ("DELETE /api/v1/admin/users/{user_id}", "users:delete"),
        ]
        shuffled = data.draw(st.permutations(rules))
        paths = [
            "/api/v1/admin/users/5",
            "/api/v1/admin/users/me",
            "/api/v1/admin/users/abc",
            "/api/v1/admin/x",
            "/api/v1/other/users/7",
            "/api/v1/z",
        ]
        reference, permuted = ScopeTable(dict(rules)), ScopeTable(dict(shuffled))
        for method in ("GET", "DELETE", "POST", "get"):
            for path in paths:
                assert permuted.required(method, path) == reference.required(method, path)
        assert reference.required("GET", "/api/v1/admin/users/5") == ("users:int",)
        assert reference.required("GET", "/api/v1/admin/users/me") == ("users:me",)
        assert reference.required("GET", "/api/v1/admin/users/abc") == ("users:read",)

    async def test_if_no_rule_covers_the_route_then_restricted_keys_get_403(
        self, memory_manager: KeyManager
    ) -> None:
        # Finding 3: a route added without a rule was open to every restricted key.
        app = _rules_app(memory_manager, SECRETS_RULES)
        restricted = await memory_manager.create(name="r", workspace="w", scopes=["other:read"])
        full = await memory_manager.create(name="f", workspace="w", full_access=True)
        scope = {"method": "GET", "path": "/api/unmapped"}
        status, body = await _call_scope(app, {**scope, "headers": _auth(restricted.key)})
        assert status == 403
        assert body["code"] == "insufficient_scope"
        assert body["required_scopes"] == []
        status, _ = await _call_scope(app, {**scope, "headers": _auth(full.key)})
        assert status == 200
        allowing = _rules_app(memory_manager, SECRETS_RULES, unmapped="allow")
        status, _ = await _call_scope(allowing, {**scope, "headers": _auth(restricted.key)})
        assert status == 200

    def test_if_unmapped_is_neither_deny_nor_allow_then_refused(
        self, memory_manager: KeyManager
    ) -> None:
        with pytest.raises(ConfigurationError, match="unmapped"):
            _rules_app(memory_manager, SECRETS_RULES, unmapped="open")

    @given(before=st.text(alphabet=" \t", max_size=3), after=st.text(alphabet=" \t", max_size=3))
    def test_if_header_has_surrounding_whitespace_then_it_means_the_same(
        self, before: str, after: str
    ) -> None:
        key = generate_key("ak").token
        assert bearer_token([f"{before}Bearer {key}{after}".encode()]) == key


async def test_if_a_path_is_public_then_it_needs_no_key_and_the_rest_still_does(
    memory_manager: KeyManager,
) -> None:
    app = _rules_app(memory_manager, SECRETS_RULES, public=["/api/openapi.json"])
    status, _ = await _call_scope(app, {"path": "/api/openapi.json", "headers": []})
    assert status == 200
    status, body = await _call_scope(app, {"path": "/api/openapi.jsonx", "headers": []})
    assert (status, body["code"]) == (401, "missing_api_key")
    with pytest.raises(ConfigurationError, match="public"):
        _rules_app(memory_manager, SECRETS_RULES, public="/api/openapi.json")


# -- header="X-API-Key": the bare key in one other header, for clients without Authorization --


@pytest.fixture
async def header_client(memory_manager: KeyManager) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(memory_manager, header="X-API-Key"))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        yield http


_PADDING = st.lists(
    st.sampled_from([b" ", b"\t", b"\r", b"\n", b"\x00", b"\x0b", b"\x0c", b"\xa0", b","]),
    max_size=3,
).map(b"".join)


class TestHeaderOption:
    async def test_if_key_in_the_named_header_then_admitted(
        self, header_client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        response = await header_client.get("/api/v1/contacts", headers={"X-API-Key": created.key})
        assert response.status_code == 200
        assert response.json()["id"] == created.record.id
        assert "ratelimit" in response.headers

    @pytest.mark.parametrize("name", ["x-api-key", "X-API-KEY", "X-Api-Key"])
    async def test_if_header_named_in_any_case_then_the_same_header(
        self, memory_manager: KeyManager, name: str
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        app = build_app(memory_manager, header=name)
        status, _ = await _call(app, [(b"x-api-key", created.key.encode())])
        assert status == 200

    @pytest.mark.parametrize("padding", [" ", "\t", " \t ", "\t\t"])
    async def test_if_value_padded_with_spaces_or_tabs_then_admitted(
        self, memory_manager: KeyManager, padding: str
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        app = build_app(memory_manager, header="X-API-Key")
        value = f"{padding}{created.key}{padding}".encode()
        status, _ = await _call(app, [(b"x-api-key", value)])
        assert status == 200

    async def test_if_only_authorization_sent_then_401_missing(
        self, header_client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        response = await header_client.get("/api/v1/contacts", headers=bearer(created.key))
        body = assert_problem(response, 401, "missing_api_key")
        assert response.headers["www-authenticate"] == 'Bearer realm="api"'
        assert "X-API-Key" in body["detail"]

    async def test_if_authorization_valid_but_named_header_bad_then_refused(
        self, header_client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        headers = {**bearer(created.key), "X-API-Key": "nope"}
        response = await header_client.get("/api/v1/contacts", headers=headers)
        assert_problem(response, 401, "malformed_api_key")

    async def test_if_default_mode_then_named_header_is_ignored(
        self, client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        response = await client.get("/api/v1/contacts", headers={"X-API-Key": created.key})
        body = assert_problem(response, 401, "missing_api_key")
        assert body["detail"] == "Send the API key in the Authorization header as 'Bearer <key>'."

    @pytest.mark.parametrize("name", ["authorization", "AUTHORIZATION", "Authorization"])
    async def test_if_header_is_authorization_in_any_case_then_bearer_mode(
        self, memory_manager: KeyManager, name: str
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        app = build_app(memory_manager, header=name)
        status, _ = await _call(app, _auth(created.key))
        assert status == 200
        status, body = await _call(app, [(b"authorization", created.key.encode())])
        assert (status, body["code"]) == (401, "malformed_api_key")
        status, body = await _call(app, [(b"x-api-key", created.key.encode())])
        assert (status, body["code"]) == (401, "missing_api_key")

    async def test_if_named_header_absent_then_401_missing_with_challenge(
        self, header_client: httpx.AsyncClient
    ) -> None:
        response = await header_client.get("/api/v1/contacts")
        body = assert_problem(response, 401, "missing_api_key")
        assert response.headers["www-authenticate"] == 'Bearer realm="api"'
        assert body["detail"] == "Send the API key in the X-API-Key header."

    @pytest.mark.parametrize(
        "value",
        [
            b"",
            b"   ",
            b"not-a-key",
            b"Bearer {key}",
            b"bearer {key}",
            b"{key}x",
            b"{key} extra",
            b"{key},{key}",
            b"\x00{key}",
            b"{key}\r",
            b"{key}\n",
            b"\xa0{key}",
            b"{key}\xc3\xa9",
            "\u00e9".encode() + b"{key}",
            b"a" * 5000,
            b"{key}" + b"a" * 300,
        ],
    )
    async def test_if_value_malformed_then_401_malformed(
        self, memory_manager: KeyManager, value: bytes
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        app = build_app(memory_manager, header="X-API-Key")
        raw = value.replace(b"{key}", created.key.encode())
        status, body = await _call(app, [(b"x-api-key", raw)])
        assert (status, body["code"]) == (401, "malformed_api_key")
        assert body["detail"] == "The X-API-Key header is not exactly one well-formed API key."
        assert parse_key(created.key).secret not in json.dumps(body)

    async def test_if_value_malformed_then_challenge_says_invalid_token(
        self, header_client: httpx.AsyncClient
    ) -> None:
        response = await header_client.get("/api/v1/contacts", headers={"X-API-Key": "nope"})
        assert_problem(response, 401, "malformed_api_key")
        assert response.headers["www-authenticate"] == 'Bearer realm="api", error="invalid_token"'

    async def test_if_two_named_headers_then_malformed_even_if_both_are_the_key(
        self, header_client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        for second in (created.key, "nope"):
            headers = [("X-API-Key", created.key), ("x-api-key", second)]
            response = await header_client.get("/api/v1/contacts", headers=headers)
            assert_problem(response, 401, "malformed_api_key")

    async def test_if_secret_wrong_then_401_invalid(
        self, header_client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        headers = {"X-API-Key": wrong_secret(created.key)}
        response = await header_client.get("/api/v1/contacts", headers=headers)
        assert_problem(response, 401, "invalid_api_key")
        assert 'error="invalid_token"' in response.headers["www-authenticate"]

    async def test_if_key_revoked_then_401_revoked(
        self, header_client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        await memory_manager.revoke(created.record.id)
        headers = {"X-API-Key": created.key}
        response = await header_client.get("/api/v1/contacts", headers=headers)
        assert_problem(response, 401, "key_revoked")

    async def test_if_scope_missing_then_403(
        self, header_client: httpx.AsyncClient, memory_manager: KeyManager
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        headers = {"X-API-Key": created.key}
        response = await header_client.post("/api/v1/contacts", headers=headers)
        body = assert_problem(response, 403, "insufficient_scope")
        assert body["required_scopes"] == ["contacts:write"]

    @pytest.mark.parametrize("param", ["api_key", "X-API-Key", "x-api-key", "key", "token"])
    async def test_if_key_in_query_string_then_never_read(
        self, header_client: httpx.AsyncClient, memory_manager: KeyManager, param: str
    ) -> None:
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        response = await header_client.get("/api/v1/contacts", params={param: created.key})
        assert_problem(response, 401, "missing_api_key")

    def test_if_websocket_then_the_named_header_is_read(self, hasher: Hasher) -> None:
        manager = KeyManager(MemoryStore(), hasher=hasher)
        app = build_app(manager, header="X-API-Key")
        with TestClient(app) as http:
            created = http.portal.call(
                lambda: manager.create(name="n", workspace="w", full_access=True)
            )
            headers = {"X-API-Key": created.key}
            with http.websocket_connect("/api/v1/socket", headers=headers) as ws:
                assert ws.receive_text() == created.record.id
            with (
                pytest.raises(WebSocketDisconnect),
                http.websocket_connect("/api/v1/socket", headers=bearer(created.key)) as ws,
            ):
                ws.receive_text()
            http.portal.call(manager.aclose)

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_if_header_is_arbitrary_bytes_then_admitted_only_for_the_padded_key(
        self, data: Any
    ) -> None:
        manager = KeyManager(MemoryStore(), hasher=_HASHER)
        app = build_app(manager, header="X-API-Key")

        async def scenario() -> tuple[bytes, bytes, tuple[int, dict[str, Any]]]:
            async with manager:
                created = await manager.create(name="n", workspace="w", full_access=True)
                key = created.key.encode()
                position = data.draw(st.integers(0, len(key) - 1))
                damaged = (
                    key[:position] + bytes([data.draw(st.integers(0, 255))]) + key[position + 1 :]
                )
                core = data.draw(
                    st.one_of(
                        st.just(key),
                        st.just(damaged),
                        st.binary(max_size=300),
                        st.just(b"Bearer " + key),
                        st.binary(max_size=20).map(lambda extra: key + extra),
                    )
                )
                value = data.draw(_PADDING) + core + data.draw(_PADDING)
                return key, value, await _call(app, [(b"x-api-key", value)])

        key, value, (status, body) = asyncio.run(scenario())
        assert status in (200, 401), (value, status)
        # Admitted exactly when the value is the key, give or take spaces and tabs around it.
        assert (status == 200) == (value.strip(b" \t") == key), value
        if status == 401:
            assert body["code"] in ("malformed_api_key", "invalid_api_key")

    @pytest.mark.parametrize(
        "header",
        [
            "",
            " ",
            "X API Key",
            "X-API-Key ",
            " X-API-Key",
            "X-API-Key:",
            ":authority",
            "X-API-Key\r\n",
            "X-API-Key\n",
            "x(api)key",
            "x/api",
            "x@api",
            "x=api",
            'x"api',
            "Schlüssel",
            "Authorization: Bearer",
        ],
    )
    def test_if_header_is_not_an_http_header_name_then_refused_when_built(
        self, memory_manager: KeyManager, header: str
    ) -> None:
        with pytest.raises(ConfigurationError, match="not an HTTP header name"):
            build_app(memory_manager, header=header)

    @pytest.mark.parametrize("header", [None, b"X-API-Key", 1])
    def test_if_header_is_not_a_string_then_refused_when_built(
        self, memory_manager: KeyManager, header: Any
    ) -> None:
        with pytest.raises(ConfigurationError, match="not an HTTP header name"):
            build_app(memory_manager, header=header)

    @pytest.mark.parametrize("header", ["X-API-Key", "x_api.key~1", "!#$%&'*+-.^_`|~", "Key"])
    def test_if_header_is_a_token_then_accepted(
        self, memory_manager: KeyManager, header: str
    ) -> None:
        assert build_app(memory_manager, header=header).header == header

    @given(before=st.text(alphabet=" \t", max_size=3), after=st.text(alphabet=" \t", max_size=3))
    def test_if_header_token_padded_then_it_means_the_same(self, before: str, after: str) -> None:
        key = generate_key("ak").token
        assert header_token([f"{before}{key}{after}".encode()]) == key


# -- several named rate limits per key ----------------------------------------------------


def sf_list(response: httpx.Response, name: str) -> list[tuple[str, dict[str, Any]]]:
    """A RateLimit header parsed as a structured-field list: (policy name, parameters)."""
    items = http_sf.parse(response.headers[name].encode("ascii"), tltype="list")
    parsed: list[tuple[str, dict[str, Any]]] = []
    for value, params in items:
        # The draft makes the policy name a String (quoted), never a Token.
        assert type(value) is str, value
        parsed.append((value, dict(params)))
    return parsed


def policies_of(response: httpx.Response) -> dict[str, tuple[int, int]]:
    """{name: (q, w)} from RateLimit-Policy."""
    items = sf_list(response, "ratelimit-policy")
    for name, params in items:
        assert set(params) == {"q", "w"}, name
    return {name: (params["q"], params["w"]) for name, params in items}


def state_of(response: httpx.Response) -> dict[str, tuple[int, int]]:
    """{name: (r, t)} from RateLimit."""
    items = sf_list(response, "ratelimit")
    for name, params in items:
        assert set(params) == {"r", "t"}, name
    return {name: (params["r"], params["t"]) for name, params in items}


def assert_retry_after_covers_violated(response: httpx.Response) -> list[str]:
    """Retry-After is the longest t of the violated policies (never earlier than any)."""
    body = assert_problem(response, 429, "rate_limited")
    violated = body["violated_policies"]
    assert violated
    state = state_of(response)
    retry_after = int(response.headers["retry-after"])
    assert retry_after == body["retry_after"]
    assert retry_after >= 1
    for name in violated:
        assert state[name][0] == 0, name
        assert retry_after >= state[name][1], name
    assert retry_after == max(state[name][1] for name in violated)
    return list(violated)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def limiter(request: pytest.FixtureRequest) -> AsyncIterator[RateLimiter]:
    """The middleware's limiter: in memory, or on Redis with a prefix of the test's own."""
    if request.param == "memory":
        yield RateLimiter("1000/minute")
        return
    url = request.getfixturevalue("redis_url")
    prefix = redis_prefix("mw-policies")
    shared = RateLimiter("1000/minute", url, key_prefix=prefix)
    try:
        yield shared
    finally:
        await shared.aclose()
        await delete_redis_keys(url, f"*{prefix}*")


class TestSeveralPolicies:
    async def test_if_key_has_several_policies_then_one_list_item_per_policy(
        self, memory_manager: KeyManager, limiter: RateLimiter
    ) -> None:
        app = build_app(memory_manager, limiter=limiter)
        created = await memory_manager.create(
            name="n",
            workspace="w",
            scopes=["contacts:read"],
            rate_limits={"burst": "10/second", "daily": "10000/day"},
        )
        assert created.record.rate_limit == "burst=10/second, daily=10000/day"
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            response = await http.get("/api/v1/contacts", headers=bearer(created.key))
        assert response.status_code == 200
        assert response.headers["ratelimit-policy"] == ('"burst";q=10;w=1, "daily";q=10000;w=86400')
        assert policies_of(response) == {"burst": (10, 1), "daily": (10000, 86400)}
        state = state_of(response)
        assert list(state) == ["burst", "daily"]
        assert state["burst"] == (9, 1)
        assert state["daily"][0] == 9999
        assert 86400 - 2 <= state["daily"][1] <= 86400 + 1
        assert response.headers["ratelimit"] == (
            f'"burst";r=9;t=1, "daily";r=9999;t={state["daily"][1]}'
        )

    async def test_if_one_policy_refuses_then_429_names_it_and_no_policy_is_charged(
        self, memory_manager: KeyManager, limiter: RateLimiter
    ) -> None:
        app = build_app(memory_manager, limiter=limiter)
        created = await memory_manager.create(
            name="n",
            workspace="w",
            scopes=["contacts:read"],
            rate_limit="burst=2/minute, daily=5/hour",
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            admitted = [
                await http.get("/api/v1/contacts", headers=bearer(created.key)) for _ in range(2)
            ]
            assert [response.status_code for response in admitted] == [200, 200]
            assert state_of(admitted[-1])["daily"][0] == 3
            for _ in range(3):
                limited = await http.get("/api/v1/contacts", headers=bearer(created.key))
                assert assert_retry_after_covers_violated(limited) == ["burst"]
                state = state_of(limited)
                # Refused by burst: neither burst nor daily was charged for it.
                assert (state["burst"][0], state["daily"][0]) == (0, 3)
                assert policies_of(limited) == {"burst": (2, 60), "daily": (5, 3600)}
                assert 1 <= int(limited.headers["retry-after"]) <= 61

    async def test_if_every_policy_refuses_then_all_named_and_retry_after_is_the_longest(
        self, memory_manager: KeyManager, limiter: RateLimiter
    ) -> None:
        app = build_app(memory_manager, limiter=limiter)
        created = await memory_manager.create(
            name="n",
            workspace="w",
            scopes=["contacts:read"],
            rate_limit="minute=1/minute; hour=1/hour",
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            assert (await http.get("/api/v1/contacts", headers=bearer(created.key))).is_success
            limited = await http.get("/api/v1/contacts", headers=bearer(created.key))
        assert assert_retry_after_covers_violated(limited) == ["minute", "hour"]
        assert int(limited.headers["retry-after"]) > 60

    async def test_if_a_short_policy_refuses_then_admitted_again_after_retry_after(
        self, memory_manager: KeyManager, limiter: RateLimiter
    ) -> None:
        app = build_app(memory_manager, limiter=limiter)
        created = await memory_manager.create(
            name="n",
            workspace="w",
            scopes=["contacts:read"],
            rate_limit="burst=1/second, day=9/day",
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            assert (await http.get("/api/v1/contacts", headers=bearer(created.key))).is_success
            limited = await http.get("/api/v1/contacts", headers=bearer(created.key))
            assert assert_retry_after_covers_violated(limited) == ["burst"]
            await asyncio.sleep(int(limited.headers["retry-after"]) + 0.05)
            again = await http.get("/api/v1/contacts", headers=bearer(created.key))
        assert again.status_code == 200
        assert state_of(again)["day"][0] == 7

    async def test_if_default_given_as_mapping_then_keys_without_own_limit_follow_it(
        self, memory_manager: KeyManager
    ) -> None:
        app = build_app(memory_manager, rate_limit={"burst": "5/second", "daily": "100/day"})
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        assert created.record.rate_limits == ()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            response = await http.get("/api/v1/contacts", headers=bearer(created.key))
        assert policies_of(response) == {"burst": (5, 1), "daily": (100, 86400)}

    async def test_if_a_policy_is_named_default_then_it_shows_as_the_policy_name(
        self, memory_manager: KeyManager
    ) -> None:
        app = build_app(
            memory_manager, rate_limit="default=1/minute, daily=100/day", policy_name="api"
        )
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            first = await http.get("/api/v1/contacts", headers=bearer(created.key))
            limited = await http.get("/api/v1/contacts", headers=bearer(created.key))
        assert list(policies_of(first)) == ["api", "daily"]
        assert assert_retry_after_covers_violated(limited) == ["api"]

    async def test_if_key_has_one_limit_then_it_answers_exactly_as_before(
        self, memory_manager: KeyManager, limiter: RateLimiter
    ) -> None:
        app = build_app(memory_manager, limiter=limiter)
        created = await memory_manager.create(
            name="n", workspace="w", scopes=["contacts:read"], rate_limit="100/minute"
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            response = await http.get("/api/v1/contacts", headers=bearer(created.key))
        assert response.headers["ratelimit-policy"] == '"default";q=100;w=60'
        assert response.headers["ratelimit"] == '"default";r=99;t=60'
        assert policies_of(response) == {"default": (100, 60)}
        assert state_of(response) == {"default": (99, 60)}

    async def test_if_key_has_one_named_limit_then_one_item_with_its_name(
        self, memory_manager: KeyManager, limiter: RateLimiter
    ) -> None:
        app = build_app(memory_manager, limiter=limiter)
        created = await memory_manager.create(
            name="n", workspace="w", scopes=["contacts:read"], rate_limits={"daily": "1/day"}
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            first = await http.get("/api/v1/contacts", headers=bearer(created.key))
            limited = await http.get("/api/v1/contacts", headers=bearer(created.key))
        assert first.headers["ratelimit-policy"] == '"daily";q=1;w=86400'
        assert state_of(first) == {"daily": (0, 86400)}
        assert assert_retry_after_covers_violated(limited) == ["daily"]

    async def test_if_one_limit_refuses_then_429_names_the_default_policy(
        self, memory_manager: KeyManager
    ) -> None:
        app = build_app(memory_manager, rate_limit="1/minute")
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            await http.get("/api/v1/contacts", headers=bearer(created.key))
            limited = await http.get("/api/v1/contacts", headers=bearer(created.key))
        assert assert_retry_after_covers_violated(limited) == ["default"]
        assert limited.headers["ratelimit"] == f'"default";r=0;t={limited.headers["retry-after"]}'

    async def test_if_the_key_limit_changes_to_several_then_the_next_request_uses_them(
        self, memory_manager: KeyManager
    ) -> None:
        app = build_app(memory_manager)
        created = await memory_manager.create(name="n", workspace="w", scopes=["contacts:read"])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            before = await http.get("/api/v1/contacts", headers=bearer(created.key))
            await memory_manager.update(
                created.record.id, rate_limits={"burst": "3/second", "daily": "9/day"}
            )
            after = await http.get("/api/v1/contacts", headers=bearer(created.key))
        assert policies_of(before) == {"default": (1000, 60)}
        assert policies_of(after) == {"burst": (3, 1), "daily": (9, 86400)}

    def test_if_default_policies_are_invalid_then_the_middleware_refuses_them(
        self, memory_manager: KeyManager
    ) -> None:
        with pytest.raises(InvalidKeyParameters, match="used twice"):
            build_app(memory_manager, rate_limit="burst=1/second, burst=2/day")
        with pytest.raises(InvalidKeyParameters):
            build_app(memory_manager, rate_limit={"Burst": "1/second"})

    def test_if_policy_name_has_characters_a_string_cannot_hold_then_they_are_dropped(
        self, memory_manager: KeyManager
    ) -> None:
        app = build_app(memory_manager, policy_name='a\\b"c\u00e9\nd')
        assert app.policy_name == "abcd"


@st.composite
def _policy_texts(draw: st.DrawFn) -> tuple[str, dict[str, tuple[int, int]]]:
    names = draw(
        st.lists(
            st.from_regex(r"[a-z][a-z0-9_-]{0,31}", fullmatch=True),
            min_size=1,
            max_size=8,
            unique=True,
        )
    )
    windows = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
    policies: dict[str, tuple[int, int]] = {}
    parts = []
    for name in names:
        amount = draw(st.integers(1, 6))
        unit = draw(st.sampled_from(sorted(windows)))
        per = draw(st.sampled_from(["/", " per "]))
        policies[name] = (amount, windows[unit])
        parts.append(f"{name}={amount}{per}{unit}")
    separator = draw(st.sampled_from([", ", ",", "; ", ";"]))
    return separator.join(parts), policies


@given(limits=_policy_texts(), requests=st.integers(1, 12))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_if_any_policies_then_headers_parse_and_429_matches_the_policies(
    limits: tuple[str, dict[str, tuple[int, int]]], requests: int
) -> None:
    text, policies = limits

    async def scenario() -> None:
        manager = KeyManager(
            MemoryStore(), hasher=Hasher(pepper="d3RUFPitx3acm32V3Z3cPgpcnIS1--w13730OSFh9I0")
        )
        try:
            app = build_app(manager, rate_limit="1000/minute")
            created = await manager.create(
                name="n", workspace="w", scopes=["contacts:read"], rate_limit=text
            )
            transport = httpx.ASGITransport(app=app)
            used = 0
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                for _ in range(requests):
                    response = await http.get("/api/v1/contacts", headers=bearer(created.key))
                    assert policies_of(response) == policies
                    assert list(state_of(response)) == list(policies)
                    full = [name for name, (amount, _) in policies.items() if used >= amount]
                    if full and all(window > 1 for _, window in policies.values()):
                        assert assert_retry_after_covers_violated(response) == full
                    elif response.status_code == 429:
                        assert_retry_after_covers_violated(response)
                    else:
                        assert response.status_code == 200
                        used += 1
                    for name, (remaining, reset) in state_of(response).items():
                        amount, window = policies[name]
                        assert 0 <= remaining <= amount
                        assert 1 <= reset <= window + 1
        finally:
            await manager.aclose()

    asyncio.run(scenario())


class TestChangedLimits:
    """A limit's counter is its window's: changing the amount keeps what the window used."""

    async def _get(self, http: httpx.AsyncClient, key: str) -> httpx.Response:
        return await http.get("/api/v1/contacts", headers=bearer(key))

    async def test_if_limit_narrowed_then_what_its_window_used_counts(
        self, memory_manager: KeyManager, limiter: RateLimiter
    ) -> None:
        app = build_app(memory_manager, limiter=limiter)
        created = await memory_manager.create(
            name="n", workspace="w", scopes=["contacts:read"], rate_limit="10/minute"
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            for _ in range(10):
                assert (await self._get(http, created.key)).status_code == 200
            await memory_manager.update(created.record.id, rate_limit="5/minute")
            refused = await self._get(http, created.key)
            assert refused.status_code == 429
            assert refused.json()["code"] == "rate_limited"
            # Widened, the same window's 10 still count: 2 more of 12, then 429.
            await memory_manager.update(created.record.id, rate_limit="12/minute")
            statuses = [(await self._get(http, created.key)).status_code for _ in range(3)]
        assert statuses == [200, 200, 429]

    async def test_if_one_policy_narrowed_then_it_refuses_in_the_same_window(
        self, memory_manager: KeyManager, limiter: RateLimiter
    ) -> None:
        app = build_app(memory_manager, limiter=limiter)
        created = await memory_manager.create(
            name="n",
            workspace="w",
            scopes=["contacts:read"],
            rate_limits={"burst": "10/minute", "daily": "1000/day"},
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            for _ in range(10):
                assert (await self._get(http, created.key)).status_code == 200
            await memory_manager.update(
                created.record.id, rate_limits={"burst": "5/minute", "daily": "1000/day"}
            )
            refused = await self._get(http, created.key)
        assert refused.status_code == 429
        assert refused.json()["violated_policies"] == ["burst"]
        assert state_of(refused)["daily"][0] == 990


@pytest.mark.redis
async def test_if_limit_narrowed_then_units_leased_under_the_wider_one_are_not_spent(
    redis_url: str,
) -> None:
    prefix = redis_prefix("narrowed")
    limiter = RateLimiter("1000/minute", redis_url, key_prefix=prefix)
    try:
        first = await limiter.hit("k")  # leases a slice of 1000, spends one unit of it
        assert first.allowed
        assert not (await limiter.hit("k", "5/minute")).allowed
        decision = await limiter.hit_policies("k", "burst=1000/minute, daily=5000/day")
        assert decision.allowed
        narrowed = await limiter.hit_policies("k", "burst=5/minute, daily=5000/day")
        assert not narrowed.allowed
        assert narrowed.violated == ("burst",)
    finally:
        await limiter.aclose()
        await delete_redis_keys(redis_url, f"*{prefix}*")
