"""The settings page's webhook deliveries, seen by users of two workspaces: each sees its own
keys' deliveries and the URLs of its own endpoints, never an endpoint URL that is not its
workspace's; a replay needs the CSRF token and a delivery of the user's workspace; odd ids
are the 404 page."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.requests import Request

from apikeys import Hasher, KeyManager
from apikeys.stores import KeyStore
from apikeys.types import utcnow
from apikeys.ui import KeysPage, PageUser
from apikeys.webhooks.admin import add_endpoint
from apikeys.webhooks.base import WebhookStore

# An operator's endpoint for every workspace: a URL that is itself a credential, as chat
# services' incoming webhooks are.
OPERATOR_URL = "https://hooks.example.net/services/T0001/B0002/operator-capability-token"
ACME_URL = "https://acme.example.com/apikeys-events"


@pytest.fixture
async def manager(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(store, hasher=Hasher(pepper=b"p" * 32), webhooks=False) as made:
        yield made


async def _user(request: Request) -> PageUser | None:
    workspace = request.headers.get("x-workspace")
    return None if workspace is None else PageUser(f"user-{workspace}", workspace, workspace)


def _client(manager: KeyManager, workspace: str) -> httpx.AsyncClient:
    page = KeysPage(manager, user=_user, secret_key="test-secret-key-0123456789")
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=page),
        base_url="http://test",
        headers={"x-workspace": workspace},
    )


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert found is not None
    return found.group(1)


async def _deliveries_of_acme(manager: KeyManager) -> tuple[WebhookStore, str, str]:
    hooks = manager.store.webhooks()
    assert hooks is not None
    operator = await add_endpoint(hooks, OPERATOR_URL)
    await add_endpoint(hooks, ACME_URL, workspace="acme")
    created = await manager.create(name="zapier", workspace="acme", full_access=True)
    await hooks.take(utcnow())
    (delivery,) = [d for d in await hooks.deliveries() if d.webhook_id == operator.id]
    return hooks, created.record.id, delivery.id


async def test_a_workspace_sees_its_endpoints_urls_and_never_an_operators(
    manager: KeyManager,
) -> None:
    _, key_id, _ = await _deliveries_of_acme(manager)
    async with _client(manager, "acme") as client:
        response = await client.get("/webhooks")
    assert response.status_code == 200
    html = response.text
    assert html.count(f'data-key-id="{key_id}"') == 2
    assert ACME_URL in html
    assert "operator-capability-token" not in html
    assert "hooks.example.net" not in html


async def test_another_workspace_sees_none_of_the_deliveries_and_cannot_replay_one(
    manager: KeyManager,
) -> None:
    hooks, key_id, delivery_id = await _deliveries_of_acme(manager)
    before = {d.id: d for d in await hooks.deliveries()}
    async with _client(manager, "globex") as client:
        page = await client.get("/webhooks")
        assert key_id not in page.text
        assert ACME_URL not in page.text
        token = _csrf((await client.get("/")).text)  # the key list's create form has one
        replayed = await client.post(f"/webhooks/{delivery_id}/replay", data={"csrf_token": token})
    assert replayed.status_code == 404
    assert {d.id: d for d in await hooks.deliveries()} == before


ODD_IDS = ["not-a-delivery", "x" * 5000, "%00", "%E2%80%AE", "..%2F..%2Factivity", "msg_%0Aevil"]


async def test_a_replay_without_the_csrf_token_or_of_an_odd_id_changes_nothing(
    manager: KeyManager,
) -> None:
    hooks, _, delivery_id = await _deliveries_of_acme(manager)
    before = {d.id: d for d in await hooks.deliveries()}
    async with _client(manager, "acme") as client:
        token = _csrf((await client.get("/webhooks")).text)
        forged = await client.post(f"/webhooks/{delivery_id}/replay", data={})
        assert forged.status_code == 403
        wrong = await client.post(f"/webhooks/{delivery_id}/replay", data={"csrf_token": "x"})
        assert wrong.status_code == 403
        for odd in ODD_IDS:
            answer = await client.post(f"/webhooks/{odd}/replay", data={"csrf_token": token})
            assert answer.status_code in (404, 405), (odd, answer.status_code)
    assert {d.id: d for d in await hooks.deliveries()} == before
