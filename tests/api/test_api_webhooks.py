"""The management API's webhook operations, for operators only, on the memory store: an
operator adds, lists, shows, rolls and removes endpoints and lists, shows and replays
deliveries (a replay is sent again by a `Deliverer`); any other caller is answered as on
a path that is no operation. (On SQLite and PostgreSQL: tests/api/test_schemathesis.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from standardwebhooks import Webhook
from starlette.applications import Starlette
from starlette.routing import Mount

from apikeys import Hasher, KeyManager, MemoryStore, store_from_url
from apikeys.api import ManagementAPI
from apikeys.api.schemas import DELIVERY_RESPONSE, WEBHOOK_RESPONSE
from apikeys.errors import ConfigurationError
from apikeys.types import utcnow
from apikeys.webhooks import Deliverer, DeliveryOptions
from apikeys.webhooks.targets import ALLOW_PRIVATE_ENV
from tests.conftest import TEST_PEPPER
from tests.webhooks.receiver import Receiver

BASE = "http://test/v1/api-keys"
OPERATOR = ["apikeys:read", "apikeys:admin"]
# The receiver listens on 127.0.0.1: internal targets are allowed explicitly.
FAST = DeliveryOptions(
    poll_interval=0.02, retry_delays=(0.05, 0.1), timeout=2, lease=10, allow_private_targets=True
)


@pytest.fixture
async def manager(hasher: Hasher) -> AsyncIterator[KeyManager]:
    """A manager that sends no webhooks itself: the tests deliver with a `Deliverer`."""
    made = KeyManager(MemoryStore(), hasher=hasher, webhooks=False)
    yield made
    await made.aclose()


def client_of(api: ManagementAPI) -> httpx.AsyncClient:
    app = Starlette(routes=[Mount("/v1/api-keys", app=api)])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE)


@pytest.fixture
async def client(manager: KeyManager) -> AsyncIterator[httpx.AsyncClient]:
    api = ManagementAPI(manager, rate_limit="100000/minute", operators=["ops"])
    async with client_of(api) as c:
        yield c


@pytest.fixture
def allow_private(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOW_PRIVATE_ENV, "1")


async def auth(
    manager: KeyManager, scopes: list[str] | None = None, workspace: str = "ops"
) -> dict[str, str]:
    """The headers of a call made with a new key of `workspace` (full access without
    `scopes`)."""
    if scopes is None:
        created = await manager.create(name="c", workspace=workspace, full_access=True)
    else:
        created = await manager.create(name="c", workspace=workspace, scopes=scopes)
    return {"Authorization": f"Bearer {created.key}"}


async def deliver_until(deliverer: Deliverer, done: Callable[[], bool]) -> None:
    async with asyncio.timeout(30):
        while not done():
            await deliverer.run_once()
            await asyncio.sleep(0.02)


@pytest.mark.usefixtures("allow_private")
async def test_an_operator_adds_lists_shows_rolls_and_removes_an_endpoint_its_secret_shown_once(
    client: httpx.AsyncClient, manager: KeyManager
) -> None:
    headers = await auth(manager, OPERATOR)
    made = await client.post(
        "/webhooks",
        json={"url": "http://127.0.0.1:9/hooks", "events": ["key.revoked"], "workspace": "acme"},
        headers=headers,
    )
    assert made.status_code == 201, made.text
    created = made.json()
    assert created["secret"].startswith("whsec_")
    assert set(created) == {*WEBHOOK_RESPONSE["properties"], "secret"}
    webhook_id = created["id"]

    listed = (await client.get("/webhooks", headers=headers)).json()["items"]
    got = (await client.get(f"/webhooks/{webhook_id}", headers=headers)).json()
    assert [item["id"] for item in listed] == [webhook_id]
    assert got == listed[0] == {k: v for k, v in created.items() if k != "secret"}
    assert created["secret"] not in (await client.get("/webhooks", headers=headers)).text

    rolled = await client.post(
        f"/webhooks/{webhook_id}/roll", json={"overlap_seconds": 60}, headers=headers
    )
    assert rolled.status_code == 200, rolled.text
    assert rolled.json()["secret"].startswith("whsec_")
    assert rolled.json()["secret"] != created["secret"]
    (stored,) = await manager.store.webhooks().endpoints()  # type: ignore[union-attr]
    assert created["secret"] not in repr(stored)
    assert rolled.json()["secret"] not in repr(stored)
    # Sealed with the manager's pepper, as the CLI seals it: never kept in clear.
    assert stored.secret.startswith("sealed$")
    assert stored.previous_secret is not None
    assert stored.previous_secret.startswith("sealed$")

    removed = await client.delete(f"/webhooks/{webhook_id}", headers=headers)
    assert removed.status_code == 200
    assert removed.json()["id"] == webhook_id
    assert (await client.get(f"/webhooks/{webhook_id}", headers=headers)).status_code == 404
    assert (await client.get("/webhooks", headers=headers)).json() == {"items": []}
    # As through the CLI, no audit event: the trail is of keys and identities.
    assert [event.action for event in await manager.audit(workspace="ops")] == ["created"]


@pytest.mark.usefixtures("allow_private")
async def test_a_replayed_delivery_is_sent_again_by_the_deliverer_signed_with_the_shown_secret(
    client: httpx.AsyncClient, manager: KeyManager, receiver: Receiver
) -> None:
    headers = await auth(manager, OPERATOR)
    made = await client.post(
        "/webhooks", json={"url": receiver.url, "events": ["key.revoked"]}, headers=headers
    )
    secret = made.json()["secret"]
    theirs = await manager.create(name="a", workspace="acme", full_access=True)
    await manager.revoke(theirs.record.id)
    deliverer = Deliverer(manager.store.webhooks(), FAST, hasher=manager.hasher)  # type: ignore[arg-type]
    try:
        await deliver_until(deliverer, lambda: len(receiver.received) == 1)
        page = await client.get(
            "/webhooks/deliveries",
            params={"workspace": "acme", "status": "delivered"},
            headers=headers,
        )
        (delivery,) = page.json()["items"]
        assert set(delivery) == set(DELIVERY_RESPONSE["properties"])
        assert (delivery["workspace"], delivery["event"]) == ("acme", "key.revoked")
        assert (await client.get(f"/webhooks/deliveries/{delivery['id']}", headers=headers)).json()[
            "status"
        ] == "delivered"

        replayed = await client.post(
            f"/webhooks/deliveries/{delivery['id']}/replay", headers=headers
        )
        assert replayed.status_code == 200, replayed.text
        assert replayed.json()["status"] == "pending"
        await deliver_until(deliverer, lambda: len(receiver.received) == 2)
    finally:
        await deliverer.aclose()
    first, again = receiver.received
    assert first.body == again.body
    assert again.headers["webhook-id"] == delivery["id"]
    assert Webhook(secret).verify(again.body, again.headers)["type"] == "key.revoked"
    other = await client.get("/webhooks/deliveries", params={"workspace": "x"}, headers=headers)
    assert other.json() == {"items": [], "next_cursor": None}


async def test_a_replay_of_a_delivery_being_sent_answers_409_and_an_unknown_one_404(
    client: httpx.AsyncClient, manager: KeyManager, allow_private: None
) -> None:
    headers = await auth(manager, OPERATOR)
    await client.post("/webhooks", json={"url": "http://127.0.0.1:9/h"}, headers=headers)
    await manager.create(name="a", workspace="acme", full_access=True)
    hooks = manager.store.webhooks()
    now = utcnow()
    await hooks.take(now)
    (claimed,) = await hooks.claim("elsewhere", now, now + timedelta(minutes=1), 10)
    busy = await client.post(f"/webhooks/deliveries/{claimed.id}/replay", headers=headers)
    assert busy.status_code == 409
    assert busy.json()["code"] == "conflict"
    for unknown in ("msg_0", "x" * 65):
        answer = await client.post(f"/webhooks/deliveries/{unknown}/replay", headers=headers)
        assert answer.status_code == 404
        assert (
            await client.get(f"/webhooks/deliveries/{unknown}", headers=headers)
        ).status_code == 404
    assert (await client.post("/webhooks/wh_0/roll", headers=headers)).status_code == 404
    assert (await client.delete("/webhooks/wh_0", headers=headers)).status_code == 404


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "ftp://example.com/"}, "url"),
        ({"url": "http://exa mple.com/"}, "url"),
        ({"url": "http:///path"}, ""),
        ({"url": "http://user:pw@example.com/"}, ""),
        ({"url": "http://example.com/", "events": ["key.nothing"]}, "events"),
        ({"url": "http://example.com/", "workspace": " "}, ""),
        ({"url": "http://example.com/", "workspace": "a\x00b"}, ""),
        ({"url": "http://127.0.0.1/hooks"}, "url"),
        ({"url": "http://example.com/", "secret": "whsec_x"}, "secret"),
        ({"url": "x" * 3000}, "url"),
        ({}, "url"),
    ],
)
async def test_a_bad_endpoint_answers_400_and_adds_nothing(
    client: httpx.AsyncClient, manager: KeyManager, body: dict[str, Any], field: str
) -> None:
    headers = await auth(manager, OPERATOR)
    answer = await client.post("/webhooks", json=body, headers=headers)
    assert answer.status_code == 400, answer.text
    assert answer.json()["errors"][0]["field"] == field
    assert await manager.store.webhooks().endpoints() == []  # type: ignore[union-attr]


async def test_bad_parameters_of_deliveries_and_rolls_answer_400(
    client: httpx.AsyncClient, manager: KeyManager, allow_private: None
) -> None:
    headers = await auth(manager, OPERATOR)
    webhook_id = (
        await client.post("/webhooks", json={"url": "http://127.0.0.1:9/h"}, headers=headers)
    ).json()["id"]
    bad = [{"status": "lost"}, {"limit": "0"}, {"limit": "x"}, {"workspace": ""}, {"a": 1}]
    for params in [*bad, {"workspace": "a\x00b"}, {"workspace": " "}, {"cursor": ""}]:
        answer = await client.get("/webhooks/deliveries", params=params, headers=headers)
        assert answer.status_code == 400, params
    for roll in ({"overlap_seconds": -1}, {"overlap_seconds": "1"}, {"grace_seconds": 1}, []):
        answer = await client.post(f"/webhooks/{webhook_id}/roll", json=roll, headers=headers)
        assert answer.status_code == 400, roll


async def pages(
    client: httpx.AsyncClient, headers: dict[str, str], **params: str | int
) -> list[dict[str, Any]]:
    """Every page of the deliveries, each read with the last one's `next_cursor`."""
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        query = params if cursor is None else {**params, "cursor": cursor}
        answer = await client.get("/webhooks/deliveries", params=query, headers=headers)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["items"]) <= int(params["limit"])
        items += answer.json()["items"]
        cursor = answer.json()["next_cursor"]
        if cursor is None:
            return items


async def test_an_operator_pages_through_the_deliveries_with_next_cursor_each_one_once(
    client: httpx.AsyncClient, manager: KeyManager, allow_private: None
) -> None:
    headers = await auth(manager, OPERATOR)
    for url in ("http://127.0.0.1:9/one", "http://127.0.0.1:9/two"):
        await client.post("/webhooks", json={"url": url}, headers=headers)
    for number in range(5):
        for workspace in ("acme", "globex"):
            await manager.create(name=f"k{number}", workspace=workspace, full_access=True)
    await manager.store.webhooks().take(utcnow())  # type: ignore[union-attr]
    listed = await client.get("/webhooks/deliveries", params={"limit": 1000}, headers=headers)
    every = listed.json()
    assert every["next_cursor"] is None
    assert len(every["items"]) == 20  # each key's key.created, to both endpoints
    for size in (1, 3, 20, 100):
        assert await pages(client, headers, limit=size) == every["items"]
    acme = [item for item in every["items"] if item["workspace"] == "acme"]
    assert await pages(client, headers, limit=3, workspace="acme") == acme
    assert await pages(client, headers, limit=4, status="pending", workspace="acme") == acme
    full = await client.get("/webhooks/deliveries", params={"limit": 20}, headers=headers)
    assert full.json()["next_cursor"] is None  # the last page says so when it is full too


@pytest.mark.parametrize(
    "cursor",
    [
        "x",
        "!!!!",
        "é" * 4,
        "MS4xLg",  # "1.1." (no id)
        "MS45MjIzMzcyMDM2ODU0Nzc1ODA4Lm1zZ18w",  # "1.9223372036854775808.msg_0": past 64 bits
        "Mi4xLm1zZ18w",  # "2.1.msg_0": another version
        "a" * 1001,
    ],
)
async def test_a_cursor_not_made_by_the_api_answers_400_naming_it(
    client: httpx.AsyncClient, manager: KeyManager, cursor: str
) -> None:
    headers = await auth(manager, OPERATOR)
    answer = await client.get("/webhooks/deliveries", params={"cursor": cursor}, headers=headers)
    assert answer.status_code == 400, answer.text
    assert answer.json()["errors"][0]["field"] == "cursor"


async def test_a_retried_create_with_its_idempotency_key_adds_one_endpoint(
    client: httpx.AsyncClient, manager: KeyManager, allow_private: None
) -> None:
    headers = {**await auth(manager, OPERATOR), "Idempotency-Key": "hook-1"}
    body = {"url": "http://127.0.0.1:9/h"}
    first = await client.post("/webhooks", json=body, headers=headers)
    again = await client.post("/webhooks", json=body, headers=headers)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert len(await manager.store.webhooks().endpoints()) == 1  # type: ignore[union-attr]


REQUESTS = [
    ("GET", "/webhooks"),
    ("POST", "/webhooks"),
    ("PUT", "/webhooks"),
    ("GET", "/webhooks/"),
    ("GET", "/webhooks/wh_0"),
    ("DELETE", "/webhooks/wh_0"),
    ("POST", "/webhooks/wh_0/roll"),
    ("GET", "/webhooks/deliveries"),
    ("GET", "/webhooks/deliveries/msg_0"),
    ("POST", "/webhooks/deliveries/msg_0/replay"),
    ("PATCH", "/webhooks/deliveries/msg_0/replay"),
    # A final line break: Starlette's `^/webhooks$` routes these to the operations.
    ("GET", "/webhooks%0A"),
    ("POST", "/webhooks%0A"),
    ("GET", "/webhooks/deliveries%0A"),
    ("GET", "/webhooks/wh_0%0A"),
]
NOT_OPERATORS = {
    "full access in the operators' workspace": (None, "ops"),
    "read and write in the operators' workspace": (["apikeys:read", "apikeys:write"], "ops"),
    "read and a wildcard in the operators' workspace": (["apikeys:read", "apikeys:*"], "ops"),
    "admin of another workspace": (OPERATOR, "acme"),
    "read alone in the operators' workspace": (["apikeys:read"], "ops"),
    "no management scope in the operators' workspace": (["contacts:read"], "ops"),
}


def shown(headers: httpx.Headers) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name != "ratelimit"}


@pytest.mark.parametrize("who", NOT_OPERATORS)
async def test_webhook_paths_answer_a_caller_who_is_no_operator_as_a_path_that_is_no_operation(
    client: httpx.AsyncClient, manager: KeyManager, who: str, allow_private: None
) -> None:
    operator = await auth(manager, OPERATOR)
    added = await client.post("/webhooks", json={"url": "http://127.0.0.1:9/h"}, headers=operator)
    webhook_id = added.json()["id"]
    scopes, workspace = NOT_OPERATORS[who]
    headers = {**await auth(manager, scopes, workspace), "Idempotency-Key": "k"}
    body = {"url": "http://127.0.0.1:9/h"}
    known = [("GET", f"/webhooks/{webhook_id}"), ("DELETE", f"/webhooks/{webhook_id}")]
    for method, path in [*REQUESTS, ("HEAD", "/webhooks"), ("OPTIONS", "/webhooks"), *known]:
        answer = await client.request(method, path, json=body, headers=headers)
        unknown = await client.request(method, "/nothing" + path, json=body, headers=headers)
        assert answer.status_code == unknown.status_code in (403, 404), (method, path)
        assert answer.content == unknown.content, (method, path)
        # Header for header, but for what is left of the rate limit (one request less).
        assert shown(answer.headers) == shown(unknown.headers), (method, path)
    assert len(await manager.store.webhooks().endpoints()) == 1  # type: ignore[union-attr]


async def test_without_operators_no_caller_reaches_webhooks_and_the_document_lists_none(
    manager: KeyManager,
) -> None:
    async with client_of(ManagementAPI(manager)) as client:
        headers = await auth(manager, OPERATOR)
        for method, path in REQUESTS:
            answer = await client.request(method, path, headers=headers)
            assert answer.status_code == 404, (method, path)
            assert answer.json()["code"] == "not_found"
        document = (await client.get("/openapi.json")).json()
    assert not [path for path in document["paths"] if path.startswith("/webhooks")]
    with_operators = ManagementAPI(manager, operators={"ops"}).document
    assert {path for path in with_operators["paths"] if path.startswith("/webhooks")} == {
        "/webhooks",
        "/webhooks/{webhook_id}",
        "/webhooks/{webhook_id}/roll",
        "/webhooks/deliveries",
        "/webhooks/deliveries/{delivery_id}",
        "/webhooks/deliveries/{delivery_id}/replay",
    }


async def test_operators_are_refused_on_a_store_that_keeps_no_webhooks(hasher: Hasher) -> None:
    async with KeyManager(store_from_url("sqlite:///:memory:"), hasher=hasher) as manager:
        with pytest.raises(ConfigurationError, match="keeps none"):
            ManagementAPI(manager, operators=["ops"])
        ManagementAPI(manager)  # without operators, the API needs no webhooks
    with pytest.raises(ConfigurationError, match="collection"):
        ManagementAPI(KeyManager(MemoryStore(), hasher=hasher), operators="ops")


async def _answers(workspace: str, scopes: list[str] | None, method: str, path: str) -> None:
    m = KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER), webhooks=False)
    async with m, client_of(ManagementAPI(m, operators=["ops"])) as client:
        headers = await auth(m, scopes, workspace)
        answer = await client.request(method, path, json={}, headers=headers)
        unknown = await client.request(method, "/nothing" + path, json={}, headers=headers)
        listed = await client.get("/webhooks", headers=headers)
    operator = workspace == "ops" and scopes is not None and "apikeys:admin" in scopes
    if not operator:
        assert (answer.status_code, answer.content) == (unknown.status_code, unknown.content)
        assert listed.status_code in (403, 404)
    elif "apikeys:read" in scopes or "apikeys:*" in scopes:  # type: ignore[operator]
        assert listed.status_code == 200
    else:
        assert listed.status_code == 403  # as on any path: a management call needs read


@settings(max_examples=60)
@given(
    workspace=st.sampled_from(["ops", "acme", "ops2"]),
    scopes=st.none()
    | st.lists(
        st.sampled_from(
            ["apikeys:read", "apikeys:write", "apikeys:admin", "apikeys:*", "contacts:read"]
        ),
        min_size=1,
        unique=True,
    ),
    request=st.sampled_from(REQUESTS),
)
def test_only_a_key_of_an_operator_workspace_naming_apikeys_admin_reaches_webhooks(
    workspace: str, scopes: list[str] | None, request: tuple[str, str]
) -> None:
    asyncio.run(_answers(workspace, scopes, *request))


@pytest.mark.parametrize("mounted", ["alone", "fastapi"])
async def test_a_final_line_break_takes_no_caller_past_the_operators_rule(
    manager: KeyManager, mounted: str
) -> None:
    # Starlette's `^/webhooks$` routes `/webhooks` and a line break to the operation; served
    # alone or in FastAPI (no Starlette Mount in front), a full-access key of a workspace
    # that is no operator's listed and added endpoints that way.
    from fastapi import FastAPI

    from apikeys.integrations.fastapi import include_management_api

    app: Any
    if mounted == "alone":
        app, prefix = ManagementAPI(manager, operators={"ops"}), ""
    else:
        app, prefix = FastAPI(), "/v1/api-keys"
        include_management_api(app, manager, path=prefix, operators={"ops"})
    headers = await auth(manager, None, "acme")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for method, path in [("GET", "/webhooks%0A"), ("POST", "/webhooks%0A")]:
            answer = await client.request(
                method, prefix + path, json={"url": "https://hooks.example.com/h"}, headers=headers
            )
            assert answer.status_code == 404, (method, path, answer.text)
            assert answer.json()["code"] == "not_found"
    assert await manager.store.webhooks().endpoints() == []  # type: ignore[union-attr]
