"""Identities through `KeyManager`: the record, its changes, and the keys that belong to it.

Store-independent rules run once, on the memory store; the stores' own guarantees are
`tests/stores/test_identity_conformance.py`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apikeys import Hasher, KeyManager, KeyStore, MemoryStore
from apikeys.errors import (
    DuplicateIdentity,
    ForbiddenField,
    IdentityNotFound,
    InvalidKeyParameters,
    InvalidTransition,
)
from apikeys.fields import Role, check_change
from apikeys.identities import IDENTITY_ID_PATTERN, check_identity_id


@pytest.fixture
async def manager() -> AsyncIterator[KeyManager]:
    async with KeyManager(MemoryStore(), webhooks=False) as made:
        yield made


async def test_create_identity_then_get_and_list(manager: KeyManager) -> None:
    made = await manager.create_identity(
        "acme",
        workspace="w1",
        name="Acme",
        metadata={"plan": "pro"},
        rate_limit="burst=10/second, daily=1000/day",
        credit_refill="500/day",
        actor="ops",
    )

    assert made.state == "active"
    assert made.credits == 500
    assert made.rate_limits == (
        {"name": "burst", "limit": "10/second"},
        {"name": "daily", "limit": "1000/day"},
    )
    assert await manager.get_identity("acme") == made
    assert await manager.list_identities("w1") == [made]
    assert await manager.list_identities("w2") == []
    [created] = await manager.audit(key_id="i:acme")
    assert created.action == "identity.created"
    assert created.actor == "ops"
    assert created.changes["name"] == "Acme"
    with pytest.raises(DuplicateIdentity):
        await manager.create_identity("acme", workspace="w2")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rate_limit", "lots"),
        ("credit_refill", "5/fortnight"),
        ("credits", -1),
        ("metadata", "[1]"),
        ("name", ""),
    ],
)
async def test_if_a_field_is_bad_then_create_refuses_and_stores_nothing(
    manager: KeyManager, field: str, value: object
) -> None:
    with pytest.raises(InvalidKeyParameters):
        await manager.create_identity("acme", workspace="w1", **{field: value})  # type: ignore[arg-type]
    assert await manager.list_identities() == []


async def test_update_and_state_changes_and_revoked_is_final(manager: KeyManager) -> None:
    await manager.create_identity("acme", workspace="w1", credits=10)

    updated = await manager.update_identity("acme", name="Acme Inc", credits=None)
    disabled = await manager.disable_identity("acme", actor="ops")
    enabled = await manager.enable_identity("acme")
    revoked = await manager.revoke_identity("acme")

    assert updated.name == "Acme Inc"
    assert updated.credits is None
    assert (disabled.state, enabled.state, revoked.state) == ("disabled", "active", "revoked")
    with pytest.raises(InvalidTransition, match="cannot enable identity 'acme'"):
        await manager.enable_identity("acme")
    with pytest.raises(InvalidTransition):
        await manager.update_identity("acme", name="late")
    with pytest.raises(TypeError):
        await manager.update_identity("acme", workspace="w2")  # type: ignore[call-arg]
    with pytest.raises(IdentityNotFound):
        await manager.disable_identity("nobody")
    actions = [event.action for event in await manager.audit(workspace="w1")]
    assert actions == [
        "identity.created",
        "identity.updated",
        "identity.disabled",
        "identity.enabled",
        "identity.revoked",
    ]


async def test_key_of_an_identity_is_created_moved_and_listed(manager: KeyManager) -> None:
    await manager.create_identity("acme", workspace="w1")
    await manager.create_identity("globex", workspace="w1")
    created = await manager.create(
        name="k1", workspace="w1", full_access=True, identity="acme", actor="ops"
    )
    other = await manager.create(name="k2", workspace="w1", full_access=True)

    assert created.record.identity == "acme"
    assert created.record.to_dict()["identity"] == "acme"
    assert [r.id for r in await manager.list("w1", identity="acme")] == [created.record.id]
    moved = await manager.update(other.record.id, identity="globex")
    assert moved.identity == "globex"
    page = await manager.list_page("w1", identity="globex")
    assert [r.id for r in page.records] == [other.record.id]
    cleared = await manager.update(other.record.id, identity=None)
    assert cleared.identity is None
    rolled = await manager.roll(created.record.id)
    assert rolled.record.identity == "acme"


async def test_if_identity_is_unknown_elsewhere_or_revoked_then_the_key_is_refused(
    manager: KeyManager,
) -> None:
    await manager.create_identity("acme", workspace="w1")
    await manager.create_identity("gone", workspace="w1")
    await manager.revoke_identity("gone")
    key = await manager.create(name="k", workspace="w1", full_access=True)

    for identity, error, why in [
        ("nobody", IdentityNotFound, "no identity with id 'nobody' in workspace 'w1'"),
        ("gone", InvalidTransition, "cannot add a key to identity 'gone': it is revoked"),
        ("bad id", InvalidKeyParameters, "invalid identity"),
    ]:
        with pytest.raises(error, match=why):
            await manager.create(name="k", workspace="w1", full_access=True, identity=identity)
        with pytest.raises(error, match=why):
            await manager.update(key.record.id, identity=identity)
    # Another workspace's identity answers as an unknown one.
    with pytest.raises(IdentityNotFound, match="no identity with id 'acme' in workspace 'w2'"):
        await manager.create(name="k", workspace="w2", full_access=True, identity="acme")
    assert len(await manager.list()) == 1
    assert (await manager.get(key.record.id)).identity is None


def test_a_workspace_user_cannot_set_a_keys_identity() -> None:
    with pytest.raises(ForbiddenField) as refused:
        check_change({"identity": "acme"}, role=Role.WORKSPACE)
    assert refused.value.field == "identity"
    check_change({"identity": "acme"}, role=Role.OPERATOR)


@given(st.from_regex(IDENTITY_ID_PATTERN, fullmatch=True))
def test_valid_identity_ids_are_accepted(identity_id: str) -> None:
    assert check_identity_id(identity_id) == identity_id


@settings(max_examples=300)
@given(st.text(max_size=80) | st.from_regex(r"[a-z]{1,5}[:/{} \n][a-z]{0,5}", fullmatch=True))
def test_invalid_identity_ids_are_refused_with_a_clear_error(text: str) -> None:
    if IDENTITY_ID_PATTERN.fullmatch(text) and len(text) <= 64:
        return
    with pytest.raises(InvalidKeyParameters, match="an identity id is 1 to 64 characters"):
        check_identity_id(text)


@pytest.mark.parametrize("bad", ["", "a" * 65, "a:b", "a/b", "{a}", "a b", "-a", "é", 7, None])
async def test_if_the_id_is_bad_then_create_identity_refuses_it(
    manager: KeyManager, bad: object
) -> None:
    with pytest.raises(InvalidKeyParameters, match="invalid identity id"):
        await manager.create_identity(bad, workspace="w1")  # type: ignore[arg-type]
    assert await manager.list_identities() == []


@pytest.fixture
async def store_manager(store: KeyStore, hasher: Hasher) -> AsyncIterator[KeyManager]:
    """A `KeyManager` with its key cache (on for SQLite, PostgreSQL and Redis), on each
    store of the table: identity changes go through the cache's `change` as `i:<id>`."""
    made = KeyManager(store, hasher=hasher, webhooks=False)
    yield made
    await made.aclose()


async def test_identity_changes_through_a_caching_manager_on_every_store(
    store_manager: KeyManager,
) -> None:
    manager = store_manager
    await manager.create_identity("acme", workspace="w1", rate_limit="10/second")
    created = await manager.create(name="k", workspace="w1", full_access=True, identity="acme")
    await manager.verify(created.key)  # the key is cached now, where there is a cache

    await manager.update_identity("acme", credits=5)
    await manager.disable_identity("acme")
    await manager.enable_identity("acme")
    revoked = await manager.revoke_identity("acme")

    assert revoked.state == "revoked"
    assert revoked.credits == 5
    assert (await manager.get(created.record.id)).identity == "acme"
    assert [r.id for r in await manager.list_identities("w1")] == ["acme"]
    actions = [event.action for event in await manager.audit(key_id="i:acme")]
    assert actions == [
        "identity.created",
        "identity.updated",
        "identity.disabled",
        "identity.enabled",
        "identity.revoked",
    ]
    with pytest.raises(InvalidTransition):
        await manager.update(created.record.id, identity="acme")
