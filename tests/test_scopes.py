"""Scopes (CONTRACT §2): `resource:action` strings, `resource:*` grants and full access."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.authentication import has_required_scope, requires
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from apikeys import APIKeyMiddleware, GrantedScopes, Hasher, KeyManager, MemoryStore
from apikeys.errors import InvalidKeyParameters
from apikeys.routes import ScopeTable
from apikeys.scopes import FULL_ACCESS, grants_for, validate_scope, validate_scopes

PEPPER = "lthtYTMrPW9U66EMlnNfvx6ueNSuzdgFFmTtK3dNRQs"

NAME = r"[a-z][a-z0-9_.-]{0,63}"
names = st.from_regex(NAME, fullmatch=True)


# -- validate_scope -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "scope",
    [
        "contacts:read",
        "contacts:*",
        "campaigns:trigger",
        "a:b",
        "billing.invoices:read",
        "user-profiles:write_all",
        "v2:read",
    ],
)
def test_if_scope_reads_resource_action_then_valid(scope: str) -> None:
    assert validate_scope(scope) == scope


@pytest.mark.parametrize(
    "scope",
    [
        pytest.param("contacts", id="no-action"),
        pytest.param("Contacts:read", id="uppercase-resource"),
        pytest.param("contacts:Read", id="uppercase-action"),
        pytest.param(":read", id="empty-resource"),
        pytest.param("contacts:", id="empty-action"),
        pytest.param(":", id="colon-only"),
        pytest.param("", id="empty"),
        pytest.param("*:read", id="wildcard-resource"),
        pytest.param("*", id="full-access-marker"),
        pytest.param("*:*", id="wildcard-both"),
        pytest.param("contacts:re*", id="partial-wildcard"),
        pytest.param("contacts: read", id="space-after-colon"),
        pytest.param("contacts :read", id="space-before-colon"),
        pytest.param(" contacts:read", id="leading-space"),
        pytest.param("contacts:read ", id="trailing-space"),
        pytest.param("contacts:read\n", id="trailing-newline"),
        pytest.param("contacts:read:all", id="two-colons"),
        pytest.param("1contacts:read", id="leading-digit"),
        pytest.param("contacts:r\u00e9ad", id="non-ascii"),
        pytest.param("a" * 65 + ":read", id="resource-too-long"),
        pytest.param(None, id="none"),
        pytest.param(b"contacts:read", id="bytes"),
    ],
)
def test_if_scope_malformed_then_refused(scope: object) -> None:
    with pytest.raises(InvalidKeyParameters):
        validate_scope(scope)  # type: ignore[arg-type]


def test_if_scopes_validated_then_sorted_and_deduplicated() -> None:
    assert validate_scopes(["contacts:write", "campaigns:read", "contacts:write"]) == (
        "campaigns:read",
        "contacts:write",
    )


def test_if_single_scope_string_given_then_treated_as_one_scope() -> None:
    assert validate_scopes("contacts:read") == ("contacts:read",)


def test_if_no_scopes_then_empty_tuple() -> None:
    assert validate_scopes([]) == ()


def test_if_any_scope_invalid_then_the_whole_list_is_refused() -> None:
    with pytest.raises(InvalidKeyParameters):
        validate_scopes(["contacts:read", "Contacts:write"])


# -- GrantedScopes ------------------------------------------------------------------------


def test_if_scope_granted_exactly_then_it_is_covered() -> None:
    grants = GrantedScopes(["contacts:read"])
    assert "contacts:read" in grants
    assert "contacts:write" not in grants
    assert "campaigns:read" not in grants


def test_if_resource_wildcard_granted_then_every_action_of_it_is_covered() -> None:
    grants = GrantedScopes(["contacts:*"])
    assert "contacts:read" in grants
    assert "contacts:write" in grants
    assert "contacts:anything" in grants
    assert "contacts:*" in grants


def test_if_resource_wildcard_granted_then_other_resources_are_not_covered() -> None:
    grants = GrantedScopes(["contacts:*"])
    assert "other:x" not in grants
    assert "contactsx:read" not in grants
    assert "contacts.archive:read" not in grants
    assert "contact:read" not in grants
    assert "contacts" not in grants
    assert "" not in grants


def test_if_action_granted_then_wildcard_requirement_is_not_covered() -> None:
    assert "contacts:*" not in GrantedScopes(["contacts:read", "contacts:write"])


def test_if_full_access_then_every_scope_is_covered_including_unseen_ones() -> None:
    grants = GrantedScopes([], full_access=True)
    assert grants.full_access
    assert "contacts:read" in grants
    assert "never-seen-before:action" in grants
    assert "campaigns:*" in grants
    assert grants.missing(["contacts:read", "added-later:write"]) == []


def test_if_full_access_then_scopes_passed_are_ignored() -> None:
    grants = GrantedScopes(["contacts:read"], full_access=True)
    assert list(grants) == [FULL_ACCESS]
    assert "campaigns:trigger" in grants


def test_if_restricted_then_full_access_is_false() -> None:
    assert GrantedScopes(["contacts:*"]).full_access is False


def test_if_required_scopes_checked_then_missing_lists_the_uncovered_ones_in_order() -> None:
    grants = GrantedScopes(["contacts:read", "campaigns:*"])
    assert grants.missing(["contacts:read", "campaigns:trigger"]) == []
    assert grants.missing(["contacts:write", "campaigns:read", "billing:read"]) == [
        "contacts:write",
        "billing:read",
    ]
    assert grants.missing([]) == []


def test_if_non_string_checked_then_not_covered() -> None:
    grants = GrantedScopes(["contacts:*"])
    assert None not in grants
    assert 1 not in grants


def test_if_granted_scopes_then_it_is_a_list_of_the_grants() -> None:
    grants = GrantedScopes(["contacts:read", "campaigns:*"])
    assert isinstance(grants, list)
    assert list(grants) == ["contacts:read", "campaigns:*"]
    assert len(grants) == 2


def test_if_grants_for_called_twice_then_same_answer() -> None:
    first = grants_for(("contacts:read",), False)
    second = grants_for(("contacts:read",), False)
    assert list(first) == list(second) == ["contacts:read"]
    assert "contacts:read" in second
    assert "contacts:write" not in second
    assert "anything:at-all" in grants_for((), True)


class _Conn:
    """The least `has_required_scope` reads: `conn.auth.scopes`."""

    def __init__(self, scopes: GrantedScopes) -> None:
        self.auth = self
        self.scopes = scopes


def test_if_starlette_has_required_scope_then_wildcards_and_full_access_work() -> None:
    wildcard = _Conn(GrantedScopes(["contacts:*"]))
    assert has_required_scope(wildcard, ["contacts:read", "contacts:write"])  # type: ignore[arg-type]
    assert not has_required_scope(wildcard, ["campaigns:read"])  # type: ignore[arg-type]
    full = _Conn(GrantedScopes([], full_access=True))
    assert has_required_scope(full, ["anything:new"])  # type: ignore[arg-type]


@given(resource=names, action=names)
def test_if_any_resource_wildcard_granted_then_any_action_of_it_is_allowed(
    resource: str, action: str
) -> None:
    scope = f"{resource}:{action}"
    assert validate_scope(scope) == scope
    assert validate_scope(f"{resource}:*") == f"{resource}:*"
    grants = GrantedScopes([f"{resource}:*"])
    assert scope in grants
    assert grants.missing([scope]) == []


@given(resource=names, other=names, action=names)
def test_if_any_resource_wildcard_granted_then_other_resources_stay_refused(
    resource: str, other: str, action: str
) -> None:
    if other == resource:
        other = resource + "x"
    assert f"{other}:{action}" not in GrantedScopes([f"{resource}:*"])


@given(resource=names, action=names)
def test_if_full_access_then_any_valid_scope_is_allowed(resource: str, action: str) -> None:
    assert f"{resource}:{action}" in GrantedScopes([], full_access=True)


# -- Starlette's requires() behind APIKeyMiddleware ---------------------------------------


@requires("contacts:read")
async def list_contacts(request: Request) -> JSONResponse:
    return JSONResponse({"key": request.user.identity, "scopes": list(request.auth.scopes)})


@requires(["campaigns:trigger"])
async def trigger_campaign(request: Request) -> JSONResponse:
    return JSONResponse({"status": "queued"}, status_code=202)


@requires(["contacts:read", "contacts:write"])
async def import_contacts(request: Request) -> JSONResponse:
    return JSONResponse({"status": "imported"})


@pytest.fixture
async def manager() -> AsyncIterator[KeyManager]:
    key_manager = KeyManager(MemoryStore(), hasher=Hasher(PEPPER))
    try:
        yield key_manager
    finally:
        await key_manager.aclose()


@pytest.fixture
async def client(manager: KeyManager) -> AsyncIterator[httpx.AsyncClient]:
    app = Starlette(
        routes=[
            Route("/api/contacts", list_contacts),
            Route("/api/contacts/import", import_contacts, methods=["POST"]),
            Route("/api/campaigns/trigger", trigger_campaign, methods=["POST"]),
        ]
    )
    wrapped = APIKeyMiddleware(
        app, manager=manager, protect="/api/", rate_limit="1000/minute", unmapped="allow"
    )
    transport = httpx.ASGITransport(app=wrapped)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        yield http


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_if_key_has_exact_scope_then_starlette_requires_admits_it(
    manager: KeyManager, client: httpx.AsyncClient
) -> None:
    created = await manager.create(name="reader", scopes=["contacts:read"])
    response = await client.get("/api/contacts", headers=_bearer(created.key))
    assert response.status_code == 200
    assert response.json() == {"key": created.record.id, "scopes": ["contacts:read"]}
    refused = await client.post("/api/campaigns/trigger", headers=_bearer(created.key))
    assert refused.status_code == 403


async def test_if_key_has_resource_wildcard_then_starlette_requires_admits_its_actions(
    manager: KeyManager, client: httpx.AsyncClient
) -> None:
    created = await manager.create(name="campaigner", scopes=["campaigns:*"])
    response = await client.post("/api/campaigns/trigger", headers=_bearer(created.key))
    assert response.status_code == 202
    refused = await client.get("/api/contacts", headers=_bearer(created.key))
    assert refused.status_code == 403


async def test_if_key_has_full_access_then_starlette_requires_admits_everything(
    manager: KeyManager, client: httpx.AsyncClient
) -> None:
    created = await manager.create(name="ops", full_access=True)
    assert (await client.get("/api/contacts", headers=_bearer(created.key))).status_code == 200
    trigger = await client.post("/api/campaigns/trigger", headers=_bearer(created.key))
    assert trigger.status_code == 202
    imported = await client.post("/api/contacts/import", headers=_bearer(created.key))
    assert imported.status_code == 200


async def test_if_key_lacks_one_of_several_required_scopes_then_starlette_refuses(
    manager: KeyManager, client: httpx.AsyncClient
) -> None:
    partial = await manager.create(name="partial", scopes=["contacts:read"])
    both = await manager.create(name="both", scopes=["contacts:read", "contacts:write"])
    wildcard = await manager.create(name="wild", scopes=["contacts:*"])
    post = client.post
    assert (await post("/api/contacts/import", headers=_bearer(partial.key))).status_code == 403
    assert (await post("/api/contacts/import", headers=_bearer(both.key))).status_code == 200
    assert (await post("/api/contacts/import", headers=_bearer(wildcard.key))).status_code == 200


async def test_if_no_key_then_middleware_refuses_before_the_endpoint(
    client: httpx.AsyncClient,
) -> None:
    response = await client.get("/api/contacts")
    assert response.status_code == 401
    assert response.json()["code"] == "missing_api_key"


@pytest.mark.parametrize(
    "change",
    [
        lambda granted: granted.append("admin:all"),
        lambda granted: granted.extend(["admin:all"]),
        lambda granted: granted.insert(0, "admin:all"),
        lambda granted: granted.clear(),
        lambda granted: granted.__setitem__(0, "admin:all"),
        lambda granted: granted.__iadd__(["admin:all"]),
    ],
)
def test_if_app_tries_to_change_granted_scopes_then_refused(change: Any) -> None:
    # grants_for shares one object between requests: a change would leak into others.
    granted = grants_for(("contacts:read",), False)
    with pytest.raises(TypeError):
        change(granted)
    assert list(grants_for(("contacts:read",), False)) == ["contacts:read"]


@pytest.mark.parametrize(
    "rules", [{"GET /x": 5}, {"GET /x": [1]}, {"GET /x": None}, {5: "a:read"}, {None: "a:read"}]
)
def test_a_rule_or_scope_of_the_wrong_kind_is_a_configuration_error_not_a_type_error(
    rules: Any,
) -> None:
    from apikeys.errors import ConfigurationError
    from apikeys.routes import ScopeTable

    with pytest.raises(ConfigurationError, match="rule"):
        ScopeTable(rules)


def test_a_path_with_a_final_line_break_needs_what_its_route_needs() -> None:
    # Starlette routes `/admin` and a line break (`%0A`) to `/admin` (`$` matches before
    # it): the rules must ask that request for `/admin`'s scopes, not let it pass unruled.
    table = ScopeTable({"GET /admin": "admin:read", "POST /items/{item_id}": "items:write"})
    assert table.required("GET", "/admin\n") == ("admin:read",)
    assert table.required("POST", "/items/7\n") == ("items:write",)
    assert table.required("GET", "/admin\n\n") is None  # routed nowhere by Starlette either


async def test_a_final_line_break_in_the_path_takes_no_key_past_its_routes_scopes() -> None:
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def admin(request: object) -> PlainTextResponse:
        return PlainTextResponse("the admin page")

    async with KeyManager(MemoryStore(), hasher=Hasher()) as manager:
        reader = await manager.create(name="r", scopes=["contacts:read"])
        app = APIKeyMiddleware(
            Starlette(routes=[Route("/admin", admin)]),
            manager=manager,
            scopes={"GET /admin": "admin:read"},
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            headers = {"Authorization": f"Bearer {reader.key}"}
            for path in ("/admin", "/admin%0A"):
                answer = await client.get(path, headers=headers)
                assert answer.status_code == 403, (path, answer.text)
