"""assert_problem against the real middleware: every code of the contract, and its failures."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from apikeys import APIKeyMiddleware, KeyManager, MemoryStore
from apikeys.errors import AuthUnavailable, MalformedAPIKey, RateLimited
from apikeys.keys import ParsedKey, parse_key
from apikeys.problems import encode_problem
from apikeys.testing import CONTRACT_STATUS, AssertProblem, KeyFactory, assert_problem
from apikeys.types import StoredKey


async def contacts(request: Request) -> PlainTextResponse:
    return PlainTextResponse("contacts")


def build_app(manager: KeyManager) -> APIKeyMiddleware:
    return APIKeyMiddleware(
        Starlette(routes=[Route("/api/contacts", contacts, methods=["GET", "POST"])]),
        manager=manager,
        scopes={"POST /api/contacts": "contacts:write"},
        protect="/api/",
        rate_limit="1000/minute",
    )


class DownStore(MemoryStore):
    def get_for_verification_now(self, key_id: str) -> StoredKey | None:
        raise ConnectionError("the store is down")


@pytest.fixture
async def client(apikeys_manager: KeyManager) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(apikeys_manager))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        yield http


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class TestEveryCodeOfTheContract:
    async def test_missing(self, client: httpx.AsyncClient) -> None:
        body = assert_problem(await client.get("/api/contacts"), "missing_api_key")
        assert body["status"] == 401

    async def test_malformed(self, client: httpx.AsyncClient) -> None:
        response = await client.get("/api/contacts", headers=bearer("nope"))
        assert_problem(response, "malformed_api_key")

    async def test_invalid(self, client: httpx.AsyncClient, make_key: KeyFactory) -> None:
        parsed = parse_key((await make_key()).key)
        wrong = ParsedKey(parsed.prefix, parsed.id, "A" * 32).token
        assert_problem(await client.get("/api/contacts", headers=bearer(wrong)), "invalid_api_key")

    @pytest.mark.parametrize(
        ("status", "code"),
        [("disabled", "key_disabled"), ("revoked", "key_revoked"), ("expired", "key_expired")],
    )
    async def test_unusable_keys(
        self, client: httpx.AsyncClient, make_key: KeyFactory, status: Any, code: str
    ) -> None:
        created = await make_key(status=status)
        assert created.record.status == status
        assert_problem(await client.get("/api/contacts", headers=bearer(created.key)), code)

    async def test_insufficient_scope(
        self, client: httpx.AsyncClient, make_key: KeyFactory, assert_problem: AssertProblem
    ) -> None:
        created = await make_key(scopes=["contacts:read"])
        response = await client.post("/api/contacts", headers=bearer(created.key))
        body = assert_problem(response, "insufficient_scope")
        assert body["required_scopes"] == ["contacts:write"]

    async def test_rate_limited(self, client: httpx.AsyncClient, make_key: KeyFactory) -> None:
        created = await make_key(rate_limit="1/minute")
        assert (await client.get("/api/contacts", headers=bearer(created.key))).status_code == 200
        response = await client.get("/api/contacts", headers=bearer(created.key))
        assert_problem(response, "rate_limited")

    async def test_auth_unavailable(self, make_key: KeyFactory) -> None:
        created = await make_key()
        async with KeyManager(DownStore()) as manager:
            transport = httpx.ASGITransport(app=build_app(manager))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                response = await http.get("/api/contacts", headers=bearer(created.key))
        assert_problem(response, "auth_unavailable")

    def test_with_starlette_test_client(
        self, apikeys_manager: KeyManager, make_key: KeyFactory
    ) -> None:
        created = make_key.sync(status="revoked")
        with TestClient(build_app(apikeys_manager)) as client:
            response = client.get("/api/contacts", headers=bearer(created.key))
        assert_problem(response, "key_revoked")

    def test_the_table_is_the_errors_table(self) -> None:
        from apikeys import errors

        classes = [
            cls
            for cls in vars(errors).values()
            if isinstance(cls, type)
            and issubclass(cls, errors.AuthenticationError)
            and "code" in vars(cls)
        ]
        assert {cls.code: cls.status for cls in classes} == dict(CONTRACT_STATUS)


class FakeResponse:
    """A response with plain-dict headers (case as sent), like a hand-made one."""

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code = status_code
        self.headers = headers
        self.content = content


def problem(exc: Any) -> FakeResponse:
    headers, body = encode_problem(exc)
    return FakeResponse(
        exc.status, {name.decode().title(): value.decode() for name, value in headers}, body
    )


def fails(response: Any, code: str, *expected: str, status: int | None = None) -> str:
    with pytest.raises(AssertionError) as info:
        assert_problem(response, code, status)
    for text in expected:
        assert text in str(info.value)
    return str(info.value)


class TestFailures:
    def test_plain_dict_headers_in_any_case_pass(self) -> None:
        assert_problem(problem(MalformedAPIKey()), "malformed_api_key")
        assert_problem(problem(RateLimited(3)), "rate_limited")
        assert_problem(problem(AuthUnavailable()), "auth_unavailable")

    def test_wrong_status(self) -> None:
        fails(problem(MalformedAPIKey()), "rate_limited", "status is 401, expected 429")

    def test_wrong_content_type_and_not_json(self) -> None:
        response = Response("oops", status_code=401, media_type="text/plain")
        response.headers["www-authenticate"] = 'Bearer realm="api"'
        fake = FakeResponse(401, dict(response.headers), bytes(response.body))
        fails(fake, "missing_api_key", "Content-Type is 'text/plain", "not JSON")

    def test_missing_fields_and_challenge(self) -> None:
        response = JSONResponse({"code": "invalid_api_key"}, status_code=401)
        fake = FakeResponse(401, {"content-type": "application/problem+json"}, bytes(response.body))
        message = fails(fake, "invalid_api_key", "'type'", "'title'", "'detail'", "body status")
        assert "no WWW-Authenticate header" in message

    def test_challenge_must_name_the_error(self) -> None:
        response = problem(MalformedAPIKey())
        response.headers["Www-Authenticate"] = 'Bearer realm="api"'
        fails(response, "malformed_api_key", 'lacks error="invalid_token"')

    def test_retry_after_must_be_whole_seconds(self) -> None:
        response = problem(RateLimited(3))
        response.headers["Retry-After"] = "1.5"
        fails(response, "rate_limited", "Retry-After is '1.5'")
        del response.headers["Retry-After"]
        fails(response, "rate_limited", "Retry-After is None")

    def test_stack_trace_and_secrets_are_masked(self) -> None:
        secret = "Vd2hR8sLk4NwQ1e9TfYb6GcJ0uMiPzXa"
        body = b'{"detail": "Traceback (most recent call last): ' + secret.encode() + b'"}'
        fake = FakeResponse(500, {"content-type": "application/problem+json"}, body)
        message = fails(fake, "auth_unavailable", "stack trace", "status is 500")
        assert secret not in message
        assert "Vd2h…" in message

    def test_code_of_your_own_needs_a_status(self) -> None:
        with pytest.raises(ValueError, match="pass its status"):
            assert_problem(problem(MalformedAPIKey()), "not_found")
        with pytest.raises(ValueError, match="answers 'rate_limited' with 429"):
            assert_problem(problem(MalformedAPIKey()), "rate_limited", 401)

    def test_code_of_your_own_with_a_status(self) -> None:
        body = (
            b'{"type":"urn:x:not_found","title":"Not found","status":404,'
            b'"detail":"No such contact.","code":"not_found"}'
        )
        fake = FakeResponse(404, {"Content-Type": "application/problem+json"}, body)
        assert assert_problem(fake, "not_found", 404)["code"] == "not_found"


def test_the_fixture_is_the_function(assert_problem: Callable[..., Any]) -> None:
    from apikeys.testing import assert_problem as function

    assert assert_problem is function
