"""A property of the management API: whatever key a caller holds and whatever it asks for,
what it gets is within what it holds and what the field table lets a workspace change.

On the memory store (the rule is the API's, not the store's): each example is a fresh
manager, a caller key with some scopes (or full access) and maybe an expiry, a create or
an update body drawn from every key field, and the record as the store has it after."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from apikeys import GrantedScopes, Hasher, KeyManager, MemoryStore
from apikeys.api import ManagementAPI
from apikeys.fields import KEY_FIELDS, workspace_may_change
from apikeys.types import KeyRecord, utcnow
from tests.conftest import TEST_PEPPER

POOL = [
    "contacts:read",
    "contacts:write",
    "billing:read",
    "admin:all",
    "apikeys:read",
    "apikeys:admin",
    "apikeys:*",
]
NOW = utcnow()
OPERATOR_VALUES: dict[str, Any] = {
    "rate_limit": "5/second",
    "owner": "ann",
    "metadata": {"plan": "gold"},
    "allowed_ips": ["10.0.0.0/8"],
    "credits": 7,
    "credit_refill": "10/day",
    "identity": "cust",
}

callers = st.fixed_dictionaries(
    {
        "full": st.booleans(),
        "scopes": st.lists(st.sampled_from(POOL), unique=True),
        "expires_in_hours": st.none() | st.integers(1, 240),
    }
)


def moments() -> st.SearchStrategy[str | None]:
    hours = st.integers(1, 480).map(lambda h: (NOW + timedelta(hours=h)).isoformat())
    return st.none() | hours


bodies = st.fixed_dictionaries(
    {},
    optional={
        "name": st.sampled_from(["a", "b"]),
        "access": st.sampled_from(["full", "restricted"]),
        "scopes": st.lists(st.sampled_from(POOL), unique=True),
        "expires_at": moments(),
        **{name: st.just(value) for name, value in OPERATOR_VALUES.items()},
    },
)


def within(record: KeyRecord, caller: KeyRecord, asked: dict[str, Any], created: bool) -> None:
    """`record` (made, or changed as `asked`) holds no more than `caller`: what it was
    given of scopes and expiry (on create, all of them) is within the caller's."""
    assert record.workspace == caller.workspace
    if (created or "scopes" in asked or "access" in asked) and not caller.full_access:
        assert not record.full_access
        granted = GrantedScopes(caller.scopes)  # `apikeys:*` covers `apikeys:read`
        assert all(scope in granted for scope in record.scopes), record.scopes
    if (created or "scopes" in asked) and "apikeys:admin" in record.scopes:
        # Granted only by a key that names it: full access and apikeys:* do not give it.
        assert "apikeys:admin" in caller.scopes
    if caller.expires_at is not None and (created or "expires_at" in asked):
        assert record.expires_at is not None
        assert record.expires_at <= caller.expires_at


async def _run(caller_spec: dict[str, Any], body: dict[str, Any], update: bool) -> None:
    async with KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER)) as manager:
        await manager.create_identity("cust", workspace="acme")
        scopes = ["apikeys:write", *caller_spec["scopes"]]
        hours = caller_spec["expires_in_hours"]
        expires = None if hours is None else timedelta(hours=hours)
        made = await manager.create(
            name="caller",
            workspace="acme",
            full_access=caller_spec["full"],
            scopes=() if caller_spec["full"] else scopes,
            expires_in=expires,
        )
        caller = made.record
        target = await manager.create(
            name="target",
            workspace="acme",
            scopes=["contacts:read", "billing:read"],
            expires_in=timedelta(hours=100),
        )
        api = ManagementAPI(manager, rate_limit="100000/minute")
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            auth = {"Authorization": f"Bearer {made.key}"}
            if update:
                answer = await client.patch(f"/keys/{target.record.id}", json=body, headers=auth)
            else:
                answer = await client.post("/keys", json={"name": "new", **body}, headers=auth)
        records = {record.id: record for record in await manager.list("acme")}
        if answer.status_code in (200, 201):
            # Nothing of the operator's was set, and the rest is within the caller's.
            assert not any(name in body for name in OPERATOR_VALUES)
            assert all(workspace_may_change(name) for name in body)
            changed = records[answer.json()["id"]]
            within(changed, caller, body, created=not update)
            if not update:
                operator_values = [getattr(changed, name) for name in OPERATOR_VALUES]
                assert all(value in (None, (), {}) for value in operator_values)
            elif "expires_at" in body:
                assert changed.expires_at is not None
                assert target.record.expires_at is not None
                assert changed.expires_at <= target.record.expires_at
        else:
            assert answer.status_code in (400, 403), answer.text
            assert len(records) == 2  # nothing made
            assert records[target.record.id] == target.record  # nothing changed


@settings(max_examples=150)
@given(caller=callers, body=bodies, update=st.booleans())
def test_what_the_api_grants_is_within_what_the_caller_holds(
    caller: dict[str, Any], body: dict[str, Any], update: bool
) -> None:
    asyncio.run(_run(caller, body, update))


def test_the_property_draws_every_key_field() -> None:
    drawn = {"name", "access", "scopes", "expires_at", *OPERATOR_VALUES}
    assert drawn == set(KEY_FIELDS)
    assert isinstance(NOW, datetime)


async def _roll(caller_spec: dict[str, Any], target_spec: dict[str, Any]) -> None:
    async with KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER)) as manager:
        hours = caller_spec["expires_in_hours"]
        made = await manager.create(
            name="caller",
            workspace="acme",
            full_access=caller_spec["full"],
            scopes=() if caller_spec["full"] else ["apikeys:write", *caller_spec["scopes"]],
            expires_in=None if hours is None else timedelta(hours=hours),
        )
        target = await manager.create(
            name="target",
            workspace="acme",
            full_access=target_spec["full"],
            scopes=() if target_spec["full"] else target_spec["scopes"],
        )
        api = ManagementAPI(manager, rate_limit="100000/minute")
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            answer = await client.post(
                f"/keys/{target.record.id}/roll",
                json={"grace_seconds": 0},
                headers={"Authorization": f"Bearer {made.key}"},
            )
        records = {record.id: record for record in await manager.list("acme")}
        if answer.status_code == 201:
            # The caller holds the new key's secret: it is a key the caller made.
            within(records[answer.json()["id"]], made.record, {}, created=True)
        else:
            assert answer.status_code == 403, answer.text
            assert len(records) == 2


@settings(max_examples=100)
@given(
    caller=callers,
    target=st.fixed_dictionaries(
        {"full": st.booleans(), "scopes": st.lists(st.sampled_from(POOL), min_size=1, unique=True)}
    ),
)
def test_a_roll_never_hands_the_caller_a_key_beyond_its_own(
    caller: dict[str, Any], target: dict[str, Any]
) -> None:
    asyncio.run(_roll(caller, target))


identity_bodies = st.fixed_dictionaries(
    {},
    optional={
        "id": st.sampled_from(["cust", "globex-cust", "idn_" + "A" * 22]),
        "name": st.sampled_from(["Cust", ""]),
        "metadata": st.just({"customer": "cust"}),
        "rate_limit": st.sampled_from(["5/second", "nonsense"]),
        "credits": st.integers(-1, 10),
        "credit_refill": st.just("10/day"),
        "workspace": st.just("globex"),
    },
)


async def _create_identity(caller_spec: dict[str, Any], admin: bool, body: dict[str, Any]) -> None:
    async with KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER)) as manager:
        await manager.create_identity("globex-cust", workspace="globex")
        scopes = ["apikeys:read", *(["apikeys:admin"] if admin else []), *caller_spec["scopes"]]
        made = await manager.create(
            name="caller",
            workspace="acme",
            full_access=caller_spec["full"],
            scopes=() if caller_spec["full"] else scopes,
        )
        api = ManagementAPI(manager, rate_limit="100000/minute")
        transport = httpx.ASGITransport(app=api)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            answer = await client.post(
                "/identities", json=body, headers={"Authorization": f"Bearer {made.key}"}
            )
        made_ones = [one for one in await manager.list_identities() if one.id != "globex-cust"]
        if answer.status_code == 201:
            # Only a caller whose scopes name apikeys:admin, in its own workspace, under an
            # id the API drew: never one the body named.
            assert admin or "apikeys:admin" in caller_spec["scopes"]
            assert not caller_spec["full"]
            assert "id" not in body
            assert "workspace" not in body
            assert [one.id for one in made_ones] == [answer.json()["id"]]
            assert made_ones[0].id.startswith("idn_")
            assert made_ones[0].workspace == "acme"
        else:
            assert answer.status_code in (400, 403), answer.text
            assert made_ones == []
        assert (await manager.get_identity("globex-cust")).workspace == "globex"


@settings(max_examples=100)
@given(caller=callers, admin=st.booleans(), body=identity_bodies)
def test_an_identity_made_through_the_api_is_the_callers_workspaces_under_a_drawn_id(
    caller: dict[str, Any], admin: bool, body: dict[str, Any]
) -> None:
    asyncio.run(_create_identity(caller, admin, body))
