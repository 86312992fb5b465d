"""The example contacts service, started as a user starts it and driven over HTTP.

`python -m uvicorn examples.contacts_service.app:app` runs in a subprocess on SQLite files
of the test's own; keys are made in the same key store from here (and revoked with the
`apikeys` command line), as an operator would.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import json
import os
import re
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from apikeys import Hasher, KeyExpired, KeyManager, parse_key, store_from_url
from tests.examples.conftest import (
    PEPPER,
    REPO,
    free_port,
    service_env,
    start_service,
    stop_service,
)

PROBLEM = "application/problem+json"
OPERATIONS = {
    ("GET", "/api/v1/contacts"): "contacts:read",
    ("POST", "/api/v1/contacts"): "contacts:write",
    ("GET", "/api/v1/contacts/{contact_id}"): "contacts:read",
    ("GET", "/api/v1/campaigns"): "campaigns:read",
    ("POST", "/api/v1/campaigns/{campaign_id}/trigger"): "campaigns:trigger",
}
ALL_SCOPES = sorted(set(OPERATIONS.values()))


def _sqlite_path(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


@dataclass
class Service:
    """A running contacts service and the stores behind it."""

    base_url: str
    store_url: str
    database_url: str
    env: dict[str, str]

    def create_key(
        self,
        workspace: str,
        scopes: list[str] | None = None,
        *,
        full_access: bool = False,
        rate_limit: str | None = None,
    ) -> str:
        async def create() -> str:
            manager = KeyManager(store_from_url(self.store_url), hasher=Hasher(pepper=PEPPER))
            async with manager:
                created = await manager.create(
                    name="test",
                    workspace=workspace,
                    scopes=scopes or (),
                    full_access=full_access,
                    rate_limit=rate_limit,
                )
            return created.key

        return asyncio.run(create())

    def revoke(self, key: str) -> None:
        async def revoke() -> None:
            manager = KeyManager(store_from_url(self.store_url), hasher=Hasher(pepper=PEPPER))
            async with manager:
                await manager.revoke(parse_key(key).id)

        asyncio.run(revoke())

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=10)

    def count(self, table: str, workspace: str) -> int:
        """Rows of `table` stored for `workspace`, read straight from the database file."""
        assert table in ("contacts", "campaigns", "campaign_runs")
        path = _sqlite_path(self.database_url)
        with contextlib.closing(sqlite3.connect(path)) as conn:
            row = conn.execute(
                f"SELECT count(*) FROM {table} WHERE workspace = ?",  # noqa: S608 - fixed names
                (workspace,),
            ).fetchone()
        return int(row[0])


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("contacts-service")
    store_url = f"sqlite:///{tmp / 'apikeys.db'}"
    database_url = f"sqlite:///{tmp / 'example.db'}"
    env = service_env(APIKEYS_STORE_URL=store_url, EXAMPLE_DATABASE_URL=database_url)
    log = tmp / "service.log"
    process, base_url = start_service(env, log)
    try:
        yield Service(base_url, store_url, database_url, env)
    finally:
        stop_service(process, log)


def _workspace() -> str:
    return f"ws-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def workspace() -> str:
    """A workspace of the test's own, so counts and lists see only the test's data."""
    return _workspace()


@pytest.fixture
def client(service: Service, workspace: str) -> Iterator[httpx.Client]:
    """A client with a full-access key of the test's workspace."""
    with service.client(service.create_key(workspace, full_access=True)) as http:
        yield http


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    assert body["code"] == code
    assert body["type"].endswith(code)
    assert isinstance(body["title"], str)
    assert isinstance(body["detail"], str)
    return body


ADA = {
    "name": "Ada Lovelace",
    "phone": "+44 20 7183 8750",
    "email": "Ada@Example.COM",
    "company": "Analytical Engines Ltd",
}


# -- the OpenAPI document --------------------------------------------------------------------


def test_openapi_document_is_public_and_describes_every_operation(service: Service) -> None:
    with service.client() as http:
        response = http.get("/api/v1/openapi.json")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    document = json.loads(response.content)
    assert document["openapi"].startswith("3.1")
    paths = document["paths"]
    for (method, path), scope in OPERATIONS.items():
        operation = paths[path][method.lower()]
        assert operation["security"] == [{"bearerAuth": []}]
        assert operation["x-required-scopes"] == [scope]
        assert scope in operation["description"]
        for status in ("401", "403", "429", "503"):
            assert status in operation["responses"]
    assert paths["/api/v1/openapi.json"]["get"]["security"] == []
    assert document["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "ak_<id>_<secret><checksum>",
        "description": "An API key created in Settings → Integrations → API keys.",
    }
    create = paths["/api/v1/contacts"]["post"]
    body_schema = document["components"]["schemas"]["ContactInput"]
    assert create["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ContactInput"
    )
    assert body_schema["additionalProperties"] is False
    assert body_schema["properties"]["name"]["maxLength"] == 200
    assert {"400", "413", "415", "422"} <= set(create["responses"])


# -- contacts --------------------------------------------------------------------------------


def test_if_contact_created_then_201_location_and_normalised_contact(
    service: Service, client: httpx.Client, workspace: str
) -> None:
    response = client.post("/api/v1/contacts", json=ADA)
    assert response.status_code == 201, response.text
    contact = response.json()
    assert set(contact) == {"id", "name", "phone", "email", "company", "created_at"}
    assert contact["id"].startswith("c_")
    assert response.headers["location"] == f"/api/v1/contacts/{contact['id']}"
    assert contact["name"] == "Ada Lovelace"
    assert contact["phone"] == "+442071838750"
    assert contact["email"] == "Ada@example.com"
    assert contact["company"] == "Analytical Engines Ltd"
    assert contact["created_at"].endswith("Z")
    assert "ratelimit" in response.headers

    fetched = client.get(response.headers["location"])
    assert fetched.status_code == 200
    assert fetched.json() == contact
    listed = client.get("/api/v1/contacts")
    assert listed.status_code == 200
    assert listed.json() == {"data": [contact], "next_cursor": None}
    assert service.count("contacts", workspace) == 1


@pytest.mark.parametrize(
    "body",
    [
        {"name": "Only A Name"},
        {"name": "Nulls", "phone": None, "email": None, "company": None},
    ],
    ids=["omitted", "null"],
)
def test_if_optional_fields_omitted_or_null_then_stored_as_null(
    client: httpx.Client, body: dict[str, Any]
) -> None:
    response = client.post("/api/v1/contacts", json=body)
    assert response.status_code == 201, response.text
    contact = response.json()
    assert contact["name"] == body["name"]
    assert contact["phone"] is None
    assert contact["email"] is None
    assert contact["company"] is None


def _chunks(size: int) -> Iterator[bytes]:
    yield b'{"name": "'
    for _ in range(size // 1024):
        yield b"x" * 1024
    yield b'"}'


BIG = 70 * 1024
CHUNKED = "a body over 64 KiB, sent in chunks without Content-Length"
JSON = {"content-type": "application/json"}

REFUSALS: list[Any] = [
    pytest.param(b'{"name": ', JSON, 400, "malformed_json", id="truncated-json"),
    pytest.param(b'{"name": NaN}', JSON, 400, "malformed_json", id="nan"),
    pytest.param(b'{"name": "a", "name": "b"}', JSON, 400, "malformed_json", id="duplicate-member"),
    pytest.param(b'{"name": "\xff"}', JSON, 400, "malformed_json", id="not-utf8"),
    pytest.param(b"[" * 60000, JSON, 400, "malformed_json", id="deeply-nested"),
    pytest.param(
        json.dumps(ADA).encode(),
        {"content-type": "text/plain"},
        415,
        "unsupported_media_type",
        id="text-plain",
    ),
    pytest.param(
        b"name=Form+Post",
        {"content-type": "application/x-www-form-urlencoded"},
        415,
        "unsupported_media_type",
        id="form-encoded",
    ),
    pytest.param(
        json.dumps(ADA).encode(),
        {"content-type": "application/json; charset=latin-1"},
        415,
        "unsupported_media_type",
        id="not-utf8-charset",
    ),
    pytest.param(json.dumps(ADA).encode(), {}, 415, "unsupported_media_type", id="no-content-type"),
    pytest.param(
        json.dumps({"name": "x" * BIG}).encode(),
        JSON,
        413,
        "payload_too_large",
        id="over-64KiB-with-content-length",
    ),
    pytest.param(CHUNKED, JSON, 413, "payload_too_large", id="over-64KiB-chunked"),
]


@pytest.mark.parametrize(("body", "headers", "status", "code"), REFUSALS)
def test_if_body_refused_then_problem_and_nothing_stored(
    service: Service,
    client: httpx.Client,
    workspace: str,
    body: bytes | str,
    headers: dict[str, str],
    status: int,
    code: str,
) -> None:
    content = _chunks(BIG) if body == CHUNKED else body
    response = client.post("/api/v1/contacts", content=content, headers=headers)
    assert_problem(response, status, code)
    if body == CHUNKED:
        assert "content-length" not in response.request.headers
    assert service.count("contacts", workspace) == 0


def test_if_declared_length_over_limit_then_413_before_the_body_is_read(
    service: Service, workspace: str
) -> None:
    key = service.create_key(workspace, full_access=True)
    port = int(service.base_url.rsplit(":", 1)[1])
    request = (
        "POST /api/v1/contacts HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        "Content-Length: 10000000\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request.encode())
        received = b""
        while chunk := sock.recv(65536):  # the server answers and closes without the body
            received += chunk
    head, _, body = received.decode("latin-1").partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413 "), head
    assert f"content-type: {PROBLEM}" in head.lower()
    assert json.loads(body)["code"] == "payload_too_large"
    assert service.count("contacts", workspace) == 0


FIELD_REFUSALS: list[Any] = [
    pytest.param(
        {"name": "", "phone": "12345", "email": "not-an-email", "company": "x" * 201},
        {"name", "phone", "email", "company"},
        id="several-fields-at-once",
    ),
    pytest.param({"name": "A", "nickname": "B"}, {"nickname"}, id="unknown-field"),
    pytest.param({"name": "A", "phone": "12345"}, {"phone"}, id="phone-without-plus"),
    pytest.param({"name": "A", "phone": "+12345"}, {"phone"}, id="phone-invalid-number"),
    pytest.param({"name": "A", "email": "ada@"}, {"email"}, id="bad-email"),
    pytest.param({"phone": "+14155552671"}, {"name"}, id="name-missing"),
    pytest.param({"name": 42}, {"name"}, id="name-not-a-string"),
    pytest.param({"name": "x" * 201}, {"name"}, id="name-too-long"),
    pytest.param({"name": "   "}, {"name"}, id="name-blank"),
    pytest.param({"name": "A\u0000B"}, {"name"}, id="name-with-nul"),
    pytest.param({"name": "A", "email": ["a@example.com"]}, {"email"}, id="email-not-a-string"),
    pytest.param([{"name": "A"}], {"body"}, id="not-an-object"),
]


@pytest.mark.parametrize(("body", "fields"), FIELD_REFUSALS)
def test_if_fields_invalid_then_422_lists_every_field_and_nothing_stored(
    service: Service, client: httpx.Client, workspace: str, body: Any, fields: set[str]
) -> None:
    response = client.post("/api/v1/contacts", json=body)
    problem = assert_problem(response, 422, "validation_failed")
    assert {error["field"] for error in problem["errors"]} == fields
    assert all(isinstance(error["message"], str) for error in problem["errors"])
    assert service.count("contacts", workspace) == 0


def test_if_contact_unknown_then_404_problem(client: httpx.Client) -> None:
    assert_problem(client.get("/api/v1/contacts/c_doesnotexist"), 404, "not_found")
    assert_problem(client.get("/api/v1/contacts/not%00an%2Fid"), 404, "not_found")


# -- pagination ------------------------------------------------------------------------------


def test_if_paged_by_three_then_3_3_1_in_creation_order(client: httpx.Client) -> None:
    created = []
    for number in range(7):
        response = client.post("/api/v1/contacts", json={"name": f"Contact {number}"})
        assert response.status_code == 201
        created.append(response.json()["id"])

    def walk() -> tuple[list[int], list[str]]:
        sizes, ids, cursor = [], [], None
        while True:
            params: dict[str, Any] = {"limit": 3}
            if cursor is not None:
                params["cursor"] = cursor
            page = client.get("/api/v1/contacts", params=params)
            assert page.status_code == 200, page.text
            body = page.json()
            sizes.append(len(body["data"]))
            ids.extend(contact["id"] for contact in body["data"])
            cursor = body["next_cursor"]
            if cursor is None:
                return sizes, ids
            assert isinstance(cursor, str)

    sizes, ids = walk()
    assert sizes == [3, 3, 1]
    assert ids == created  # oldest first, no duplicates, none missing
    assert walk() == (sizes, ids)  # stable
    everything = client.get("/api/v1/contacts").json()
    assert [contact["id"] for contact in everything["data"]] == created
    assert everything["next_cursor"] is None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


@pytest.mark.parametrize("path", ["/api/v1/contacts", "/api/v1/campaigns"])
@pytest.mark.parametrize(
    "query",
    [
        "limit=0",
        "limit=201",
        "limit=abc",
        "limit=1.5",
        "limit=-1",
        "limit=",
        "limit=%EF%BC%93",  # a full-width digit
        "limit=1&limit=2",
        "cursor=",
        "cursor=!!!",
        "cursor=abc",
        "cursor=" + _b64(b"[1, 2]"),
        "cursor=" + _b64(b"{}"),
        "cursor=" + _b64(b'["2026-01-01T00:00:00", "c_x"]'),  # a time without its zone
        "cursor=" + _b64(b'["yesterday", "c_x"]'),
        # in range in its own zone, out of range once moved to UTC
        "cursor=" + _b64(b'["0001-01-01T00:00:00+14:00", "c_x"]'),
        "cursor=" + _b64(b'["9999-12-31T23:59:59-14:00", "c_x"]'),
        "cursor=" + "A" * 600,
        "limt=10",
    ],
)
def test_if_list_parameter_invalid_then_400_invalid_parameter(
    client: httpx.Client, path: str, query: str
) -> None:
    problem = assert_problem(client.get(f"{path}?{query}"), 400, "invalid_parameter")
    assert problem["errors"][0]["field"] in ("limit", "cursor", "limt")


# -- campaigns -------------------------------------------------------------------------------


def test_if_campaigns_listed_then_the_workspace_demo_campaigns(client: httpx.Client) -> None:
    response = client.get("/api/v1/campaigns")
    assert response.status_code == 200
    body = response.json()
    assert body["next_cursor"] is None
    assert [campaign["name"] for campaign in body["data"]] == ["Welcome series", "Spring sale"]
    for campaign in body["data"]:
        assert campaign["id"].startswith("cmp_")
        assert campaign["created_at"].endswith("Z")


def test_if_campaign_triggered_then_202_queued_and_run_recorded(
    service: Service, client: httpx.Client, workspace: str
) -> None:
    campaign_id = client.get("/api/v1/campaigns").json()["data"][0]["id"]
    response = client.post(f"/api/v1/campaigns/{campaign_id}/trigger")
    assert response.status_code == 202, response.text
    body = response.json()
    assert set(body) == {"campaign_id", "run_id", "status"}
    assert body["campaign_id"] == campaign_id
    assert body["status"] == "queued"
    assert body["run_id"].startswith("run_")
    assert service.count("campaign_runs", workspace) == 1
    assert_problem(client.post("/api/v1/campaigns/cmp_unknown/trigger"), 404, "not_found")
    assert service.count("campaign_runs", workspace) == 1


# -- workspaces, scopes, keys ----------------------------------------------------------------


def test_if_key_of_other_workspace_then_sees_none_of_its_data(service: Service) -> None:
    workspace_a, workspace_b = _workspace(), _workspace()
    with (
        service.client(service.create_key(workspace_a, full_access=True)) as a,
        service.client(service.create_key(workspace_b, full_access=True)) as b,
    ):
        contact = a.post("/api/v1/contacts", json=ADA).json()
        campaign_a = a.get("/api/v1/campaigns").json()["data"][0]["id"]

        assert b.get("/api/v1/contacts").json() == {"data": [], "next_cursor": None}
        assert_problem(b.get(f"/api/v1/contacts/{contact['id']}"), 404, "not_found")
        campaigns_b = [c["id"] for c in b.get("/api/v1/campaigns").json()["data"]]
        assert campaign_a not in campaigns_b
        assert_problem(b.post(f"/api/v1/campaigns/{campaign_a}/trigger"), 404, "not_found")

        assert a.get(f"/api/v1/contacts/{contact['id']}").status_code == 200
    assert service.count("campaign_runs", workspace_a) == 0
    assert service.count("contacts", workspace_b) == 0


def test_if_key_lacks_write_scope_then_403_and_nothing_stored(
    service: Service, workspace: str
) -> None:
    with service.client(service.create_key(workspace, ["contacts:read"])) as http:
        assert http.get("/api/v1/contacts").status_code == 200
        response = http.post("/api/v1/contacts", json=ADA)
    problem = assert_problem(response, 403, "insufficient_scope")
    assert problem["required_scopes"] == ["contacts:write"]
    assert 'error="insufficient_scope"' in response.headers["www-authenticate"]
    assert service.count("contacts", workspace) == 0


@pytest.mark.parametrize(("method", "path"), list(OPERATIONS))
def test_if_key_has_other_scopes_then_every_operation_403_with_its_documented_scope(
    service: Service, method: str, path: str
) -> None:
    document = httpx.get(f"{service.base_url}/api/v1/openapi.json").json()
    documented = document["paths"][path][method.lower()]["x-required-scopes"]
    others = [scope for scope in ALL_SCOPES if scope != OPERATIONS[method, path]]
    url = path.format(contact_id="c_x", campaign_id="cmp_x")
    with service.client(service.create_key(_workspace(), others)) as http:
        response = http.request(method, url, json={"name": "A"} if method == "POST" else None)
    problem = assert_problem(response, 403, "insufficient_scope")
    assert problem["required_scopes"] == documented == [OPERATIONS[method, path]]


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_api_key"),
        ({"Authorization": "Bearer not-a-key"}, "malformed_api_key"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, "malformed_api_key"),
    ],
)
def test_if_no_valid_key_then_401(service: Service, headers: dict[str, str], code: str) -> None:
    with service.client() as http:
        for method, path in OPERATIONS:
            url = path.format(contact_id="c_x", campaign_id="cmp_x")
            response = http.request(method, url, headers=headers)
            assert_problem(response, 401, code)
            assert response.headers["www-authenticate"].startswith('Bearer realm="api"')


def _revoke_with_cli(service: Service, key: str) -> None:
    cli = Path(sys.executable).with_name("apikeys")
    if not cli.exists():
        pytest.skip("the apikeys command line is not installed")
    result = subprocess.run(
        [str(cli), "--store", service.store_url, "revoke", parse_key(key).id, "--yes"],
        env=service.env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("how", ["python", "cli"])
def test_if_key_revoked_in_the_store_then_next_request_401_key_revoked(
    service: Service, workspace: str, how: str
) -> None:
    key = service.create_key(workspace, full_access=True)
    with service.client(key) as http:
        assert http.get("/api/v1/contacts").status_code == 200
        if how == "cli":
            _revoke_with_cli(service, key)
        else:
            service.revoke(key)
        response = http.get("/api/v1/contacts")
        assert_problem(response, 401, "key_revoked")
        assert 'error="invalid_token"' in response.headers["www-authenticate"]
        assert_problem(http.post("/api/v1/contacts", json=ADA), 401, "key_revoked")
    assert service.count("contacts", workspace) == 0


def test_if_key_rate_limit_exhausted_then_429_with_retry_after(
    service: Service, workspace: str
) -> None:
    key = service.create_key(workspace, full_access=True, rate_limit="2/minute")
    with service.client(key) as http:
        assert http.get("/api/v1/campaigns").status_code == 200
        assert http.get("/api/v1/campaigns").status_code == 200
        response = http.get("/api/v1/campaigns")
    assert_problem(response, 429, "rate_limited")
    assert int(response.headers["retry-after"]) >= 1


# -- routing ---------------------------------------------------------------------------------


def test_if_path_or_method_unknown_then_404_or_405_problem(client: httpx.Client) -> None:
    for path in ("/api/v1/nothing-here", "/api/v2/contacts"):
        missing = client.get(path)
        assert_problem(missing, 404, "not_found")
        # Authenticated like every other path under /api/: the same RateLimit headers.
        assert {"ratelimit", "ratelimit-policy"} <= set(missing.headers)
    response = client.delete("/api/v1/contacts")
    assert_problem(response, 405, "method_not_allowed")
    assert {m.strip() for m in response.headers["allow"].split(",")} >= {"GET", "POST"}
    response = client.put("/api/v1/openapi.json")
    assert_problem(response, 405, "method_not_allowed")
    assert "GET" in response.headers["allow"]
    response = client.get("/api/v1/campaigns/cmp_x/trigger")
    assert_problem(response, 405, "method_not_allowed")
    assert response.headers["allow"] == "POST"


# -- the document against the service --------------------------------------------------------


@pytest.fixture(scope="module")
def api_schema(service: Service) -> Any:
    """The document as schemathesis loads it from the running service."""
    schema = schemathesis.openapi.from_url(f"{service.base_url}/api/v1/openapi.json")
    schema.config.update(base_url=service.base_url)
    # The key is sent with every case below, so Authorization is not a generated parameter.
    schema.config.generation.update(with_security_parameters=False)
    return schema


@pytest.fixture(scope="module")
def schemathesis_key(service: Service) -> str:
    return service.create_key(_workspace(), full_access=True)


# schemathesis' own pytest integration (`from_fixture(...).parametrize()`) relies on a
# pytest internal that pytest 9 removed, so each operation runs as a plain Hypothesis test.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "path"), [*OPERATIONS, ("GET", "/api/v1/openapi.json")], ids=str
)
def test_if_requests_generated_from_the_document_then_no_500_and_responses_conform(
    api_schema: Any, schemathesis_key: str, method: str, path: str
) -> None:
    operation = api_schema[path][method]
    modes = [GenerationMode.POSITIVE]
    if path in dict.fromkeys(p for _, p in OPERATIONS):
        # Only the API refuses unknown query parameters; the document ignores them.
        modes.append(GenerationMode.NEGATIVE)
    cases = st.one_of(*(operation.as_strategy(mode) for mode in modes))
    auth = {"Authorization": f"Bearer {schemathesis_key}"}

    @hypothesis.settings(
        max_examples=25,
        deadline=None,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(case=cases)
    def check(case: Any) -> None:
        case.call_and_validate(
            headers=auth,
            checks=[
                not_a_server_error,
                status_code_conformance,
                content_type_conformance,
                response_headers_conformance,
                response_schema_conformance,
                negative_data_rejection,
            ],
        )

    check()


# -- the demo --------------------------------------------------------------------------------


def test_if_demo_run_twice_then_the_second_key_replaces_the_first(tmp_path: Path) -> None:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("APIKEYS_", "EXAMPLE_"))
    }
    env["PYTHONPATH"] = str(REPO)
    keys = []
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-m", "examples.demo", "--no-serve"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        lines = [line.strip() for line in result.stdout.splitlines()]
        key = next(line for line in lines if line.startswith("ak_"))
        assert any(
            line.startswith(f'curl -H "Authorization: Bearer {key}" http://127.0.0.1:8000/')
            for line in lines
        )
        keys.append(key)
    assert keys[0] != keys[1]

    pepper_file = tmp_path / ".apikeys-demo-pepper"
    assert pepper_file.stat().st_mode & 0o077 == 0
    pepper = pepper_file.read_text().strip()

    async def verify_all() -> list[tuple[str, str]]:
        manager = KeyManager(
            store_from_url(f"sqlite:///{tmp_path / 'apikeys.db'}"), hasher=Hasher(pepper=pepper)
        )
        async with manager:
            records = [await manager.verify(keys[1], record_usage=False)]
            listed = await manager.list("acme")
        # One demo key in use: the second run rolled the first run's key.
        assert [record.status for record in listed if record.name == "demo key"] == [
            "expired",
            "active",
        ]
        return [(record.workspace, record.name) for record in records]

    async def first_key_refused() -> bool:
        manager = KeyManager(
            store_from_url(f"sqlite:///{tmp_path / 'apikeys.db'}"), hasher=Hasher(pepper=pepper)
        )
        async with manager:
            try:
                await manager.verify(keys[0], record_usage=False)
            except KeyExpired:
                return True
        return False

    assert asyncio.run(verify_all()) == [("acme", "demo key")]
    assert asyncio.run(first_key_refused())
    with contextlib.closing(sqlite3.connect(tmp_path / "example.db")) as conn:
        counts = [
            conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]  # noqa: S608
            for table in ("workspaces", "contacts", "campaigns")
        ]
    assert counts == [1, 2, 2]


# -- PostgreSQL ------------------------------------------------------------------------------


@pytest.mark.postgres
def test_if_served_on_postgresql_then_the_api_works_the_same(
    postgres_url: str, tmp_path: Path
) -> None:
    env = service_env(APIKEYS_STORE_URL=postgres_url, EXAMPLE_DATABASE_URL=postgres_url)
    log = tmp_path / "service.log"
    process, base_url = start_service(env, log)
    try:
        service = Service(base_url, postgres_url, postgres_url, env)
        mine, theirs = _workspace(), _workspace()
        key = service.create_key(mine, full_access=True)
        with (
            service.client(key) as http,
            service.client(service.create_key(theirs, full_access=True)) as other,
        ):
            created = http.post("/api/v1/contacts", json=ADA)
            assert created.status_code == 201, created.text
            contact = created.json()
            assert contact["phone"] == "+442071838750"
            assert http.get(created.headers["location"]).json() == contact
            assert http.get("/api/v1/contacts").json() == {"data": [contact], "next_cursor": None}
            problem = assert_problem(
                http.post("/api/v1/contacts", json={"name": "A", "phone": "12345"}),
                422,
                "validation_failed",
            )
            assert [error["field"] for error in problem["errors"]] == ["phone"]
            assert_problem(http.get("/api/v1/contacts/not%00an-id"), 404, "not_found")
            campaigns = http.get("/api/v1/campaigns").json()["data"]
            assert [c["name"] for c in campaigns] == ["Welcome series", "Spring sale"]
            triggered = http.post(f"/api/v1/campaigns/{campaigns[0]['id']}/trigger")
            assert triggered.status_code == 202, triggered.text

            assert other.get("/api/v1/contacts").json()["data"] == []
            assert_problem(other.get(f"/api/v1/contacts/{contact['id']}"), 404, "not_found")

            service.revoke(key)
            assert_problem(http.get("/api/v1/contacts"), 401, "key_revoked")
    finally:
        stop_service(process, log)


def test_if_no_key_then_even_an_unknown_api_path_asks_for_one(service: Service) -> None:
    with service.client() as anonymous:
        assert_problem(anonymous.get("/api/v1/nothing-here"), 401, "missing_api_key")
        assert anonymous.get("/api/v1/openapi.json").status_code == 200  # the public path


def test_demo_help_has_no_markdown_fences() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "examples.demo", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "```" not in result.stdout
    assert "    python -m examples.demo --no-serve" in result.stdout


def test_make_demo_takes_a_port() -> None:
    dry = subprocess.run(
        ["make", "-n", "demo", "PORT=8080"], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert "-m examples.demo --port 8080" in dry.stdout


# -- proxies: the address an allowlist sees ---------------------------------------------------

FORGED = {"X-Forwarded-For": "203.0.113.7"}


def _demo_env() -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("APIKEYS_", "EXAMPLE_")) and name != "FORWARDED_ALLOW_IPS"
    }
    env["PYTHONPATH"] = str(REPO)
    return env


def _key_for_one_network(directory: Path) -> str:
    """A full-access key of the demo's workspace, usable only from 203.0.113.0/24."""
    pepper = (directory / ".apikeys-demo-pepper").read_text().strip()

    async def create() -> str:
        store = store_from_url(f"sqlite:///{directory / 'apikeys.db'}")
        async with KeyManager(store, hasher=Hasher(pepper=pepper)) as manager:
            created = await manager.create(
                name="one network",
                workspace="acme",
                full_access=True,
                allowed_ips=["203.0.113.0/24"],
            )
        return created.key

    return asyncio.run(create())


@contextlib.contextmanager
def _serve_demo(directory: Path, *extra: str) -> Iterator[str]:
    port = free_port()
    log = directory / f"demo-{port}.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "examples.demo", "--port", str(port), *extra],
            cwd=directory,
            env=_demo_env(),
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            assert process.poll() is None, log.read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base_url}/api/v1/openapi.json", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_if_make_demo_serves_then_a_forged_x_forwarded_for_never_passes_an_allowlist(
    tmp_path: Path,
) -> None:
    # uvicorn trusts X-Forwarded-For from 127.0.0.1 by default, so any local process could
    # choose the address the allowlist sees. The demo trusts no proxy unless told to.
    seeded = subprocess.run(
        [sys.executable, "-m", "examples.demo", "--no-serve"],
        cwd=tmp_path,
        env=_demo_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert seeded.returncode == 0, seeded.stderr
    key = _key_for_one_network(tmp_path)
    headers = {"Authorization": f"Bearer {key}", **FORGED}

    with _serve_demo(tmp_path) as base_url:
        assert_problem(
            httpx.get(f"{base_url}/api/v1/contacts", headers=headers), 403, "ip_not_allowed"
        )

    # Told which proxy to trust, it reads the header that proxy sends.
    with _serve_demo(tmp_path, "--forwarded-allow-ips", "127.0.0.1") as base_url:
        assert httpx.get(f"{base_url}/api/v1/contacts", headers=headers).status_code == 200


def _documented_uvicorn_lines() -> list[tuple[str, str]]:
    sources = [
        *REPO.joinpath("docs").rglob("*.md"),
        REPO / "README.md",
        *REPO.joinpath("examples").rglob("*.py"),
    ]
    return [
        (f"{path.relative_to(REPO)}:{number}", line.strip())
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if re.search(r"uvicorn [\w.]*examples\.[\w.]+:\w+", line)
    ]


def test_the_example_command_lines_trust_no_proxy_unless_configured() -> None:
    lines = _documented_uvicorn_lines()
    assert len(lines) >= 4
    trusting = [
        (where, line)
        for where, line in lines
        if "--no-proxy-headers" not in line and "--forwarded-allow-ips" not in line
    ]
    assert not trusting, trusting
    assert all("--forwarded-allow-ips '*'" not in line for _, line in lines)


def test_the_tests_start_the_service_with_its_documented_command_line() -> None:
    from tests.examples import conftest

    assert "--no-proxy-headers" in inspect.getsource(conftest.start_service)


def test_if_the_client_leaves_mid_body_then_a_400_problem_not_an_application_error() -> None:
    # Starlette raises ClientDisconnect: it reached the server as an application error,
    # logged with its traceback.
    from examples.contacts_service.payload import read_body
    from examples.contacts_service.problems import Problem
    from starlette.requests import Request

    messages = iter(
        [
            {"type": "http.request", "body": b'{"name": "a', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )

    async def receive() -> dict[str, object]:
        return next(messages)

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(Problem) as refused:
        asyncio.run(read_body(request))
    assert refused.value.status == 400
