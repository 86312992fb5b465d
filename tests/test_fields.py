"""Who may change which field (CONTRACT §12): `apikeys.fields.KEY_FIELDS` and `check_change`,
for every subset of fields and both roles, and the settings page held to them; the table in
docs/security.md is the table in the code."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.requests import Request

import apikeys
from apikeys import Hasher, KeyManager
from apikeys.errors import ConfigurationError, ForbiddenField, InvalidKeyParameters
from apikeys.fields import (
    KEY_FIELDS,
    OPERATOR_ONLY,
    KeyField,
    Role,
    check_change,
    check_workspace_fields,
    workspace_may_change,
    workspace_roll_expiry,
)
from apikeys.stores import MemoryStore
from apikeys.testing import TEST_PEPPER
from apikeys.types import KeyRecord
from apikeys.ui import KeysPage, PageUser
from apikeys.ui.forms import iso
from tests.public_surface import assert_all_is_complete, assert_exports_are_documented

DOCS = Path(__file__).resolve().parent.parent / "docs"
OPERATOR_FIELDS = (
    "rate_limit",
    "credits",
    "credit_refill",
    "allowed_ips",
    "owner",
    "metadata",
    "identity",
)
# What an operator may hand to workspace users (`KeysPage(workspace_fields=…)`).
DELEGABLE_FIELDS = tuple(name for name in OPERATOR_FIELDS if name not in OPERATOR_ONLY)
WORKSPACE_FIELDS = ("name", "access", "scopes", "expires_at")
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def _record(expires_at: datetime | None = NOW + timedelta(days=30)) -> KeyRecord:
    return KeyRecord(
        id="AAAAAAAAAAAA",
        prefix="ak_AAAAAAAAAAAA_…",
        name="trial",
        workspace="acme",
        access="restricted",
        scopes=("items:read",),
        state="active",
        rate_limit="10/minute",
        created_at=NOW,
        expires_at=expires_at,
    )


# A value a workspace user may give each of its fields (an earlier expiry, the page's
# scopes), and anything for the operator's: only the field's presence is judged.
VALUES: dict[str, object] = {
    "name": "renamed",
    "access": "restricted",
    "scopes": ("items:read",),
    "expires_at": NOW + timedelta(days=1),
    "rate_limit": "1000000/second",
    "credits": 1_000_000_000,
    "credit_refill": "1000000/day",
    "allowed_ips": (),
    "owner": "user_1",
    "metadata": {"plan": "enterprise"},
    "identity": "acme",
}


def test_the_table_says_what_the_contract_says() -> None:
    assert {name for name, field in KEY_FIELDS.items() if field.changed_by == "workspace"} == set(
        WORKSPACE_FIELDS
    )
    assert {name for name, field in KEY_FIELDS.items() if field.changed_by == "operator"} == set(
        OPERATOR_FIELDS
    )
    for name, field in KEY_FIELDS.items():
        assert field.name == name
        assert isinstance(field, KeyField)
        with pytest.raises(dataclasses.FrozenInstanceError):
            field.changed_by = Role.WORKSPACE  # type: ignore[misc]
    with pytest.raises(TypeError):
        KEY_FIELDS["credits"] = KeyField("credits", Role.WORKSPACE, "")  # type: ignore[index]


def test_every_field_is_one_the_record_holds_and_the_manager_updates() -> None:
    record_fields = {field.name for field in dataclasses.fields(KeyRecord)}
    update = inspect.signature(KeyManager.update).parameters
    create = inspect.signature(KeyManager.create).parameters
    for name in KEY_FIELDS:
        assert name in record_fields, name
        if name != "access":  # `full_access=` in the manager's terms
            assert name in update, name
            assert name in create, name


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    fields=st.sets(st.sampled_from(list(KEY_FIELDS))),
    role=st.sampled_from(list(Role)),
    extra=st.sets(st.sampled_from(DELEGABLE_FIELDS)),
    creating=st.booleans(),
)
def test_a_change_is_allowed_iff_the_table_gives_every_field_to_the_role(
    fields: set[str], role: Role, extra: set[str], creating: bool
) -> None:
    requested = {field: VALUES[field] for field in fields}
    current = None if creating else _record()
    before = dict(requested)
    refused = [
        name
        for name in KEY_FIELDS
        if name in fields and role == Role.WORKSPACE and name not in (*WORKSPACE_FIELDS, *extra)
    ]
    if refused:
        with pytest.raises(ForbiddenField) as caught:
            check_change(requested, role=role, current=current, workspace_fields=extra)
        assert caught.value.field == refused[0]  # the first, in the table's order
        assert (caught.value.status, caught.value.code) == (403, "forbidden_field")
        assert refused[0] in str(caught.value)
    else:
        check_change(requested, role=role, current=current, workspace_fields=extra)
    assert requested == before  # a check, never a change


@given(
    now_expires=st.one_of(st.none(), st.integers(1, 10_000)),
    wanted=st.one_of(st.none(), st.integers(1, 10_000)),
)
def test_a_workspace_user_may_bring_an_expiry_forward_never_move_it_later(
    now_expires: int | None, wanted: int | None
) -> None:
    current = _record(None if now_expires is None else NOW + timedelta(minutes=now_expires))
    requested = {"expires_at": None if wanted is None else NOW + timedelta(minutes=wanted)}
    later = now_expires is not None and (wanted is None or wanted > now_expires)
    if later:
        with pytest.raises(ForbiddenField) as caught:
            check_change(requested, role=Role.WORKSPACE, current=current)
        assert caught.value.field == "expires_at"
    else:
        check_change(requested, role=Role.WORKSPACE, current=current)
    check_change(requested, role=Role.OPERATOR, current=current)  # the operator's to lift


def test_an_api_callers_key_is_the_ceiling_of_the_scopes_it_gives() -> None:
    ceiling = ("contacts:*", "items:read")
    check = {"role": Role.WORKSPACE, "scope_ceiling": ceiling}
    check_change({"access": "restricted", "scopes": ("contacts:write", "items:read")}, **check)  # type: ignore[arg-type]
    for requested, field in (
        ({"access": "restricted", "scopes": ("items:write",)}, "scopes"),
        ({"access": "full"}, "access"),
        ({"scopes": "items:read"}, "scopes"),
    ):
        with pytest.raises(ForbiddenField) as caught:
            check_change(requested, **check)  # type: ignore[arg-type]
        assert caught.value.field == field
    check_change({"access": "full"}, role=Role.WORKSPACE)  # the page: no ceiling of a key


def test_a_field_outside_the_table_is_refused_to_workspace_users() -> None:
    with pytest.raises(ForbiddenField) as caught:
        check_change({"workspace": "globex"}, role=Role.WORKSPACE)
    assert caught.value.field == "workspace"
    assert not workspace_may_change("workspace", {"workspace"})


def test_extra_workspace_fields_must_be_fields_of_the_table() -> None:
    assert check_workspace_fields(["rate_limit"]) == {"rate_limit"}
    with pytest.raises(ConfigurationError, match="plan"):
        check_workspace_fields(["plan"])
    with pytest.raises(ConfigurationError):
        check_workspace_fields("rate_limit")  # a string is not a set of names


def test_a_keys_identity_is_never_handed_to_workspace_users() -> None:
    # Moving a key out of its identity would escape the identity's limits and credits.
    assert "identity" in OPERATOR_ONLY
    with pytest.raises(ConfigurationError, match="identity is the operator's alone"):
        check_workspace_fields(["rate_limit", "identity"])


def test_the_docs_table_is_the_table_in_the_code() -> None:
    text = (DOCS / "security.md").read_text()
    found = re.search(r"<!-- fields-table:.*?-->\n(.*?)<!-- /fields-table -->", text, re.DOTALL)
    assert found is not None
    rows = [line.split("|")[1:-1] for line in found.group(1).splitlines()[2:]]
    documented = [tuple(cell.strip().strip("`") for cell in row) for row in rows]
    assert documented == [
        (field.name, str(field.changed_by), field.description) for field in KEY_FIELDS.values()
    ]


def test_the_fields_module_exports_and_documents_what_it_defines() -> None:
    assert_all_is_complete("apikeys.fields")
    assert_exports_are_documented("apikeys.fields")
    assert apikeys.ForbiddenField is ForbiddenField


# -- the page, for every subset of fields ----------------------------------------------------

POSTS = {
    "rate_limit": "1000000/second",
    "credits": "1000000000",
    "credit_refill": "1000000/day",
    "allowed_ips": "",
    "owner": "user_1",
    "metadata": '{"plan": "enterprise"}',
    "name": "renamed",
    "scopes": "items:write",
    "expires": "7d",
}


async def _user(request: Request) -> PageUser | None:
    return PageUser("user_1", "acme", "user_1@acme.example")


async def _post_edit(posted: frozenset[str], extra: frozenset[str]) -> tuple[int, bool]:
    """Post the edit form with `posted` fields changed; the status, and whether the key is
    as it was."""
    async with KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER), webhooks=False) as m:
        created = await m.create(
            name="trial",
            workspace="acme",
            scopes=["items:read"],
            rate_limit="10/minute",
            expires_in=timedelta(days=30),
            owner="user_7",
            metadata={"plan": "trial"},
            allowed_ips=["10.0.0.0/8"],
            credits=1,
        )
        before = await m.get(created.record.id)
        assert before.expires_at is not None
        page = KeysPage(
            m,
            user=_user,
            secret_key="test-secret-key-0123456789",
            scopes=["items:read", "items:write"],
            workspace_fields=extra,
        )
        transport = httpx.ASGITransport(app=page)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            shown = await client.get(f"/{before.id}/edit")
            token = re.search(r'name="csrf_token" value="([^"]+)"', shown.text)
            assert token is not None
            form: dict[str, str] = {
                "csrf_token": token.group(1),
                "name": before.name,
                "access": "restricted",
                "scopes": "items:read",
                "expires": iso(before.expires_at),
            }
            form.update({field: POSTS[field] for field in posted})
            answer = await client.post(f"/{before.id}/edit", data=form)
        return answer.status_code, await m.get(before.id) == before


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(
    posted=st.frozensets(st.sampled_from(list(POSTS))),
    extra=st.frozensets(st.sampled_from(DELEGABLE_FIELDS)),
)
def test_the_page_refuses_a_post_iff_it_sends_a_field_not_given_to_users_and_changes_nothing(
    posted: frozenset[str], extra: frozenset[str]
) -> None:
    status, unchanged = asyncio.run(_post_edit(posted, extra))
    if posted - set(WORKSPACE_FIELDS) - {"expires"} - extra:
        assert status == 403
        assert unchanged
    else:
        assert status == 303
        assert unchanged == (not posted)


async def test_a_roll_takes_an_expiry_of_its_own(memory_manager: KeyManager) -> None:
    created = await memory_manager.create(
        name="trial", scopes=["items:read"], expires_in=timedelta(days=30)
    )
    old = created.record
    assert old.expires_at is not None
    rolled = await memory_manager.roll(old.id, expires_at=old.expires_at)
    assert rolled.record.expires_at == old.expires_at
    with pytest.raises(InvalidKeyParameters, match="not both"):
        await memory_manager.roll(
            rolled.record.id, expires_at=old.expires_at, expires_in=timedelta(days=1)
        )
    with pytest.raises(ForbiddenField):
        workspace_roll_expiry(old, old.expires_at)
    assert workspace_roll_expiry(old, old.created_at) == old.expires_at
