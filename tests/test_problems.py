"""Problem responses (CONTRACT §4): RFC 9457 bodies, RFC 6750 challenges, Retry-After."""

from __future__ import annotations

import json
from typing import Any

import pytest

from apikeys.errors import (
    AuthenticationError,
    AuthUnavailable,
    ForbiddenField,
    InsufficientScope,
    InvalidAPIKey,
    KeyDisabled,
    KeyExpired,
    KeyRevoked,
    LimiterUnavailable,
    MalformedAPIKey,
    MissingAPIKey,
    RateLimited,
    StoreUnavailable,
)
from apikeys.problems import PROBLEM_CONTENT_TYPE, send_problem

BASE_FIELDS = {"type", "title", "status", "detail", "code"}
INVALID_TOKEN = 'Bearer realm="api", error="invalid_token"'

# (error, status, code, WWW-Authenticate or None, Retry-After or None, extra body fields)
TABLE = [
    pytest.param(
        MissingAPIKey(), 401, "missing_api_key", 'Bearer realm="api"', None, {}, id="missing"
    ),
    pytest.param(
        MalformedAPIKey(), 401, "malformed_api_key", INVALID_TOKEN, None, {}, id="malformed"
    ),
    pytest.param(InvalidAPIKey(), 401, "invalid_api_key", INVALID_TOKEN, None, {}, id="invalid"),
    pytest.param(KeyDisabled(), 401, "key_disabled", INVALID_TOKEN, None, {}, id="disabled"),
    pytest.param(KeyRevoked(), 401, "key_revoked", INVALID_TOKEN, None, {}, id="revoked"),
    pytest.param(KeyExpired(), 401, "key_expired", INVALID_TOKEN, None, {}, id="expired"),
    pytest.param(
        InsufficientScope(["contacts:read"]),
        403,
        "insufficient_scope",
        'Bearer realm="api", error="insufficient_scope", scope="contacts:read"',
        None,
        {"required_scopes": ["contacts:read"]},
        id="insufficient-scope",
    ),
    pytest.param(
        RateLimited(7),
        429,
        "rate_limited",
        None,
        "7",
        {"retry_after": 7, "violated_policies": ["default"]},
        id="rate-limited",
    ),
    pytest.param(
        RateLimited(40210, ["burst", "daily"]),
        429,
        "rate_limited",
        None,
        "40210",
        {"retry_after": 40210, "violated_policies": ["burst", "daily"]},
        id="rate-limited-policies",
    ),
    pytest.param(AuthUnavailable(), 503, "auth_unavailable", None, "1", {}, id="unavailable"),
    pytest.param(
        StoreUnavailable(OSError("down")),
        503,
        "auth_unavailable",
        None,
        "1",
        {},
        id="store-unavailable",
    ),
    pytest.param(
        LimiterUnavailable(OSError("down")),
        503,
        "auth_unavailable",
        None,
        "1",
        {},
        id="limiter-unavailable",
    ),
    pytest.param(
        ForbiddenField("credits"),
        403,
        "forbidden_field",
        None,
        None,
        {"field": "credits"},
        id="forbidden-field",
    ),
]


class Response:
    """What `send_problem` sent: the two ASGI messages, decoded."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        assert [message["type"] for message in messages] == [
            "http.response.start",
            "http.response.body",
        ]
        self.start, self.end = messages
        self.status: int = self.start["status"]
        self.raw_headers: list[tuple[bytes, bytes]] = self.start["headers"]
        self.body: bytes = self.end["body"]
        assert not self.end.get("more_body", False)

    def values(self, name: str) -> list[str]:
        return [
            value.decode("latin-1")
            for key, value in self.raw_headers
            if key.decode("latin-1").lower() == name
        ]

    def header(self, name: str) -> str | None:
        values = self.values(name)
        assert len(values) <= 1, f"{name} sent {len(values)} times"
        return values[0] if values else None

    def json(self) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.body)
        return document


async def send(exc: AuthenticationError, **options: Any) -> Response:
    messages: list[dict[str, Any]] = []

    async def collect(message: Any) -> None:
        messages.append(message)

    await send_problem(collect, exc, **options)
    return Response(messages)


@pytest.mark.parametrize(("exc", "status", "code", "challenge", "retry_after", "extra"), TABLE)
async def test_if_error_sent_then_status_body_and_headers_follow_the_contract(
    exc: AuthenticationError,
    status: int,
    code: str,
    challenge: str | None,
    retry_after: str | None,
    extra: dict[str, Any],
) -> None:
    response = await send(exc)
    assert response.status == status
    assert response.header("content-type") == PROBLEM_CONTENT_TYPE
    body = response.json()
    assert set(body) == BASE_FIELDS | set(extra)
    assert body["status"] == status
    assert body["code"] == code
    assert isinstance(body["type"], str)
    assert body["type"]
    assert isinstance(body["title"], str)
    assert body["title"]
    assert isinstance(body["detail"], str)
    assert body["detail"]
    for field, value in extra.items():
        assert body[field] == value
    assert response.header("www-authenticate") == challenge
    assert response.header("retry-after") == retry_after
    assert response.header("content-length") == str(len(response.body))


@pytest.mark.parametrize(("exc", "status", "code", "challenge", "retry_after", "extra"), TABLE)
async def test_if_error_sent_twice_then_each_response_has_fresh_header_lists(
    exc: AuthenticationError,
    status: int,
    code: str,
    challenge: str | None,
    retry_after: str | None,
    extra: dict[str, Any],
) -> None:
    first = await send(exc)
    expected = list(first.raw_headers)
    first.raw_headers.append((b"x-mutated", b"1"))
    first.raw_headers[0] = (b"content-type", b"text/plain")
    second = await send(exc)
    assert second.raw_headers is not first.raw_headers
    assert second.raw_headers == expected
    second.raw_headers.clear()
    third = await send(exc)
    assert third.raw_headers == expected
    assert third.body == first.body


async def test_if_every_401_sent_then_www_authenticate_names_the_bearer_realm() -> None:
    for exc in (MissingAPIKey(), MalformedAPIKey(), InvalidAPIKey(), KeyRevoked()):
        challenge = (await send(exc)).header("www-authenticate")
        assert challenge is not None
        assert challenge.startswith('Bearer realm="api"')


async def test_if_missing_key_then_challenge_has_no_error_code() -> None:
    # RFC 6750 §3.1: a request without credentials gets no error code.
    challenge = (await send(MissingAPIKey())).header("www-authenticate")
    assert challenge == 'Bearer realm="api"'


async def test_if_several_scopes_required_then_challenge_lists_them_space_separated() -> None:
    response = await send(InsufficientScope(["contacts:read", "contacts:write"]))
    assert response.header("www-authenticate") == (
        'Bearer realm="api", error="insufficient_scope", scope="contacts:read contacts:write"'
    )
    assert response.json()["required_scopes"] == ["contacts:read", "contacts:write"]


async def test_if_realm_given_then_challenge_uses_it_quoted() -> None:
    response = await send(InvalidAPIKey(), realm='my "api"')
    assert response.header("www-authenticate") == (
        'Bearer realm="my \\"api\\"", error="invalid_token"'
    )
    # The default realm's cached response is not affected.
    assert (await send(InvalidAPIKey())).header("www-authenticate") == INVALID_TOKEN


@pytest.mark.parametrize(("seconds", "header"), [(0, "1"), (-5, "1"), (1, "1"), (60, "60")])
async def test_if_rate_limited_then_retry_after_is_a_whole_number_at_least_one(
    seconds: int, header: str
) -> None:
    response = await send(RateLimited(seconds))
    assert response.header("retry-after") == header
    assert response.json()["retry_after"] == int(header)


async def test_if_extra_headers_given_then_they_are_sent_after_the_problem_headers() -> None:
    extra = [(b"ratelimit", b'"default";r=0;t=7')]
    response = await send(RateLimited(7), extra=extra)
    assert response.header("ratelimit") == '"default";r=0;t=7'
    assert response.header("retry-after") == "7"
    # The caller's list is not modified.
    assert extra == [(b"ratelimit", b'"default";r=0;t=7')]
    # A later send without extras does not carry them.
    assert (await send(RateLimited(7))).header("ratelimit") is None


async def test_if_detail_customised_then_body_carries_it_and_cache_is_untouched() -> None:
    custom = await send(MalformedAPIKey("The Authorization header is too long."))
    assert custom.json()["detail"] == "The Authorization header is too long."
    assert custom.header("content-length") == str(len(custom.body))
    plain = await send(MalformedAPIKey())
    assert plain.json()["detail"] == MalformedAPIKey.detail


async def test_if_unavailable_then_body_does_not_leak_the_original_error() -> None:
    original = ConnectionError("redis://user:hunter2@db.internal:6379 refused")
    response = await send(StoreUnavailable(original))
    assert b"hunter2" not in response.body
    assert b"db.internal" not in response.body
    assert b"ConnectionError" not in response.body


async def test_if_problem_sent_then_response_is_not_cacheable() -> None:
    for exc in (MissingAPIKey(), InsufficientScope(["a:b"]), RateLimited(3), AuthUnavailable()):
        assert (await send(exc)).header("cache-control") == "no-store"


BAD_REALMS = ["API ключи", "api\r\nSet-Cookie: a=b", "a\x00b", "", "x" * 101]


@pytest.mark.parametrize("realm", BAD_REALMS)
@pytest.mark.parametrize("entry", ["middleware", "starlette", "fastapi"])
async def test_a_realm_no_challenge_can_carry_is_refused_when_the_entry_point_is_built(
    entry: str, realm: str
) -> None:
    # Accepted, it made every refusal fail as it was sent: a 500 for a character outside
    # Latin-1, a header split in two for a line break.
    from apikeys import APIKeyMiddleware, Hasher, KeyManager
    from apikeys.errors import ConfigurationError
    from apikeys.integrations.fastapi import APIKeySecurity
    from apikeys.integrations.starlette import APIKeyBackend
    from apikeys.stores import MemoryStore
    from apikeys.testing import TEST_PEPPER

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not reached")

    async with KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER), webhooks=False) as m:
        build = {
            "middleware": lambda: APIKeyMiddleware(app, manager=m, realm=realm),
            "starlette": lambda: APIKeyBackend(m, realm=realm),
            "fastapi": lambda: APIKeySecurity(m, realm=realm),
        }[entry]
        with pytest.raises(ConfigurationError, match="realm"):
            build()


def test_a_realm_of_printable_ascii_is_kept_and_quoted_in_the_challenge() -> None:
    from apikeys.problems import check_realm, problem_headers

    realm = 'my "api" \\ v1'
    assert check_realm(realm) == realm
    (challenge,) = [
        v for k, v in problem_headers(MissingAPIKey(), realm) if k == b"www-authenticate"
    ]
    assert challenge == b'Bearer realm="my \\"api\\" \\\\ v1"'
