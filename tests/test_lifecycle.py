"""The one table of a key's transitions (`apikeys.lifecycle`), as every reader asks it."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from apikeys.errors import KeyDisabled, KeyExpired, KeyRevoked
from apikeys.lifecycle import TRANSITIONS, check_usable, may_take, offered, refusal
from apikeys.types import ACTIVE, DISABLED, REVOKED, KeyRecord, StoredState, utcnow
from tests.public_surface import assert_all_is_complete, assert_exports_are_documented

NOW = utcnow()
STATES: tuple[StoredState, ...] = (ACTIVE, DISABLED, REVOKED)


def record(state: StoredState = ACTIVE, **fields: object) -> KeyRecord:
    made = KeyRecord(
        id="a" * 12,
        name="n",
        workspace="w",
        prefix="ak_" + "a" * 12 + "_…",
        access="full",
        scopes=(),
        state=state,
        rate_limit=None,
        created_at=NOW - timedelta(days=1),
        expires_at=None,
    )
    return replace(made, **fields)  # type: ignore[arg-type]


def test_the_table_says_where_each_state_change_goes() -> None:
    assert TRANSITIONS["disable"] == ((ACTIVE,), DISABLED)
    assert TRANSITIONS["enable"] == ((DISABLED,), ACTIVE)
    assert TRANSITIONS["revoke"] == ((ACTIVE, DISABLED), REVOKED)
    assert TRANSITIONS["roll"] == ((ACTIVE,), None)
    assert TRANSITIONS["update"] == ((ACTIVE, DISABLED), None)


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("action", sorted(TRANSITIONS))
def test_a_store_may_take_an_action_only_from_its_sources(state: StoredState, action: str) -> None:
    assert may_take(state, action) == (state in TRANSITIONS[action].sources)
    # A revoked key never comes back, whatever the action.
    if state == REVOKED:
        assert not may_take(state, action)


@pytest.mark.parametrize("action", ["disable", "enable", "roll", "update"])
def test_if_revoked_then_every_action_but_revoke_is_refused(action: str) -> None:
    assert refusal(record(REVOKED), action) == "it is revoked"
    assert refusal(record(REVOKED), "revoke") is None


def test_an_action_on_a_key_in_its_target_state_is_not_refused() -> None:
    assert refusal(record(DISABLED), "disable") is None
    assert refusal(record(ACTIVE), "enable") is None


def test_a_disabled_key_is_enabled_before_it_is_rolled() -> None:
    assert refusal(record(DISABLED), "roll") == "it is disabled: enable it first"


def test_a_rolled_key_is_neither_rolled_again_nor_disabled_while_active() -> None:
    rolled = record(replaced_by="b" * 12)
    assert refusal(rolled, "roll") == (
        "it was rolled already: roll the key that replaces it, " + "b" * 12
    )
    assert "grace period" in (refusal(rolled, "disable") or "")
    assert refusal(rolled, "revoke") is None
    assert refusal(rolled, "update") is None


def test_the_page_offers_what_is_allowed_and_changes_something() -> None:
    active, disabled = record(ACTIVE), record(DISABLED)
    expired = record(ACTIVE, expires_at=NOW - timedelta(seconds=1))
    rolled = record(ACTIVE, replaced_by="b" * 12)
    offers = {
        name: {action for action in TRANSITIONS if offered(key, action, NOW)}
        for name, key in {
            "active": active,
            "disabled": disabled,
            "expired": expired,
            "rolled": rolled,
            "revoked": record(REVOKED),
        }.items()
    }
    assert offers == {
        "active": {"disable", "roll", "revoke", "update"},
        # Rolling a disabled key is refused (enable it first): not offered.
        "disabled": {"enable", "revoke", "update"},
        "expired": {"revoke", "update"},
        "rolled": {"revoke", "update"},
        "revoked": set(),
    }


def test_check_usable_prefers_revoked_then_disabled_then_expired() -> None:
    past = NOW - timedelta(seconds=1)
    with pytest.raises(KeyRevoked):
        check_usable(record(REVOKED, expires_at=past), NOW)
    with pytest.raises(KeyDisabled):
        check_usable(record(DISABLED, expires_at=past), NOW)
    with pytest.raises(KeyExpired):
        check_usable(record(ACTIVE, expires_at=past), NOW)
    check_usable(record(ACTIVE, expires_at=NOW + timedelta(seconds=1)), NOW)


@pytest.mark.parametrize(
    "module",
    [
        "apikeys.lifecycle",
        "apikeys.manager",
        "apikeys.manager.construction",
        "apikeys.manager.reading",
        "apikeys.manager.changes",
        "apikeys.manager.verification",
    ],
)
def test_the_modules_export_what_they_define_documented(module: str) -> None:
    assert_all_is_complete(module)
    assert_exports_are_documented(module)
