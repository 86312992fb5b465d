"""A user's test suite for the notes API, written with apikeys.testing.

Fixtures from the apikeys plugin: `apikeys_manager`, `make_key`, `assert_problem`.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from apikeys import APIKeyMiddleware
from apikeys.ratelimit import parse_rate_limit
from apikeys.testing import (
    AssertProblem,
    KeyFactory,
    assert_problem,
    assert_rejects_bad_credentials,
    async_assert_rejects_bad_credentials,
)
from apikeys.testing import strategies as ak
from apikeys.types import Status

# make_key and client are function-scoped: hypothesis reuses them across examples, which
# is what these property tests want (one app, keys piling up).
PROPERTY = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_health_needs_no_key(client: TestClient) -> None:
    assert client.get("/health").text == "ok"


def test_notes_need_a_key(client: TestClient) -> None:
    assert_problem(client.get("/api/v1/notes"), "missing_api_key")


def test_a_read_key_reads_but_cannot_write(
    client: TestClient, make_key: KeyFactory, assert_problem: AssertProblem
) -> None:
    created = make_key.sync(scopes=["notes:read"], workspace="acme")
    assert client.get("/api/v1/notes", headers=bearer(created.key)).json() == {"data": []}
    response = client.post("/api/v1/notes", headers=bearer(created.key), content=b"hi")
    body = assert_problem(response, "insufficient_scope")
    assert body["required_scopes"] == ["notes:write"]


@pytest.mark.parametrize(
    ("status", "code"),
    [("disabled", "key_disabled"), ("revoked", "key_revoked"), ("expired", "key_expired")],
)
async def test_unusable_keys_are_refused(
    app: APIKeyMiddleware, make_key: KeyFactory, status: Status, code: str
) -> None:
    created = await make_key(scopes=["notes:read"], status=status)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.get("/api/v1/notes", headers=bearer(created.key))
    assert_problem(response, code)


def test_bad_credentials_never_get_in(app: APIKeyMiddleware, make_key: KeyFactory) -> None:
    key = make_key.sync(scopes=["notes:read"]).key
    assert_rejects_bad_credentials(app, "/api/v1/notes", valid_key=key, max_examples=150)


async def test_bad_credentials_never_write(app: APIKeyMiddleware, make_key: KeyFactory) -> None:
    key = (await make_key(scopes=["notes:write"])).key
    await async_assert_rejects_bad_credentials(
        app, "/api/v1/notes", method="POST", valid_key=key, max_examples=100
    )


@pytest.fixture
def read_key(make_key: KeyFactory) -> str:
    """One key for all the examples of a test: strategies built on it must not change."""
    return make_key.sync(scopes=["notes:read"]).key


@PROPERTY
@given(data=st.data())
def test_no_other_secret_opens_a_real_key(
    client: TestClient, read_key: str, data: st.DataObject
) -> None:
    wrong = data.draw(ak.wrong_secrets(read_key))
    assert_problem(client.get("/api/v1/notes", headers=bearer(wrong)), "invalid_api_key")
    assert client.get("/api/v1/notes", headers=bearer(read_key)).status_code == 200


@PROPERTY
@given(limit=ak.rate_limits(), scopes=ak.scope_sets(max_size=3))
def test_every_key_announces_its_own_limit(
    client: TestClient, make_key: KeyFactory, limit: str, scopes: list[str]
) -> None:
    key = make_key.sync(scopes=[*scopes, "notes:read"], rate_limit=limit).key
    response = client.get("/api/v1/notes", headers=bearer(key))
    assert response.status_code == 200
    item = parse_rate_limit(limit)
    policy = f'"default";q={item.amount};w={item.get_expiry()}'
    assert response.headers["ratelimit-policy"] == policy
