"""What every store's `IdentityStore` guarantees, checked on each store of the table.

The `store` fixture runs each test on memory, SQLite, PostgreSQL and Redis. The memory store
is the reference: every other store must answer exactly as it does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from apikeys.errors import DuplicateIdentity, IdentityNotFound
from apikeys.identities import IdentityRecord
from apikeys.listing import position
from apikeys.stores import KeyStore
from apikeys.stores.contract import Channel, IdentityStore, parse_notice
from apikeys.stores.redis import RedisStore
from apikeys.stores.sql import SQLStore
from apikeys.types import AuditEvent, identity_subject
from tests.conftest import SCALE_OUT_STORES, STORES
from tests.stores.test_change_log import run_sql


@pytest.fixture(params=[*STORES, SCALE_OUT_STORES[0]])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Every store of the table, and the Redis store on a cluster (an identity's hash and
    audit list share its `{i:<id>}` slot)."""
    return str(request.param)


T0 = datetime(2026, 1, 31, 12, 0, 0, 123456, tzinfo=UTC)


def make_identity(identity_id: str = "acme", **fields: Any) -> IdentityRecord:
    values: dict[str, Any] = {
        "id": identity_id,
        "workspace": "w1",
        "state": "active",
        "created_at": T0,
    }
    values.update(fields)
    return IdentityRecord(**values)


def event(identity_id: str, action: Any, **changes: Any) -> AuditEvent:
    return AuditEvent(
        time=T0 + timedelta(seconds=1),
        key_id=identity_subject(identity_id),
        workspace="w1",
        action=action,
        actor="tester",
        changes=changes,
    )


def identities_of(store: KeyStore) -> IdentityStore:
    identities = store.identities()
    assert identities is not None
    return identities


class TestRecords:
    async def test_if_inserted_then_get_returns_every_field_equal(self, store: KeyStore) -> None:
        identities = identities_of(store)
        record = make_identity(
            "Acme.Corp+eu@x-1",
            workspace="acme-eu",
            name="Acme “EU” ✓",
            metadata={"plan": "pro", "seats": 3, "tags": ["a", "b"]},
            rate_limit="burst=10/second, daily=10000/day",
            credits=2**40 + 7,
            credit_refill="1000/day",
            credits_refilled_at=T0 - timedelta(hours=12),
        )
        await identities.insert(record)

        assert await identities.get(record.id) == record
        assert await identities.get("unknown") is None

    async def test_get_to_cache_reads_what_get_reads(self, store: KeyStore) -> None:
        identities = identities_of(store)
        await identities.insert(make_identity(name="cached"))

        assert await identities.get_to_cache("acme") == (await identities.get("acme"), True)
        assert await identities.get_to_cache("nobody") == (None, True)

    async def test_if_optional_fields_are_empty_then_they_come_back_empty(
        self, store: KeyStore
    ) -> None:
        identities = identities_of(store)
        await identities.insert(make_identity())

        got = await identities.get("acme")

        assert got == make_identity()
        assert got is not None
        assert got.metadata == {}
        assert got.credits is None

    async def test_if_id_is_taken_then_insert_refuses_and_keeps_the_first(
        self, store: KeyStore
    ) -> None:
        identities = identities_of(store)
        await identities.insert(make_identity(name="first"))

        with pytest.raises(DuplicateIdentity):
            await identities.insert(make_identity(name="second", workspace="w2"))

        got = await identities.get("acme")
        assert got is not None
        assert got.name == "first"
        assert got.workspace == "w1"

    async def test_list_is_per_workspace_oldest_first(self, store: KeyStore) -> None:
        identities = identities_of(store)
        made = [
            make_identity("b", created_at=T0),
            make_identity("a", created_at=T0),
            make_identity("c", created_at=T0 - timedelta(days=1)),
            make_identity("d", workspace="w2", created_at=T0 - timedelta(days=2)),
        ]
        for record in made:
            await identities.insert(record)

        assert [r.id for r in await identities.list("w1")] == ["c", "a", "b"]
        assert [r.id for r in await identities.list()] == ["d", "c", "a", "b"]
        assert await identities.list("nobody") == []
        first = await identities.list_page("w1", start=None, limit=2)
        rest = await identities.list_page("w1", start=position(first[-1]), limit=2)
        assert [r.id for r in first + rest] == ["c", "a", "b"]

    async def test_if_keys_name_an_identity_then_they_are_listed_apart(
        self, store: KeyStore
    ) -> None:
        # Keys and identities share the store: neither shows up among the other.
        identities = identities_of(store)
        await identities.insert(make_identity())

        assert await store.list("w1") == []
        assert await store.get("acme") is None


class TestChanges:
    async def test_update_sets_and_clears_fields_with_its_event(self, store: KeyStore) -> None:
        identities = identities_of(store)
        await identities.insert(make_identity(name="old", metadata={"a": 1}, credits=5))

        updated = await identities.update(
            "acme",
            {"name": "new", "metadata": {}, "credits": None, "rate_limit": "5/second"},
            event=event("acme", "identity.updated", name="new"),
        )

        assert updated == make_identity(name="new", rate_limit="5/second")
        assert await identities.get("acme") == updated
        [logged] = await store.audit(key_id=identity_subject("acme"))
        assert logged.action == "identity.updated"
        assert logged.identity == "acme"
        assert logged.changes == {"name": "new"}

    async def test_state_changes_and_revoked_is_final(self, store: KeyStore) -> None:
        identities = identities_of(store)
        await identities.insert(make_identity(), event=event("acme", "identity.created"))
        at = T0 + timedelta(hours=1)

        disabled = await identities.set_state(
            "acme",
            "disabled",
            allowed_from=("active",),
            at=at,
            event=event("acme", "identity.disabled"),
        )
        again = await identities.set_state(
            "acme",
            "disabled",
            allowed_from=("active",),
            at=at,
            event=event("acme", "identity.disabled"),
        )
        revoked = await identities.set_state(
            "acme",
            "revoked",
            allowed_from=("active", "disabled"),
            at=at,
            event=event("acme", "identity.revoked"),
        )
        enabled = await identities.set_state(
            "acme",
            "active",
            allowed_from=("disabled",),
            at=at,
            event=event("acme", "identity.enabled"),
        )
        edited = await identities.update(
            "acme", {"name": "late"}, event=event("acme", "identity.updated")
        )

        assert (disabled.state, again.state, revoked.state) == ("disabled", "disabled", "revoked")
        assert enabled.state == "revoked"
        assert edited == revoked
        assert revoked.revoked_at == at
        assert await identities.get("acme") == revoked
        actions = [e.action for e in await store.audit(key_id=identity_subject("acme"))]
        assert actions == ["identity.created", "identity.disabled", "identity.revoked"]
        assert [e.action for e in await store.audit(workspace="w1")] == actions

    async def test_if_identity_is_unknown_then_changes_raise(self, store: KeyStore) -> None:
        identities = identities_of(store)

        with pytest.raises(IdentityNotFound):
            await identities.update("nobody", {"name": "x"})
        with pytest.raises(IdentityNotFound):
            await identities.set_state("nobody", "disabled", allowed_from=("active",), at=T0)
        assert await store.audit(key_id=identity_subject("nobody")) == []


class Heard:
    """The notices a store's channel delivers, by the name `parse_notice` gives them."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.names: list[str] = []

    def __call__(self, notice: str) -> None:
        self.names.append(parse_notice(notice)[1])

    async def heard(self) -> list[str]:
        """The names heard since the last call, once every committed change has arrived
        (`Channel.probe`)."""
        await self.channel.probe()
        names, self.names = self.names, []
        return names


@pytest.fixture
async def heard(store: KeyStore) -> AsyncIterator[Heard]:
    channel = store.channel()
    if channel is None:
        pytest.skip("the memory store has no channel: nothing to tell")
    listener = Heard(channel)
    channel.bind()
    await channel.connect("reader", listener)
    try:
        yield listener
    finally:
        await channel.disconnect()


class TestNotices:
    async def test_every_write_publishes_its_notice(self, store: KeyStore, heard: Heard) -> None:
        identities = identities_of(store)

        await identities.insert(make_identity())
        assert "i:acme" in await heard.heard()
        await identities.update("acme", {"name": "x"}, notice="writer:1:i:acme")
        assert "i:acme" in await heard.heard()
        await identities.set_state(
            "acme", "disabled", allowed_from=("active",), at=T0, notice="writer:2:i:acme"
        )
        assert "i:acme" in await heard.heard()
        # A change that changes nothing still publishes the notice it was given.
        await identities.update("acme", {}, notice="writer:3:i:acme")
        assert "i:acme" in await heard.heard()

    async def test_if_another_client_writes_an_identity_then_it_is_heard(
        self, store: KeyStore, heard: Heard
    ) -> None:
        # Whoever writes (CONTRACT section 3): `psql`, `sqlite3`, `redis-cli` on the row or
        # hash of an identity reach every reader as `i:<id>`, as for a key.
        identities = identities_of(store)
        await identities.insert(make_identity())
        await heard.heard()

        await write_by_hand(store, "acme", "state", "disabled")

        assert "i:acme" in await heard.heard()
        got = await identities.get("acme")
        assert got is not None
        assert got.state == "disabled"


async def write_by_hand(store: KeyStore, identity_id: str, field: str, value: str) -> None:
    """Set one field of an identity as another client would: `sqlite3`, `psql`,
    `redis-cli HSET`, with no apikeys code on the way."""
    if isinstance(store, SQLStore):
        table = f"{store.table.name}_identities"
        sql = f'UPDATE "{table}" SET "{field}" = $1 WHERE id = $2'  # noqa: S608
        await run_sql(store, sql, value, identity_id)
        return
    assert isinstance(store, RedisStore)
    await store.client.hset(store.identities().hash_name(identity_id), field, value)
