"""The audit trail on every store: one event per change, written with it (CONTRACT §9)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest

from apikeys import InvalidTransition, KeyManager
from apikeys.keys import parse_key
from apikeys.types import AUDIT_ACTIONS, AuditEvent


async def test_every_change_appends_one_event_with_its_actor(manager: KeyManager) -> None:
    before = datetime.now(UTC)
    created = await manager.create(
        name="Zapier", workspace="acme", scopes=["contacts:read"], actor="alice"
    )
    key_id = created.record.id
    await manager.update(key_id, scopes=["contacts:read", "contacts:write"], actor="bob")
    await manager.disable(key_id, actor="carol")
    await manager.enable(key_id, actor="carol")
    rolled = await manager.roll(key_id, grace=timedelta(hours=1), actor="dave")
    await manager.revoke(rolled.record.id, actor="erin", leaked=True)
    await manager.revoke(key_id, actor="erin")

    events = await manager.audit(workspace="acme")
    assert [(e.key_id, e.action, e.actor) for e in events] == [
        (key_id, "created", "alice"),
        (key_id, "updated", "bob"),
        (key_id, "disabled", "carol"),
        (key_id, "enabled", "carol"),
        (rolled.record.id, "created", "dave"),
        (key_id, "rolled", "dave"),
        (rolled.record.id, "leak_revoked", "erin"),
        (key_id, "revoked", "erin"),
    ]
    assert all(e.workspace == "acme" and e.time >= before - timedelta(seconds=1) for e in events)
    assert events[0].changes["scopes"] == ["contacts:read"]
    assert events[0].changes["name"] == "Zapier"
    assert events[1].changes == {
        "access": "restricted",
        "scopes": ["contacts:read", "contacts:write"],
    }
    assert events[2].changes == {"state": "disabled"}
    assert events[4].changes["replaces"] == key_id
    assert events[5].changes["replaced_by"] == rolled.record.id
    # Never a secret, never a hash.
    text = json.dumps([event.to_dict() for event in events])
    for token in (created.key, rolled.key):
        assert parse_key(token).secret not in text
    assert "hmac-sha256" not in text
    assert {event.action for event in events} <= set(AUDIT_ACTIONS)


async def test_the_trail_filters_by_key_workspace_and_time(manager: KeyManager) -> None:
    one = (await manager.create(name="a", workspace="w1", full_access=True)).record.id
    two = (await manager.create(name="b", workspace="w2", full_access=True)).record.id
    await manager.disable(one)
    assert [e.action for e in await manager.audit(key_id=one)] == ["created", "disabled"]
    assert [e.key_id for e in await manager.audit(workspace="w2")] == [two]
    assert await manager.audit(since=datetime.now(UTC) + timedelta(seconds=5)) == []
    assert len(await manager.audit()) == 3
    assert [e.action for e in await manager.audit(key_id=one, limit=1)] == ["disabled"]


async def test_a_change_that_does_not_happen_leaves_no_event(manager: KeyManager) -> None:
    key_id = (await manager.create(name="n", workspace="w", full_access=True)).record.id
    await manager.revoke(key_id)
    await manager.revoke(key_id)  # already revoked: nothing changed
    with pytest.raises(InvalidTransition):
        await manager.enable(key_id)
    with pytest.raises(InvalidTransition):
        await manager.update(key_id, name="renamed")
    assert [e.action for e in await manager.audit(key_id=key_id)] == ["created", "revoked"]


async def test_an_update_that_changes_nothing_leaves_no_event(manager: KeyManager) -> None:
    key_id = (await manager.create(name="n", workspace="w", full_access=True)).record.id
    record = await manager.update(key_id)  # no field given: the key is as it was
    assert record.name == "n"
    assert [e.action for e in await manager.audit(key_id=key_id)] == ["created"]


async def test_concurrent_revokes_leave_exactly_one_event(manager: KeyManager) -> None:
    key_id = (await manager.create(name="n", workspace="w", full_access=True)).record.id
    await asyncio.gather(*(manager.revoke(key_id, actor=f"a{i}") for i in range(10)))
    revoked = [e for e in await manager.audit(key_id=key_id) if e.action == "revoked"]
    assert len(revoked) == 1


def test_events_round_trip_through_their_json() -> None:
    event = AuditEvent(
        time=datetime(2026, 1, 31, 12, 0, 0, 123456, tzinfo=UTC),
        key_id="AAAAAAAAAAAA",
        workspace="acme",
        action="updated",
        actor=None,
        changes={"scopes": ["contacts:read"], "expires_at": None},
    )
    assert AuditEvent.decode(event.encode()) == event
    assert event.to_dict()["time"] == "2026-01-31T12:00:00.123456Z"
