"""What a key made through the management API takes of the key that made it, and what a
caller may not reach: each case one of a review's findings, which failed before."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from apikeys import KeyManager
from apikeys.api import ManagementAPI

BASE = "http://test/v1/api-keys"
WRITER = ["apikeys:read", "apikeys:write", "x:read"]


@pytest.fixture
async def client(memory_manager: KeyManager) -> AsyncIterator[httpx.AsyncClient]:
    api = ManagementAPI(memory_manager, rate_limit="100000/minute")
    app = Starlette(routes=[Mount("/v1/api-keys", app=api)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as c:
        yield c


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_key_made_by_a_key_of_an_identity_belongs_to_it_with_the_callers_limits(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    await memory_manager.create_identity("cust", workspace="acme", credits=2, rate_limit="2/minute")
    caller = await memory_manager.create(
        name="mgmt",
        workspace="acme",
        identity="cust",
        scopes=WRITER,
        rate_limit="5/minute",
        allowed_ips=["127.0.0.0/8"],
    )
    made = await client.post(
        "/keys", json={"name": "made", "scopes": ["x:read"]}, headers=_auth(caller.key)
    )
    assert made.status_code == 201, made.text
    body = made.json()
    # The identity's limits and credits bound it; its own are the caller's.
    assert body["identity"] == "cust"
    assert body["rate_limit"] == "5/minute"
    assert body["allowed_ips"] == ["127.0.0.0/8"]
    assert body["environment"] == caller.record.environment


async def test_a_key_with_credits_of_its_own_makes_no_keys(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    caller = await memory_manager.create(name="mgmt", workspace="acme", scopes=WRITER, credits=5)
    before = len(await memory_manager.list("acme"))
    made = await client.post("/keys", json={"name": "made"}, headers=_auth(caller.key))
    assert made.status_code == 403
    assert made.json()["code"] == "forbidden_field"
    assert len(await memory_manager.list("acme")) == before


async def test_a_full_access_key_without_apikeys_admin_changes_no_identity(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    # (Its limit is the management calls' own too: they are requests of its keys.)
    await memory_manager.create_identity("cust_42", workspace="acme", rate_limit="1000/minute")
    customer = await memory_manager.create(
        name="ci", workspace="acme", full_access=True, identity="cust_42"
    )
    lifted = await client.patch(
        "/identities/cust_42",
        json={"rate_limit": None},
        headers=_auth(customer.key),
    )
    assert lifted.status_code == 403
    assert lifted.json()["code"] == "insufficient_scope"
    for verb in ("disable", "enable", "revoke"):
        answer = await client.post(f"/identities/cust_42/{verb}", headers=_auth(customer.key))
        assert answer.status_code == 403, verb
    made = await client.post("/identities", json={"name": "C43"}, headers=_auth(customer.key))
    assert made.status_code == 403
    identity = await memory_manager.get_identity("cust_42")
    assert (identity.rate_limit, identity.state) == ("1000/minute", "active")
    # A key whose scopes name apikeys:admin does (an operator's grant).
    admin = await memory_manager.create(
        name="ops", workspace="acme", scopes=["apikeys:read", "apikeys:admin"]
    )
    changed = await client.patch(
        "/identities/cust_42", json={"credits": 10}, headers=_auth(admin.key)
    )
    assert changed.status_code == 200, changed.text


async def test_a_test_key_makes_test_keys_and_never_sees_live_ones(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    live = await memory_manager.create(name="live", workspace="acme", scopes=["x:read"])
    tester = await memory_manager.create(
        name="sandbox", workspace="acme", environment="test", scopes=WRITER
    )
    auth = _auth(tester.key)
    made = await client.post("/keys", json={"name": "made", "scopes": ["x:read"]}, headers=auth)
    assert made.status_code == 201, made.text
    assert made.json()["environment"] == "test"
    assert made.json()["key"].startswith("ak_test_")
    chosen = await client.post("/keys", json={"name": "live", "environment": "live"}, headers=auth)
    assert chosen.status_code == 400  # not a field a caller sends: its key's is taken
    unknown = await client.get("/keys/AAAAAAAAAAAA", headers=auth)
    for answer in (
        await client.get(f"/keys/{live.record.id}", headers=auth),
        await client.patch(f"/keys/{live.record.id}", json={"name": "x"}, headers=auth),
        await client.post(f"/keys/{live.record.id}/revoke", headers=auth),
        await client.post(f"/keys/{live.record.id}/roll", headers=auth),
    ):
        assert (answer.status_code, answer.json()) == (unknown.status_code, unknown.json())
    listed = await client.get("/keys", headers=auth)
    assert {item["environment"] for item in listed.json()["items"]} == {"test"}
    other = await client.get("/keys?environment=live", headers=auth)
    assert other.status_code == 200
    assert other.json()["items"] == []
    assert (await memory_manager.get(live.record.id)).status == "active"


@pytest.mark.parametrize("when", ["9999-12-31T23:59:59-01:00", "0001-01-01T00:00:00+01:00"])
async def test_a_time_at_the_edges_of_the_calendar_is_a_clear_400(
    client: httpx.AsyncClient, memory_manager: KeyManager, when: str
) -> None:
    caller = await memory_manager.create(name="mgmt", workspace="acme", full_access=True)
    made = await client.post(
        "/keys", json={"name": "x", "access": "full", "expires_at": when}, headers=_auth(caller.key)
    )
    assert made.status_code == 400, made.text
    edited = await client.patch(
        f"/keys/{caller.record.id}", json={"expires_at": when}, headers=_auth(caller.key)
    )
    assert edited.status_code == 400, edited.text


async def test_a_test_key_reads_no_live_keys_audit_trail(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    live = await memory_manager.create(name="live", workspace="acme", scopes=["x:read"])
    await memory_manager.disable(live.record.id)
    tester = await memory_manager.create(
        name="sandbox", workspace="acme", environment="test", scopes=WRITER
    )
    auth = _auth(tester.key)
    theirs = await client.get(f"/audit?key_id={live.record.id}", headers=auth)
    unknown = await client.get("/audit?key_id=AAAAAAAAAAAA", headers=auth)
    assert theirs.status_code == unknown.status_code == 200
    assert theirs.json() == unknown.json() == {"items": [], "next_cursor": None}
    own = await client.get(f"/audit?key_id={tester.record.id}", headers=auth)
    assert [event["action"] for event in own.json()["items"]] == ["created"]
    # Nor without key_id: the trail of its workspace shows its own environment's keys.
    trail = await client.get("/audit", headers=auth)
    assert {event["key_id"] for event in trail.json()["items"]} == {tester.record.id}


@pytest.mark.parametrize("holds", ["full access", "apikeys:*"])
async def test_only_a_key_that_names_apikeys_admin_grants_it(
    client: httpx.AsyncClient, memory_manager: KeyManager, holds: str
) -> None:
    # Full access and `apikeys:*` pass every other scope's ceiling, and made keys naming
    # `apikeys:admin`: the key made could then lift its own identity's limits.
    if holds == "full access":
        caller = await memory_manager.create(name="c", workspace="acme", full_access=True)
    else:
        caller = await memory_manager.create(name="c", workspace="acme", scopes=["apikeys:*"])
    asked = {"name": "m", "scopes": ["apikeys:admin", "apikeys:read"]}
    made = await client.post("/keys", json=asked, headers=_auth(caller.key))
    assert made.status_code == 403, made.text
    assert made.json()["code"] == "insufficient_scope"
    plain = await memory_manager.create(name="p", workspace="acme", scopes=["apikeys:read"])
    widened = await client.patch(
        f"/keys/{plain.record.id}",
        json={"scopes": ["apikeys:read", "apikeys:admin"]},
        headers=_auth(caller.key),
    )
    assert widened.status_code == 403, widened.text
    admin = await memory_manager.create(name="a", workspace="acme", scopes=["apikeys:admin"])
    rolled = await client.post(f"/keys/{admin.record.id}/roll", headers=_auth(caller.key))
    assert rolled.status_code == 403, rolled.text
    assert [r.name for r in await memory_manager.list("acme")] == ["c", "p", "a"]
    named = await memory_manager.create(
        name="n", workspace="acme", scopes=["apikeys:admin", "apikeys:read", "apikeys:write"]
    )
    made = await client.post("/keys", json=asked, headers=_auth(named.key))
    assert made.status_code == 201, made.text


@pytest.mark.parametrize(
    ("bound", "options"),
    [
        ("identity", {"identity": "small"}),
        ("rate_limit", {"rate_limit": "3/minute"}),
        ("allowed_ips", {"allowed_ips": ["127.0.0.0/8"]}),
        ("credits", {"credits": 3}),
    ],
)
async def test_a_bounded_caller_rolls_no_key_bounded_less_than_itself(
    client: httpx.AsyncClient,
    memory_manager: KeyManager,
    bound: str,
    options: dict[str, object],
) -> None:
    # A roll hands the caller the new secret: of a key without the caller's identity,
    # limit, allowlist or credits, it was a way out of them.
    await memory_manager.create_identity("small", workspace="acme", credits=5)
    caller = await memory_manager.create(name="c", workspace="acme", scopes=WRITER, **options)  # type: ignore[arg-type]
    free = await memory_manager.create(name="free", workspace="acme", scopes=["x:read"])
    rolled = await client.post(f"/keys/{free.record.id}/roll", headers=_auth(caller.key))
    assert rolled.status_code == 403, rolled.text
    assert rolled.json()["code"] == "forbidden_field"
    assert rolled.json()["field"] == bound
    assert (await memory_manager.get(free.record.id)).replaced_by is None
    # Itself, always: the new key is bounded as it is.
    itself = await client.post(f"/keys/{caller.record.id}/roll", headers=_auth(caller.key))
    assert itself.status_code == 201, itself.text
    if bound != "credits":  # a key with credits of its own makes none
        mine = await memory_manager.create(
            name="mine",
            workspace="acme",
            scopes=["x:read"],
            **options,  # type: ignore[arg-type]
        )
        again = await client.post(f"/keys/{mine.record.id}/roll", headers=_auth(caller.key))
        assert again.status_code == 201, again.text
