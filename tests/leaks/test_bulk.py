"""`BulkRevoke`: anyone may report leaked keys; only keys whose secret is right are revoked.

The app is driven in process through httpx's ASGI transport, with the client address the
transport reports, as a server would put it in the scope. What happened to a key is read
back from the manager: its status and its audit trail.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apikeys import Hasher, KeyManager, MemoryStore, generate_key, parse_key
from apikeys.keys import ParsedKey
from apikeys.leaks import BulkRevoke
from apikeys.leaks.bulk import BULK_REVOKE_ANSWER, MAX_BODY_BYTES, MAX_KEYS
from apikeys.ratelimit import RateLimiter
from tests.conftest import TEST_PEPPER

PROBLEM = "application/problem+json"
PATH = "/credentials/revoke"


def client_for(app: Any, address: str = "203.0.113.7") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(address, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


async def post(
    app: Any,
    body: Any,
    *,
    address: str = "203.0.113.7",
    content_type: str = "application/json",
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with client_for(app, address) as client:
        return await client.post(
            PATH, content=content, headers={"Content-Type": content_type, **(headers or {})}
        )


async def new_key(manager: KeyManager, state: str = "active") -> str:
    created = await manager.create(name="leaky", workspace="acme", full_access=True)
    if state == "revoked":
        await manager.revoke(created.record.id)
    elif state == "disabled":
        await manager.disable(created.record.id)
    return created.key


async def status_of(manager: KeyManager, key: str) -> str:
    return (await manager.get(parse_key(key).id)).status


def planted(key: str) -> str:
    """The key's real (public) id with a made-up secret: a valid checksum, a wrong secret."""
    real = parse_key(key)
    return ParsedKey(real.prefix, real.id, generate_key().secret).token


def assert_accepted(response: httpx.Response) -> None:
    assert response.status_code == 202, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["cache-control"] == "no-store"
    assert response.json() == BULK_REVOKE_ANSWER


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body: dict[str, Any] = response.json()
    assert (body["status"], body["code"]) == (status, code)
    return body


@pytest.fixture
async def app(memory_manager: KeyManager) -> BulkRevoke:
    return BulkRevoke(memory_manager, rate_limit="1000/minute")


# -- what is revoked ---------------------------------------------------------------------------


async def test_if_a_listed_key_verifies_then_it_is_revoked_as_leaked_on_every_store(
    manager: KeyManager,
) -> None:
    leaked, bystander, target = [await new_key(manager) for _ in range(3)]
    app = BulkRevoke(manager)

    response = await post(
        app,
        {"credentials": [leaked, planted(target), generate_key().token, "not a key"]},
    )

    assert_accepted(response)
    assert await status_of(manager, leaked) == "revoked"
    events = await manager.audit(key_id=parse_key(leaked).id)
    assert (events[-1].action, events[-1].actor) == ("leak_revoked", "bulk-revoke")
    # A real id with a made-up secret revokes nothing; an unlisted key is untouched.
    assert await status_of(manager, target) == "active"
    assert await status_of(manager, bystander) == "active"
    assert [event.action for event in await manager.audit(key_id=parse_key(target).id)] == [
        "created"
    ]


async def test_a_disabled_or_expired_key_with_its_secret_is_revoked_too(
    app: BulkRevoke, memory_manager: KeyManager
) -> None:
    disabled = await new_key(memory_manager, "disabled")
    revoked = await new_key(memory_manager, "revoked")

    assert_accepted(await post(app, [disabled, revoked]))

    assert await status_of(memory_manager, disabled) == "revoked"
    assert await status_of(memory_manager, revoked) == "revoked"
    events = await memory_manager.audit(key_id=parse_key(revoked).id)
    assert [event.action for event in events] == ["created", "revoked"]  # not revoked twice


async def test_the_bare_array_and_githubs_object_are_both_taken(
    app: BulkRevoke, memory_manager: KeyManager
) -> None:
    first, second = await new_key(memory_manager), await new_key(memory_manager)
    assert_accepted(await post(app, [first, first]))
    assert_accepted(await post(app, {"credentials": [second]}))
    assert await status_of(memory_manager, first) == "revoked"
    assert await status_of(memory_manager, second) == "revoked"


async def test_a_key_of_another_prefix_is_not_revoked(hasher: Hasher) -> None:
    async with KeyManager(MemoryStore(), hasher=hasher, prefix="acme_live") as manager:
        key = (await manager.create(name="other", full_access=True)).key
        other = KeyManager(manager.store, hasher=hasher)  # the default prefix, same store
        try:
            assert_accepted(await post(BulkRevoke(other), [key]))
        finally:
            other._release()
        assert await status_of(manager, key) == "active"


# -- the answer says nothing -------------------------------------------------------------------


async def test_the_answer_is_the_same_whatever_the_list_holds(
    app: BulkRevoke, memory_manager: KeyManager
) -> None:
    real = await new_key(memory_manager)
    lists = [
        [],
        [real],
        [real],  # now already revoked
        [planted(await new_key(memory_manager))],
        [generate_key().token],
        [await new_key(memory_manager, "disabled"), "x"],
        ["not a key", generate_key("acme_live").token],
        [generate_key().token for _ in range(MAX_KEYS)],
    ]
    answers = set()
    for keys in lists:
        response = await post(app, {"credentials": keys})
        assert_accepted(response)
        answers.add(
            (
                response.status_code,
                response.headers["content-type"],
                response.headers["content-length"],
                response.content,
            )
        )
    assert len(answers) == 1


# -- bad input changes nothing -----------------------------------------------------------------


def _bad_bodies(key: str) -> list[tuple[bytes, str, int, str]]:
    """(body, content type, status, code): each holds `key`, and must revoke nothing."""
    listed = json.dumps([key]).encode()
    return [
        (listed, "text/plain", 415, "unsupported_media_type"),
        (listed, "", 415, "unsupported_media_type"),
        (listed, "application/json; charset=latin-1", 415, "unsupported_media_type"),
        (b"[" + json.dumps(key).encode() + b",", "application/json", 400, "malformed_json"),
        (b"\xff" + listed, "application/json", 400, "malformed_json"),
        (b"", "application/json", 400, "malformed_json"),
        (b'{"credentials": [], "credentials": []}', "application/json", 400, "malformed_json"),
        (json.dumps([key, 1]).encode(), "application/json", 400, "invalid_payload"),
        (json.dumps([key, ""]).encode(), "application/json", 400, "invalid_payload"),
        (json.dumps([key, None]).encode(), "application/json", 400, "invalid_payload"),
        (json.dumps([key, "x" * 1025]).encode(), "application/json", 400, "invalid_payload"),
        (json.dumps({"credentials": key}).encode(), "application/json", 400, "invalid_payload"),
        (json.dumps({"keys": [key]}).encode(), "application/json", 400, "invalid_payload"),
        (
            json.dumps({"credentials": [key], "note": "x"}).encode(),
            "application/json",
            400,
            "invalid_payload",
        ),
        (json.dumps(key).encode(), "application/json", 400, "invalid_payload"),
        (json.dumps([key] * (MAX_KEYS + 1)).encode(), "application/json", 400, "invalid_payload"),
        (
            json.dumps([key]).encode() + b" " * MAX_BODY_BYTES,
            "application/json",
            413,
            "payload_too_large",
        ),
    ]


async def test_if_the_body_is_bad_then_a_4xx_problem_and_nothing_revoked(
    app: BulkRevoke, memory_manager: KeyManager
) -> None:
    key = await new_key(memory_manager)
    for body, content_type, status, code in _bad_bodies(key):
        response = await post(app, body, content_type=content_type)
        assert_problem(response, status, code)
        assert await status_of(memory_manager, key) == "active", (status, code)


async def test_too_many_keys_are_refused_with_the_limit_named(app: BulkRevoke) -> None:
    keys = [generate_key().token for _ in range(MAX_KEYS + 1)]
    problem = assert_problem(await post(app, {"credentials": keys}), 400, "invalid_payload")
    assert problem["errors"] == [{"field": "credentials", "message": "must hold at most 1000 keys"}]


async def test_wrong_types_are_listed_by_position(app: BulkRevoke) -> None:
    problem = assert_problem(await post(app, ["ok", 7, ["x"]]), 400, "invalid_payload")
    assert [error["field"] for error in problem["errors"]] == ["body[1]", "body[2]"]


async def test_if_not_post_then_405_with_allow(app: BulkRevoke) -> None:
    async with client_for(app) as client:
        for method in ("GET", "PUT", "DELETE"):
            response = await client.request(method, PATH)
            assert_problem(response, 405, "method_not_allowed")
            assert response.headers["allow"] == "POST"


async def test_an_oversized_declared_length_is_refused_before_reading(app: BulkRevoke) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"[]"

    async with client_for(app) as client:
        response = await client.post(
            PATH,
            content=body(),
            headers={"Content-Type": "application/json", "Content-Length": str(10**9)},
        )
    assert_problem(response, 413, "payload_too_large")


# -- the rate limit ----------------------------------------------------------------------------


async def test_each_client_address_is_limited_and_a_limited_request_revokes_nothing(
    memory_manager: KeyManager,
) -> None:
    app = BulkRevoke(memory_manager, rate_limit="2/hour")
    key = await new_key(memory_manager)

    assert_accepted(await post(app, []))
    assert_problem(
        await post(app, "not even JSON", content_type="text/plain"), 415, "unsupported_media_type"
    )
    # Bad requests count too: the limit is on requests, not on keys revoked.
    response = await post(app, [key])
    problem = assert_problem(response, 429, "rate_limited")
    assert int(response.headers["retry-after"]) >= 1
    assert problem["retry_after"] >= 1
    assert await status_of(memory_manager, key) == "active"

    # Another address has its own count.
    assert_accepted(await post(app, [key], address="198.51.100.9"))
    assert await status_of(memory_manager, key) == "revoked"


async def test_an_ipv6_client_is_limited_by_its_64(memory_manager: KeyManager) -> None:
    app = BulkRevoke(memory_manager, rate_limit="1/hour")
    assert_accepted(await post(app, [], address="2001:db8:1:2::1"))
    assert_problem(await post(app, [], address="2001:db8:1:2:ffff::9"), 429, "rate_limited")
    assert_accepted(await post(app, [], address="2001:db8:1:3::1"))
    # An IPv4 client a dual-stack server reports as ::ffff:a.b.c.d is that IPv4 client.
    assert_accepted(await post(app, [], address="::ffff:192.0.2.1"))
    assert_problem(await post(app, [], address="192.0.2.1"), 429, "rate_limited")


async def test_behind_trusted_proxies_the_forwarded_client_is_limited(
    memory_manager: KeyManager,
) -> None:
    app = BulkRevoke(memory_manager, rate_limit="1/hour", trusted_proxies=1)
    proxy = "10.0.0.2"
    first = {"X-Forwarded-For": "198.51.100.1"}
    assert_accepted(await post(app, [], address=proxy, headers=first))
    assert_problem(await post(app, [], address=proxy, headers=first), 429, "rate_limited")
    # A client writing its own entry to the left cannot pick a fresh address.
    forged = {"X-Forwarded-For": "192.0.2.55, 198.51.100.1"}
    assert_problem(await post(app, [], address=proxy, headers=forged), 429, "rate_limited")
    assert_accepted(await post(app, [], address=proxy, headers={"X-Forwarded-For": "198.51.100.2"}))


async def test_the_defaults_are_githubs_limit_and_the_bulk_revoke_actor(
    memory_manager: KeyManager,
) -> None:
    app = BulkRevoke(memory_manager)
    assert (app.rate_limit, app.actor, app.trusted_proxies) == ("60/hour", "bulk-revoke", 0)


async def test_a_shared_limiter_counts_for_every_app_using_it(memory_manager: KeyManager) -> None:
    limiter = RateLimiter("1/hour")
    first = BulkRevoke(memory_manager, rate_limit="1/hour", limiter=limiter)
    second = BulkRevoke(memory_manager, rate_limit="1/hour", limiter=limiter)
    assert_accepted(await post(first, []))
    assert_problem(await post(second, []), 429, "rate_limited")


# -- any body ----------------------------------------------------------------------------------

KEY = "<KEY>"
"""Stands for a real key in generated bodies; replaced by a fresh key's token per example."""

_tokens = st.one_of(st.just(KEY), st.text(max_size=40), st.builds(lambda: generate_key().token))
_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        _tokens,
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(["credentials", "keys", "x"]) | st.text(max_size=5), inner, max_size=3
        ),
    ),
    max_leaves=12,
)
bodies = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda value: json.dumps(value).encode(), _json),
    st.builds(
        lambda keys: json.dumps({"credentials": keys}).encode(), st.lists(_tokens, max_size=5)
    ),
    st.builds(
        lambda keys, ascii: json.dumps(keys, ensure_ascii=ascii).encode(),
        st.lists(_tokens, max_size=5),
        st.booleans(),
    ),
)


def test_any_body_gets_the_uniform_answer_or_a_4xx_and_a_4xx_changes_nothing() -> None:
    with asyncio.Runner() as runner:
        manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER))
        app = BulkRevoke(manager, rate_limit="1000000/hour")

        @given(
            body=bodies,
            content_type=st.sampled_from(
                ["application/json", "application/json; charset=utf-8", "text/plain", ""]
            ),
        )
        @settings(
            max_examples=200,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        def check(body: bytes, content_type: str) -> None:
            key = runner.run(new_key(manager))
            content = body.replace(KEY.encode(), key.encode())
            response = runner.run(post(app, content, content_type=content_type))
            assert response.status_code < 500, response.text
            if response.status_code == 202:
                assert response.json() == BULK_REVOKE_ANSWER
            else:
                assert 400 <= response.status_code < 500
                assert response.headers["content-type"] == PROBLEM
                assert runner.run(status_of(manager, key)) == "active"

        try:
            check()
        finally:
            runner.run(manager.aclose())
