"""Who may change which field, on the settings page (CONTRACT §12): a workspace user sets a
key's name, scopes and an expiry no later than the operator's; credits, refill, rate limit,
allowlist, owner and metadata are the operator's. A post that sets one of those, on create
or on edit, is refused with 403 `forbidden_field` naming the field, and changes nothing.

Every test runs on every store of the table, with the page driven as a browser drives it
(its own forms, its CSRF token) and the API answered by the real middleware.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from datetime import timedelta

import httpx
import pytest
from starlette.requests import Request

from apikeys import Hasher, KeyManager
from apikeys.errors import ConfigurationError
from apikeys.stores import KeyStore, MemoryStore
from apikeys.testing import TEST_PEPPER
from apikeys.types import KeyRecord, utcnow
from apikeys.ui import KeysPage, PageUser
from apikeys.ui.forms import KeyForm, iso
from tests.test_middleware_policies import client_for, make_app

SCOPES = {"items:read": "Read items", "items:write": "Write items"}

# What a workspace user might post for each operator field: bigger entitlements, or none.
OPERATOR_POSTS = {
    "rate_limit": "1000000/second",
    "credits": "1000000000",
    "credit_refill": "1000000/day",
    "allowed_ips": "",
    "owner": "user_1",
    "metadata": '{"plan": "enterprise"}',
}


@pytest.fixture
async def manager(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(store, hasher=Hasher(pepper=TEST_PEPPER), webhooks=False) as made:
        yield made


async def _user(request: Request) -> PageUser | None:
    return PageUser("user_1", "acme", "user_1@acme.example")


def _page(manager: KeyManager, **options: object) -> KeysPage:
    return KeysPage(
        manager,
        user=_user,
        secret_key="test-secret-key-0123456789",
        scopes=SCOPES,
        **options,  # type: ignore[arg-type]
    )


def _client(page: KeysPage) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=page), base_url="http://test")


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert found is not None
    return found.group(1)


async def _operator_key(manager: KeyManager) -> KeyRecord:
    """The key the operator set up for a trial: every operator field set."""
    created = await manager.create(
        name="trial",
        workspace="acme",
        scopes=["items:read"],
        rate_limit="10/minute",
        expires_in=timedelta(days=30),
        owner="user_7",
        metadata={"plan": "trial"},
        allowed_ips=["10.0.0.0/8"],
        credits=1,
        credit_refill="1/day",
    )
    # The refill sets the balance back to 1 each day: as the operator set it.
    return await manager.get(created.record.id)


def _edit_form(record: KeyRecord, token: str, **fields: str) -> dict[str, str | list[str]]:
    """The edit form as the page draws it for a workspace user, with `fields` added."""
    form: dict[str, str | list[str]] = {
        "csrf_token": token,
        "name": record.name,
        "access": record.access,
        "scopes": list(record.scopes),
        "expires": iso(record.expires_at) if record.expires_at else "",
    }
    form.update(fields)
    return form


def _create_form(token: str, **fields: str) -> dict[str, str | list[str]]:
    form: dict[str, str | list[str]] = {
        "csrf_token": token,
        "name": "mine",
        "access": "restricted",
        "scopes": ["items:read"],
        "expires": "",
    }
    form.update(fields)
    return form


def _assert_forbidden(response: httpx.Response, field: str) -> None:
    assert response.status_code == 403, response.text
    assert "forbidden_field" in response.text
    assert f"<code>{field}</code>" in response.text


@pytest.mark.parametrize("field", sorted(OPERATOR_POSTS))
async def test_if_a_workspace_user_edits_an_operator_field_then_403_and_nothing_changes(
    manager: KeyManager, field: str
) -> None:
    record = await _operator_key(manager)
    async with _client(_page(manager)) as client:
        token = _csrf((await client.get(f"/{record.id}/edit")).text)
        for value in (OPERATOR_POSTS[field], getattr(KeyForm.of(record), field)):
            # Even the value it has now: the field is not the user's to send.
            answer = await client.post(
                f"/{record.id}/edit", data=_edit_form(record, token, **{field: value})
            )
            _assert_forbidden(answer, field)
    assert await manager.get(record.id) == record


@pytest.mark.parametrize("field", sorted(OPERATOR_POSTS))
async def test_if_a_workspace_user_creates_a_key_with_an_operator_field_then_403_and_no_key(
    manager: KeyManager, field: str
) -> None:
    async with _client(_page(manager)) as client:
        token = _csrf((await client.get("/")).text)
        answer = await client.post("/", data=_create_form(token, **{field: OPERATOR_POSTS[field]}))
    _assert_forbidden(answer, field)
    assert await manager.list("acme") == []


async def test_the_reported_edit_leaves_the_operators_entitlements_and_the_api_refuses(
    manager: KeyManager,
) -> None:
    """1 credit, 10/minute, 10.0.0.0/8, owner user_7, plan trial: edited into 1e9 credits,
    1e6/second, no allowlist, owner user_1, plan enterprise. Refused, and the API still
    answers 403 from outside the allowlist."""
    created = await manager.create(
        name="trial",
        workspace="acme",
        scopes=["items:read"],
        rate_limit="10/minute",
        owner="user_7",
        metadata={"plan": "trial"},
        allowed_ips=["10.0.0.0/8"],
        credits=1,
    )
    record = await manager.get(created.record.id)
    async with _client(_page(manager)) as client:
        token = _csrf((await client.get(f"/{record.id}/edit")).text)
        answer = await client.post(
            f"/{record.id}/edit",
            data=_edit_form(
                record,
                token,
                credits="1000000000",
                rate_limit="1000000/second",
                allowed_ips="",
                owner="user_1",
                metadata='{"plan": "enterprise"}',
            ),
        )
        assert answer.status_code == 403
        assert "forbidden_field" in answer.text
    assert await manager.get(record.id) == record
    app = make_app(manager)
    headers = {"Authorization": f"Bearer {created.key}"}
    async with client_for(app, "203.0.113.9") as outside:
        refused = await outside.get("/api/items", headers=headers)
    assert refused.status_code == 403
    assert refused.json()["code"] == "ip_not_allowed"
    async with client_for(app, "10.1.2.3") as inside:
        assert (await inside.get("/api/items", headers=headers)).status_code == 200
        spent = await inside.get("/api/items", headers=headers)
    assert spent.status_code == 429
    assert spent.json()["code"] == "credits_exhausted"


async def test_a_workspace_user_still_renames_rescopes_and_shortens_the_expiry(
    manager: KeyManager,
) -> None:
    record = await _operator_key(manager)
    assert record.expires_at is not None
    sooner = (record.expires_at - timedelta(days=10)).replace(microsecond=0)
    async with _client(_page(manager)) as client:
        token = _csrf((await client.get(f"/{record.id}/edit")).text)
        form = _edit_form(record, token, name="renamed", expires=iso(sooner))
        form["scopes"] = ["items:write"]
        answer = await client.post(f"/{record.id}/edit", data=form)
    assert answer.status_code == 303, answer.text
    edited = await manager.get(record.id)
    assert (edited.name, edited.scopes, edited.expires_at) == ("renamed", ("items:write",), sooner)
    kept = ("rate_limit", "owner", "metadata", "allowed_ips", "credits", "credit_refill")
    assert [getattr(edited, field) for field in kept] == [getattr(record, f) for f in kept]


@pytest.mark.parametrize("expires", ["", "60d", "later"])
async def test_if_a_workspace_user_extends_or_removes_the_operators_expiry_then_403(
    manager: KeyManager, expires: str
) -> None:
    record = await _operator_key(manager)
    assert record.expires_at is not None
    if expires == "later":
        expires = iso(record.expires_at + timedelta(seconds=1))
    async with _client(_page(manager)) as client:
        token = _csrf((await client.get(f"/{record.id}/edit")).text)
        answer = await client.post(
            f"/{record.id}/edit", data=_edit_form(record, token, expires=expires)
        )
    _assert_forbidden(answer, "expires_at")
    assert await manager.get(record.id) == record


async def test_the_forms_show_operator_fields_read_only_and_send_none_of_them(
    manager: KeyManager,
) -> None:
    record = await _operator_key(manager)
    async with _client(_page(manager)) as client:
        edit = (await client.get(f"/{record.id}/edit")).text
        create = (await client.get("/")).text
    for field in OPERATOR_POSTS:
        assert f'name="{field}"' not in edit
        assert f'name="{field}"' not in create
    for shown in ("10/minute", "user_7", "10.0.0.0/8", "trial", "1/day"):
        assert shown in edit
    assert "Set by the operator" in edit
    for field in ("name", "access", "scopes", "expires"):
        assert f'name="{field}"' in edit
        assert f'name="{field}"' in create


async def test_an_operator_may_let_workspace_users_set_more_fields(manager: KeyManager) -> None:
    record = await _operator_key(manager)
    page = _page(manager, workspace_fields={"rate_limit", "credits"})
    async with _client(page) as client:
        shown = await client.get(f"/{record.id}/edit")
        assert 'name="rate_limit"' in shown.text
        assert 'name="owner"' not in shown.text
        token = _csrf(shown.text)
        answer = await client.post(
            f"/{record.id}/edit", data=_edit_form(record, token, rate_limit="20/minute")
        )
        assert answer.status_code == 303, answer.text
        owner = await client.post(f"/{record.id}/edit", data=_edit_form(record, token, owner="x"))
        _assert_forbidden(owner, "owner")
    edited = await manager.get(record.id)
    assert edited.rate_limit == "20/minute"
    assert edited.owner == "user_7"


def test_a_page_given_a_field_that_does_not_exist_refuses_to_start() -> None:
    manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER), webhooks=False)
    with pytest.raises(ConfigurationError, match="plan"):
        _page(manager, workspace_fields={"plan"})


async def test_a_key_without_expiry_may_be_given_one_by_a_workspace_user(
    manager: KeyManager,
) -> None:
    created = await manager.create(name="open", workspace="acme", scopes=["items:read"])
    record = await manager.get(created.record.id)
    async with _client(_page(manager)) as client:
        token = _csrf((await client.get(f"/{record.id}/edit")).text)
        answer = await client.post(
            f"/{record.id}/edit", data=_edit_form(record, token, expires="7d")
        )
        assert answer.status_code == 303, answer.text
        shortened = await manager.get(record.id)
        assert shortened.expires_at is not None
        assert shortened.expires_at - utcnow() < timedelta(days=7, minutes=1)


async def test_credits_handed_to_users_are_still_refused_on_a_rolled_key_beside_the_field(
    manager: KeyManager,
) -> None:
    created = await manager.create(
        name="metered", workspace="acme", scopes=["items:read"], credits=10
    )
    await manager.roll(created.record.id, grace=timedelta(hours=1))
    record = await manager.get(created.record.id)
    async with _client(_page(manager, workspace_fields={"credits"})) as client:
        token = _csrf((await client.get(f"/{record.id}/edit")).text)
        answer = await client.post(
            f"/{record.id}/edit", data=_edit_form(record, token, credits="1000")
        )
    assert answer.status_code == 422
    assert "spends the credits of the key that replaces it" in answer.text
    assert await manager.get(record.id) == record


async def test_a_workspace_users_roll_never_outlives_the_keys_expiry(manager: KeyManager) -> None:
    created = await manager.create(
        name="trial", workspace="acme", scopes=["items:read"], expires_in=timedelta(days=3)
    )
    # The operator's trial ends in 3 days; a roll that kept the key's lifetime would give
    # 3 days from the roll, past that end.
    old = await manager.get(created.record.id)
    assert old.expires_at is not None
    async with _client(_page(manager)) as client:
        shown = await client.get(f"/{old.id}/roll")
        assert "The new key expires when this one does" in shown.text
        answer = await client.post(
            f"/{old.id}/roll", data={"csrf_token": _csrf(shown.text), "grace": "1h"}
        )
    assert answer.status_code == 303, answer.text
    rolled = await manager.get(old.id)
    assert rolled.replaced_by is not None
    successor = await manager.get(rolled.replaced_by)
    assert successor.expires_at is not None
    assert successor.expires_at == old.expires_at


async def test_a_workspace_user_cannot_roll_an_expired_key_back_to_life(
    manager: KeyManager,
) -> None:
    created = await manager.create(
        name="trial", workspace="acme", scopes=["items:read"], expires_in=timedelta(seconds=1)
    )
    for _ in range(600):  # a bound for a hang, not a timing: it expires a second after now
        if (await manager.get(created.record.id)).status == "expired":
            break
        await asyncio.sleep(0.05)
    assert (await manager.get(created.record.id)).status == "expired"
    before = await manager.list("acme")
    async with _client(_page(manager)) as client:
        listed = await client.get("/")
        assert f'href="/{created.record.id}/roll"' not in listed.text
        token = _csrf(listed.text)
        shown = await client.get(f"/{created.record.id}/roll")
        _assert_forbidden(shown, "expires_at")
        answer = await client.post(
            f"/{created.record.id}/roll", data={"csrf_token": token, "grace": "1h"}
        )
    _assert_forbidden(answer, "expires_at")
    assert await manager.list("acme") == before
