"""The middleware and a key's policies, on every store: IP allowlists behind trusted proxies,
credits, metadata and owner (CONTRACT §8)."""

from __future__ import annotations

import ipaddress
from datetime import UTC, datetime, timedelta
from typing import Any

import http_sf
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from apikeys import APIKeyMiddleware, KeyManager
from apikeys.policies import Refill
from tests.test_middleware import assert_problem, bearer

SCOPES = {"GET /api/items": "items:read", "POST /api/items": "items:write"}


async def items(request: Request) -> JSONResponse:
    record = request.scope["apikey"]
    return JSONResponse({"owner": record.owner, "metadata": dict(record.metadata)})


def make_app(manager: KeyManager, **options: Any) -> APIKeyMiddleware:
    inner = Starlette(routes=[Route("/api/items", items, methods=["GET", "POST"])])
    settings = {"scopes": SCOPES, "protect": "/api/", "rate_limit": "100/minute", **options}
    return APIKeyMiddleware(inner, manager=manager, **settings)


def client_for(app: APIKeyMiddleware, address: str = "127.0.0.1") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(address, 50000))
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


def ratelimit(response: httpx.Response) -> dict[str, dict[str, Any]]:
    """The RateLimit header, parsed as a structured-field list: {policy: params}."""
    items = http_sf.parse(response.headers["ratelimit"].encode(), tltype="list")
    return {name: dict(params) for name, params in items}


@pytest.fixture
def app(manager: KeyManager) -> APIKeyMiddleware:
    return make_app(manager)


class TestAllowlist:
    async def test_inside_the_list_passes_outside_is_403_and_charged_nothing(
        self, manager: KeyManager, app: APIKeyMiddleware
    ) -> None:
        created = await manager.create(
            name="n", scopes=["items:read"], allowed_ips=["10.0.0.0/8", "2001:db8::/32"]
        )
        async with client_for(app, "10.1.2.3") as inside:
            first = await inside.get("/api/items", headers=bearer(created.key))
        assert first.status_code == 200
        remaining = ratelimit(first)["default"]["r"]
        for outside_address in ("192.0.2.1", "2001:db9::1", "127.0.0.1"):
            async with client_for(app, outside_address) as outside:
                refused = await outside.get("/api/items", headers=bearer(created.key))
            body = assert_problem(refused, 403, "ip_not_allowed")
            assert created.key not in str(body)
            assert "ratelimit" not in refused.headers
        async with client_for(app, "2001:db8::7") as inside_v6:
            again = await inside_v6.get("/api/items", headers=bearer(created.key))
        assert again.status_code == 200
        assert ratelimit(again)["default"]["r"] == remaining - 1  # the refusals cost nothing
        await manager.flush()
        assert (await manager.get(created.record.id)).request_count == 5  # each one counted

    async def test_a_key_without_a_list_passes_from_anywhere(
        self, manager: KeyManager, app: APIKeyMiddleware
    ) -> None:
        created = await manager.create(name="n", scopes=["items:read"])
        async with client_for(app, "203.0.113.9") as anywhere:
            assert (
                await anywhere.get("/api/items", headers=bearer(created.key))
            ).status_code == 200

    async def test_behind_a_trusted_proxy_the_address_it_wrote_decides(
        self, manager: KeyManager
    ) -> None:
        app = make_app(manager, trusted_proxies=1)
        created = await manager.create(name="n", scopes=["items:read"], allowed_ips=["10.0.0.0/8"])
        async with client_for(app, "127.0.0.1") as proxy:
            ok = await proxy.get(
                "/api/items", headers={**bearer(created.key), "X-Forwarded-For": "10.9.9.9"}
            )
            assert ok.status_code == 200
            # The client forged the left part; the proxy appended the real address.
            forged = await proxy.get(
                "/api/items",
                headers={**bearer(created.key), "X-Forwarded-For": "10.0.0.1, 198.51.100.4"},
            )
            assert_problem(forged, 403, "ip_not_allowed")
            # No header at all behind a proxy: no address, refused.
            missing = await proxy.get("/api/items", headers=bearer(created.key))
            assert_problem(missing, 403, "ip_not_allowed")

    async def test_without_trusted_proxies_the_header_is_never_read(
        self, manager: KeyManager, app: APIKeyMiddleware
    ) -> None:
        created = await manager.create(name="n", scopes=["items:read"], allowed_ips=["10.0.0.0/8"])
        async with client_for(app, "198.51.100.4") as direct:
            refused = await direct.get(
                "/api/items", headers={**bearer(created.key), "X-Forwarded-For": "10.0.0.1"}
            )
        assert_problem(refused, 403, "ip_not_allowed")

    # Refused while the middleware is built, before any store is asked: memory stands for all.
    @pytest.mark.parametrize("bad", [-1, True, "1", 1.5])
    def test_trusted_proxies_must_be_a_whole_number(
        self, memory_manager: KeyManager, bad: Any
    ) -> None:
        from apikeys import ConfigurationError

        with pytest.raises(ConfigurationError):
            make_app(memory_manager, trusted_proxies=bad)


class TestCredits:
    async def test_credits_count_down_in_the_headers_then_429_with_the_limits_given_back(
        self, manager: KeyManager, app: APIKeyMiddleware
    ) -> None:
        created = await manager.create(name="n", scopes=["items:read"], credits=2)
        async with client_for(app) as http:
            answers = [await http.get("/api/items", headers=bearer(created.key)) for _ in range(2)]
            assert [a.status_code for a in answers] == [200, 200]
            assert [ratelimit(a)["credits"] for a in answers] == [{"r": 1}, {"r": 0}]
            assert [ratelimit(a)["default"]["r"] for a in answers] == [99, 98]
            refused = await http.get("/api/items", headers=bearer(created.key))
            body = assert_problem(refused, 429, "credits_exhausted")
            assert "retry-after" not in refused.headers
            assert "retry_after" not in body
            # Topped up: the refused request cost no rate-limit unit.
            await manager.update(created.record.id, credits=1)
            again = await http.get("/api/items", headers=bearer(created.key))
        assert again.status_code == 200
        assert ratelimit(again)["default"]["r"] == 97

    async def test_a_refill_gives_retry_after_up_to_the_next_period(
        self, manager: KeyManager, app: APIKeyMiddleware
    ) -> None:
        created = await manager.create(name="n", scopes=["items:read"], credit_refill="1/day")
        async with client_for(app) as http:
            admitted = await http.get("/api/items", headers=bearer(created.key))
            refused = await http.get("/api/items", headers=bearer(created.key))
        now = datetime.now(UTC)
        to_midnight = (Refill(1, "day").next_start(now) - now).total_seconds()
        assert admitted.status_code == 200
        assert ratelimit(admitted)["credits"]["r"] == 0
        assert abs(ratelimit(admitted)["credits"]["t"] - to_midnight) <= 2
        policy = http_sf.parse(admitted.headers["ratelimit-policy"].encode(), tltype="list")
        assert ("credits", {"q": 1, "w": 86400}) in [(n, dict(p)) for n, p in policy]
        body = assert_problem(refused, 429, "credits_exhausted")
        assert abs(int(refused.headers["retry-after"]) - to_midnight) <= 2
        assert body["retry_after"] == int(refused.headers["retry-after"])

    async def test_a_rolled_pair_spends_one_balance_then_both_are_refused(
        self, manager: KeyManager, app: APIKeyMiddleware
    ) -> None:
        old = await manager.create(name="n", scopes=["items:read"], credits=5)
        async with client_for(app) as http:
            for _ in range(2):
                assert (await http.get("/api/items", headers=bearer(old.key))).status_code == 200
            new = await manager.roll(old.record.id, grace=timedelta(hours=24))
            answers = [
                await http.get("/api/items", headers=bearer(token))
                for token in (old.key, new.key) * 3
            ]
        admitted = [answer for answer in answers if answer.status_code == 200]
        # 3 left when rolled, for the pair: not 3 for each.
        assert [ratelimit(a)["credits"] for a in admitted] == [{"r": 2}, {"r": 1}, {"r": 0}]
        for refused in answers[3:]:
            assert_problem(refused, 429, "credits_exhausted")
        assert (await manager.get(old.record.id)).credits == 0
        assert (await manager.get(new.record.id)).credits == 0

    async def test_a_request_refused_for_its_scope_spends_no_credit(
        self, manager: KeyManager, app: APIKeyMiddleware
    ) -> None:
        created = await manager.create(name="n", scopes=["items:read"], credits=5)
        async with client_for(app) as http:
            refused = await http.post("/api/items", headers=bearer(created.key))
        assert_problem(refused, 403, "insufficient_scope")
        assert (await manager.get(created.record.id)).credits == 5

    async def test_a_key_without_credits_has_no_credits_item(
        self, manager: KeyManager, app: APIKeyMiddleware
    ) -> None:
        created = await manager.create(name="n", scopes=["items:read"])
        async with client_for(app) as http:
            response = await http.get("/api/items", headers=bearer(created.key))
        assert set(ratelimit(response)) == {"default"}


async def test_the_app_reads_owner_and_metadata_from_the_record(
    manager: KeyManager, app: APIKeyMiddleware
) -> None:
    created = await manager.create(
        name="n", scopes=["items:read"], owner="user_42", metadata={"plan": "pro"}
    )
    async with client_for(app) as http:
        response = await http.get("/api/items", headers=bearer(created.key))
    assert response.json() == {"owner": "user_42", "metadata": {"plan": "pro"}}


addresses = st.ip_addresses().map(str)


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    forged=st.lists(
        addresses | st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20),
        max_size=5,
    ),
    real=addresses,
)
async def test_a_forged_forwarded_chain_never_changes_the_verdict(
    memory_manager: KeyManager, forged: list[str], real: str
) -> None:
    app = make_app(memory_manager, trusted_proxies=1)
    created = await memory_manager.create(
        name="n", scopes=["items:read"], allowed_ips=["10.0.0.0/8", "2001:db8::/32"]
    )
    expected = any(
        ipaddress.ip_address(real) in ipaddress.ip_network(net)
        for net in ("10.0.0.0/8", "2001:db8::/32")
        if ipaddress.ip_address(real).version == ipaddress.ip_network(net).version
    )
    chain = ", ".join([*[item.replace(",", "") for item in forged], real])
    async with client_for(app) as proxy:
        response = await proxy.get(
            "/api/items", headers={**bearer(created.key), "X-Forwarded-For": chain}
        )
    assert response.status_code == (200 if expected else 403), (chain, response.text)


async def test_a_route_can_cost_several_credits(manager: KeyManager) -> None:
    app = make_app(manager, costs={"POST /api/items": 3})
    created = await manager.create(name="n", scopes=["items:read", "items:write"], credits=4)
    async with client_for(app) as http:
        expensive = await http.post("/api/items", headers=bearer(created.key))
        assert expensive.status_code == 200
        assert ratelimit(expensive)["credits"]["r"] == 1
        refused = await http.post("/api/items", headers=bearer(created.key))
        assert_problem(refused, 429, "credits_exhausted")
        cheap = await http.get("/api/items", headers=bearer(created.key))  # no rule: 1
        assert cheap.status_code == 200
        assert ratelimit(cheap)["credits"]["r"] == 0


# Refused while the middleware is built, before any store is asked: memory stands for all.
@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "3"])
def test_a_cost_is_a_whole_number_of_credits(memory_manager: KeyManager, bad: Any) -> None:
    from apikeys import ConfigurationError

    with pytest.raises(ConfigurationError, match="whole number of credits"):
        make_app(memory_manager, costs={"POST /api/items": bad})
