"""The settings page's webhook deliveries, seen by users of two workspaces: each sees its own
keys' deliveries and the URLs of its own endpoints, never an endpoint URL that is not its
workspace's; a replay needs the CSRF token and a delivery of the user's workspace; odd ids
are the 404 page; a busy workspace hides no other's deliveries, and an old delivery is
still replayed."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import timedelta

import httpx
import pytest
from starlette.requests import Request

import apikeys.ui.views.webhooks as webhooks_view
from apikeys import Hasher, KeyManager, MemoryStore
from apikeys.stores import KeyStore
from apikeys.stores.contract import WebhookStore
from apikeys.testing import TEST_PEPPER
from apikeys.types import utcnow
from apikeys.ui import KeysPage, PageUser
from apikeys.webhooks import Deliverer, DeliveryOptions
from apikeys.webhooks.admin import add_endpoint
from apikeys.webhooks.targets import ALLOW_PRIVATE_ENV, REFUSED_INTERNAL

# An operator's endpoint for every workspace: a URL that is itself a credential, as chat
# services' incoming webhooks are.
OPERATOR_URL = "https://hooks.example.net/services/T0001/B0002/operator-capability-token"
ACME_URL = "https://acme.example.com/apikeys-events"


@pytest.fixture
async def manager(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(
        store, hasher=Hasher(pepper=b"L8dw49pa41XlgoBNkvoeuME4lzC2vZHAO-p4QCm4Kiw"), webhooks=False
    ) as made:
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


def _listed(html: str) -> list[str]:
    """The ids of the deliveries the view lists, in order."""
    return re.findall(r'data-delivery-id="([^"]+)"', html)


async def _mark_delivered(hooks: WebhookStore) -> None:
    now = utcnow()
    for item in await hooks.claim("test", now, now + timedelta(minutes=1), 100):
        await hooks.finish(
            item.id,
            "test",
            now=now,
            status="delivered",
            next_attempt_at=now,
            response=204,
            error=None,
        )


async def test_a_workspace_sees_and_replays_its_deliveries_however_busy_another_is(
    manager: KeyManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(webhooks_view, "DELIVERIES_LIMIT", 3)
    hooks = manager.store.webhooks()
    assert hooks is not None
    # For every workspace; never sent to here, so an internal address is allowed.
    await add_endpoint(hooks, "http://127.0.0.1:9/every", allow_private=True)
    ours = await manager.create(name="ours", workspace="acme", full_access=True)
    for number in range(5):  # newer than ours, more than the view shows
        await manager.create(name=f"theirs{number}", workspace="globex", full_access=True)
    await hooks.take(utcnow())
    await _mark_delivered(hooks)
    (mine,) = await hooks.deliveries(workspace="acme")
    theirs = await hooks.deliveries(workspace="globex")
    assert mine.key_id == ours.record.id
    assert mine.id not in [d.id for d in await hooks.deliveries(limit=3)]

    async with _client(manager, "acme") as ann, _client(manager, "globex") as bob:
        shown = await ann.get("/webhooks")
        assert shown.status_code == 200
        assert _listed(shown.text) == [mine.id]
        bobs = await bob.get("/webhooks")
        assert _listed(bobs.text) == [d.id for d in theirs[:3]]
        assert "Showing the newest 3 deliveries." in bobs.text
        token = _csrf(shown.text)

        replayed = await ann.post(f"/webhooks/{mine.id}/replay", data={"csrf_token": token})
        assert replayed.status_code == 303
        again = await hooks.delivery(mine.id)
        assert again is not None
        assert again.status == "pending"
        notice = await ann.get("/webhooks")
        assert "The key.created delivery will be sent again." in notice.text

        # Another workspace's delivery, the oldest of theirs (past any listing), one that
        # does not exist, and ids no store makes: the same 404, and nothing is replayed.
        for delivery_id in (theirs[-1].id, theirs[0].id, "msg_" + "0" * 24, "x" * 65, "é"):
            refused = await ann.post(f"/webhooks/{delivery_id}/replay", data={"csrf_token": token})
            assert refused.status_code == 404
            assert "No such delivery" in refused.text
            assert theirs[0].webhook_id not in refused.text
        for delivery in theirs:
            unchanged = await hooks.delivery(delivery.id)
            assert unchanged is not None
            assert unchanged.status == "delivered"
            assert unchanged.attempts == 1

        # Bob replays his oldest, which no listing shows any more.
        bob_token = _csrf(bobs.text)
        oldest = await bob.post(f"/webhooks/{theirs[-1].id}/replay", data={"csrf_token": bob_token})
        assert oldest.status_code == 303
        replayed_oldest = await hooks.delivery(theirs[-1].id)
        assert replayed_oldest is not None
        assert replayed_oldest.status == "pending"


async def test_a_delivery_refused_as_internal_shows_so_and_nothing_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ALLOW_PRIVATE_ENV, raising=False)
    async with KeyManager(
        MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER), webhooks=False
    ) as manager:
        hooks = manager.store.webhooks()
        assert hooks is not None
        # Added while internal targets were allowed (or its name resolved elsewhere then).
        url = "http://169.254.169.254/latest/meta-data/"
        await add_endpoint(hooks, url, workspace="acme", allow_private=True)
        await manager.create(name="ours", workspace="acme", full_access=True)
        deliverer = Deliverer(hooks, DeliveryOptions(timeout=2))
        try:
            assert await deliverer.run_once() == 1  # refused before any connection
        finally:
            await deliverer.aclose()
        async with _client(manager, "acme") as ann:
            shown = await ann.get("/webhooks")
    assert shown.status_code == 200
    assert f">{REFUSED_INTERNAL}<" in shown.text
    assert "resolves" not in shown.text
    assert "WebhookTargetRefused" not in shown.text


async def test_an_identitys_deliveries_are_its_workspaces_and_name_the_identity(
    manager: KeyManager,
) -> None:
    hooks = manager.store.webhooks()
    assert hooks is not None
    await add_endpoint(hooks, ACME_URL, workspace="acme", events=["identity.disabled"])
    await manager.create_identity("cust_42", workspace="acme")
    await manager.disable_identity("cust_42")
    await hooks.take(utcnow())
    async with _client(manager, "acme") as acme:
        html = (await acme.get("/webhooks")).text
    async with _client(manager, "globex") as globex:
        elsewhere = (await globex.get("/webhooks")).text
    assert 'data-key-id="i:cust_42"' in html
    assert 'Identity <code class="identity">cust_42</code>' in html
    assert "identity.disabled" in html
    assert "cust_42" not in elsewhere
