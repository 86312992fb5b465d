"""Cursor pages of the management API's identities and audit trail, on every store: a walk
sees each of the caller's rows once and no one else's, a cursor that was not made here is
a 400, and one made for another workspace names a place in the caller's own rows only.
The audit trail shows the caller's environment: the events of its environment's keys and
its workspace's identities."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from apikeys import KeyManager
from apikeys.api import ManagementAPI
from apikeys.listing import encode_cursor, encode_trail_cursor
from apikeys.types import utcnow

SCOPES = ["apikeys:read", "apikeys:write", "apikeys:admin"]


@pytest.fixture
async def client(manager: KeyManager) -> AsyncIterator[httpx.AsyncClient]:
    api = ManagementAPI(manager, rate_limit="100000/minute")
    transport = httpx.ASGITransport(app=api)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as made:
        yield made


async def auth(manager: KeyManager, workspace: str, environment: str = "live") -> dict[str, str]:
    made = await manager.create(
        name="ops",
        workspace=workspace,
        environment=environment,  # type: ignore[arg-type]
        scopes=SCOPES,
    )
    return {"Authorization": f"Bearer {made.key}"}


async def walk(
    client: httpx.AsyncClient, path: str, headers: dict[str, str], limit: int
) -> list[list[dict[str, Any]]]:
    """Every page of `path`, following `next_cursor` from the first."""
    pages: list[list[dict[str, Any]]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": limit}
        if cursor is not None:
            params["cursor"] = cursor
        answer = await client.get(path, params=params, headers=headers)
        assert answer.status_code == 200, answer.text
        pages.append(answer.json()["items"])
        cursor = answer.json()["next_cursor"]
        if cursor is None:
            return pages
        assert len(pages) < 100


async def test_identities_come_in_pages_of_the_callers_workspace_only(
    client: httpx.AsyncClient, manager: KeyManager
) -> None:
    acme = await auth(manager, "acme")
    globex = await auth(manager, "globex")
    mine = [(await manager.create_identity(f"a{n}", workspace="acme")).id for n in range(7)]
    for n in range(3):
        await manager.create_identity(f"g{n}", workspace="globex")
    pages = await walk(client, "/identities", acme, limit=3)
    assert [len(page) for page in pages] == [3, 3, 1]
    assert [item["id"] for page in pages for item in page] == mine
    # A cursor of globex's walk names a place; acme's rows after it are all it shows.
    theirs = await client.get("/identities", params={"limit": 1}, headers=globex)
    cursor = theirs.json()["next_cursor"]
    assert cursor is not None
    shown = await client.get("/identities", params={"cursor": cursor}, headers=acme)
    assert shown.status_code == 200
    assert {item["id"] for item in shown.json()["items"]} <= set(mine)


async def test_the_audit_trail_comes_in_pages_newest_first_without_gaps_or_repeats(
    client: httpx.AsyncClient, manager: KeyManager
) -> None:
    acme = await auth(manager, "acme")
    for n in range(5):
        made = await manager.create(name=f"k{n}", workspace="acme", scopes=["x:read"])
        await manager.update(made.record.id, name=f"key {n}")
    await manager.create_identity("acme-1", workspace="acme")
    await manager.create(name="g", workspace="globex", scopes=["x:read"])
    trail = [event.to_dict() for event in await manager.audit(workspace="acme")]
    assert len(trail) == 12
    first = await client.get("/audit", params={"limit": 5}, headers=acme)
    assert first.json()["items"] == trail[-5:]  # the newest, newest last
    # A change made during the walk sorts after everything read: nothing shifts.
    await manager.disable(trail[1]["key_id"])  # k0 (the first is the caller)
    rest = [first.json()["items"]]
    cursor = first.json()["next_cursor"]
    while cursor is not None:
        page = await client.get("/audit", params={"limit": 5, "cursor": cursor}, headers=acme)
        assert page.status_code == 200, page.text
        rest.append(page.json()["items"])
        cursor = page.json()["next_cursor"]
    assert [len(page) for page in rest] == [5, 5, 2]
    assert [event for page in reversed(rest) for event in page] == trail
    newest = await client.get("/audit", params={"limit": 1}, headers=acme)
    assert newest.json()["items"][0]["action"] == "disabled"
    # A cursor of globex's walk names a count; acme's events are all it shows.
    globex = await auth(manager, "globex")
    theirs = await client.get("/audit", params={"limit": 1}, headers=globex)
    cursor = theirs.json()["next_cursor"]
    assert cursor is not None
    shown = await client.get("/audit", params={"cursor": cursor}, headers=acme)
    assert shown.status_code == 200
    assert shown.json()["items"]
    assert {item["workspace"] for item in shown.json()["items"]} == {"acme"}


async def test_the_audit_trail_of_a_caller_shows_its_environment_and_its_identities(
    client: httpx.AsyncClient, manager: KeyManager
) -> None:
    live = await auth(manager, "acme")
    test = await auth(manager, "acme", "test")
    live_key = await manager.create(name="l", workspace="acme", scopes=["x:read"])
    test_key = await manager.create(
        name="t", workspace="acme", environment="test", scopes=["x:read"]
    )
    await manager.create_identity("acme-1", workspace="acme")
    await manager.create_identity("globex-1", workspace="globex")
    seen = {}
    for label, headers in (("live", live), ("test", test)):
        pages = await walk(client, "/audit", headers, limit=2)
        seen[label] = {item["key_id"] for page in pages for item in page}
    assert live_key.record.id in seen["live"]
    assert test_key.record.id in seen["test"]
    assert live_key.record.id not in seen["test"]
    assert test_key.record.id not in seen["live"]
    # An identity belongs to no environment: both see its events, as both read it.
    assert "i:acme-1" in seen["live"] & seen["test"]
    assert "i:globex-1" not in seen["live"] | seen["test"]
    live_keys = {record.id for record in await manager.list("acme", environment="live")}
    assert seen["live"] - {"i:acme-1"} == live_keys


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


@pytest.mark.parametrize("path", ["/identities", "/audit", "/keys"])
async def test_a_cursor_not_made_for_the_listing_is_a_400_never_a_500(
    client: httpx.AsyncClient, manager: KeyManager, path: str
) -> None:
    acme = await auth(manager, "acme")
    wrong_kind = encode_cursor((utcnow(), "a1")) if path == "/audit" else encode_trail_cursor(3)
    for cursor in (
        "x",
        "!!!!",
        "%00",
        _b64("1.99999999999999999999.a"),
        _b64("t1.0"),
        _b64("t1.-4"),
        _b64("t1.99999999999999999999"),
        _b64("1.5."),
        "é" * 10,
        wrong_kind,
    ):
        answer = await client.get(path, params={"cursor": cursor}, headers=acme)
        assert answer.status_code == 400, (cursor, answer.text)
        assert answer.json()["code"] == "invalid_payload"
