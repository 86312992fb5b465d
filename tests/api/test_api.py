"""The management API end to end on the memory store: each verb, the rights rule, ids of
other workspaces, Idempotency-Key, ETag and If-Match. (The same API on SQLite and
PostgreSQL: tests/api/test_schemathesis.py.)"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from apikeys import KeyManager, MemoryStore
from apikeys.api import OPERATIONS, ManagementAPI
from apikeys.api.idempotency import Idempotency
from apikeys.errors import Conflict, IdempotencyKeyReused, InvalidPayload
from apikeys.fields import KEY_FIELDS, OPERATOR_ONLY
from apikeys.identities import check_identity_id
from apikeys.types import utcnow
from tests.public_surface import assert_all_is_complete, assert_exports_are_documented

BASE = "http://test/v1/api-keys"
WRITER = ["apikeys:read", "apikeys:write", "contacts:read", "contacts:write"]


@pytest.fixture
async def client(memory_manager: KeyManager) -> AsyncIterator[httpx.AsyncClient]:
    api = ManagementAPI(memory_manager, rate_limit="100000/minute")
    app = Starlette(routes=[Mount("/v1/api-keys", app=api)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as c:
        yield c


async def caller(
    manager: KeyManager, scopes: list[str] | None = None, **options: Any
) -> dict[str, str]:
    """The headers of a call made with a new key of workspace `acme` (or `workspace`)."""
    options.setdefault("workspace", "acme")
    if scopes is None:
        created = await manager.create(name="admin", full_access=True, **options)
    else:
        created = await manager.create(name="caller", scopes=scopes, **options)
    return {"Authorization": f"Bearer {created.key}"}


async def test_create_list_get_update_roll_and_revoke_a_key(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    auth = await caller(memory_manager, WRITER)
    made = await client.post(
        "/keys", json={"name": "Zapier", "scopes": ["contacts:read"]}, headers=auth
    )
    assert made.status_code == 201, made.text
    body = made.json()
    assert body["key"].startswith("ak_live_")
    assert body["scopes"] == ["contacts:read"]
    assert (await memory_manager.verify(body["key"])).id == body["id"]
    key_id = body["id"]

    listed = await client.get("/keys", headers=auth)
    assert listed.status_code == 200
    assert key_id in [item["id"] for item in listed.json()["items"]]
    assert all("key" not in item for item in listed.json()["items"])

    got = await client.get(f"/keys/{key_id}", headers=auth)
    assert got.status_code == 200
    assert "key" not in got.json()
    assert got.headers["etag"]
    assert "ratelimit" in {name.lower() for name in got.headers} or any(
        name.lower().startswith("ratelimit") for name in got.headers
    )

    edited = await client.patch(
        f"/keys/{key_id}",
        json={"name": "Zapier 2"},
        headers={**auth, "If-Match": got.headers["etag"]},
    )
    assert edited.status_code == 200
    assert edited.json()["name"] == "Zapier 2"

    rolled = await client.post(f"/keys/{key_id}/roll", json={"grace_seconds": 0}, headers=auth)
    assert rolled.status_code == 201
    assert rolled.json()["replaces"] == key_id
    new_id = rolled.json()["id"]

    for action, status in (("disable", "disabled"), ("enable", "active"), ("revoke", "revoked")):
        changed = await client.post(f"/keys/{new_id}/{action}", headers=auth)
        assert changed.status_code == 200, changed.text
        assert changed.json()["status"] == status

    again = await client.post(f"/keys/{new_id}/enable", headers=auth)
    assert again.status_code == 409
    assert again.headers["content-type"] == "application/problem+json"

    usage = await client.get(f"/keys/{key_id}/usage?days=3", headers=auth)
    assert usage.status_code == 200
    assert len(usage.json()["items"]) == 3

    audit = await client.get("/audit", headers=auth)
    actions = [(event["action"], event["actor"]) for event in audit.json()["items"]]
    caller_id = (await memory_manager.list("acme"))[0].id
    assert ("created", f"key:{caller_id}") in actions
    assert ("revoked", f"key:{caller_id}") in actions


async def test_list_pages_with_a_cursor_and_filters(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    auth = await caller(memory_manager)
    for n in range(3):
        await memory_manager.create(name=f"k{n}", workspace="acme", scopes=["a:b"], owner="ann")
    await memory_manager.create(name="test", workspace="acme", scopes=["a:b"], environment="test")
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": "2", "owner": "ann", **({"cursor": cursor} if cursor else {})}
        page = (await client.get("/keys", params=params, headers=auth)).json()
        seen += [item["name"] for item in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ["k0", "k1", "k2"]
    # A caller sees the keys of its own environment: a test key, the test keys.
    tester = await caller(memory_manager, environment="test")
    tests = (await client.get("/keys?environment=test", headers=tester)).json()["items"]
    assert sorted(item["name"] for item in tests) == ["admin", "test"]
    assert (await client.get("/keys?environment=test", headers=auth)).json()["items"] == []
    bad = await client.get("/keys?limit=0", headers=auth)
    assert bad.status_code == 400
    assert bad.json()["code"] == "invalid_payload"


async def test_another_workspaces_key_answers_exactly_as_an_unknown_id(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    auth = await caller(memory_manager)
    theirs = await memory_manager.create(name="theirs", workspace="globex", scopes=["a:b"])
    unknown = "zzzzzzzzzzzz"
    for method, suffix, body in (
        ("GET", "", None),
        ("PATCH", "", {"name": "x"}),
        ("POST", "/roll", {}),
        ("POST", "/revoke", None),
        ("GET", "/usage", None),
    ):
        answers = [
            await client.request(method, f"/keys/{key_id}{suffix}", json=body, headers=auth)
            for key_id in (theirs.record.id, unknown)
        ]
        assert [a.status_code for a in answers] == [404, 404]
        assert answers[0].json() == answers[1].json()
    assert (await memory_manager.get(theirs.record.id)).status == "active"
    listed = (await client.get("/keys", headers=auth)).json()["items"]
    assert theirs.record.id not in [item["id"] for item in listed]


async def test_a_caller_never_grants_more_than_it_holds(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    auth = await caller(memory_manager, WRITER, expires_in=timedelta(days=1))
    wider = await client.post(
        "/keys", json={"name": "x", "scopes": ["billing:write"]}, headers=auth
    )
    assert wider.status_code == 403
    assert wider.json()["code"] == "forbidden_field"
    assert wider.json()["field"] == "scopes"
    full = await client.post("/keys", json={"name": "x", "access": "full"}, headers=auth)
    assert full.status_code == 403
    assert full.json()["field"] == "access"
    later = (utcnow() + timedelta(days=2)).isoformat()
    late = await client.post(
        "/keys", json={"name": "x", "scopes": ["contacts:read"], "expires_at": later}, headers=auth
    )
    assert late.status_code == 403
    assert late.json()["field"] == "expires_at"
    for field, value in (
        ("credits", 5),
        ("allowed_ips", ["10.0.0.0/8"]),
        ("owner", "ann"),
        ("identity", "cust"),
        ("metadata", {"a": 1}),
        ("rate_limit", "1/second"),
    ):
        refused = await client.post(
            "/keys", json={"name": "x", "scopes": ["contacts:read"], field: value}, headers=auth
        )
        assert refused.status_code == 403
        assert refused.json()["field"] == field
    assert len(await memory_manager.list("acme")) == 1  # only the caller
    made = await client.post("/keys", json={"name": "x", "scopes": ["contacts:read"]}, headers=auth)
    caller_record = (await memory_manager.list("acme"))[0]
    assert made.status_code == 201
    # A key made by a key that expires expires with it at the latest.
    assert made.json()["expires_at"] is not None
    record = await memory_manager.get(made.json()["id"])
    assert record.expires_at is not None
    assert caller_record.expires_at is not None
    assert record.expires_at <= caller_record.expires_at
    narrower = await client.patch(
        f"/keys/{record.id}", json={"scopes": ["contacts:write", "admin:all"]}, headers=auth
    )
    assert narrower.status_code == 403
    assert (await memory_manager.get(record.id)).scopes == ("contacts:read",)


async def test_scopes_decide_who_reads_writes_and_administers(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    reader = await caller(memory_manager, ["apikeys:read"])
    writer = await caller(memory_manager, ["apikeys:read", "apikeys:write"])
    assert (await client.get("/keys", headers=reader)).status_code == 200
    refused = await client.post(
        "/keys", json={"name": "x", "scopes": ["apikeys:read"]}, headers=reader
    )
    assert refused.status_code == 403
    assert refused.json()["code"] == "insufficient_scope"
    identity = await client.post("/identities", json={"name": "Cust"}, headers=writer)
    assert identity.status_code == 403
    assert identity.json()["code"] == "insufficient_scope"
    assert (await client.get("/keys")).status_code == 401
    assert (await client.get("/openapi.json")).status_code == 200


async def test_identities_are_managed_by_admins_of_their_workspace(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    admin = await caller(memory_manager, ["apikeys:read", "apikeys:admin"])
    made = await client.post(
        "/identities",
        json={"name": "Cust", "credits": 10, "metadata": {"customer": "cust-1"}},
        headers=admin,
    )
    assert made.status_code == 201, made.text
    assert made.json()["workspace"] == "acme"
    assert made.json()["metadata"] == {"customer": "cust-1"}
    ident = made.json()["id"]
    assert [i["id"] for i in (await client.get("/identities", headers=admin)).json()["items"]] == [
        ident
    ]
    got = await client.get(f"/identities/{ident}", headers=admin)
    edited = await client.patch(
        f"/identities/{ident}",
        json={"name": "Customer"},
        headers={**admin, "If-Match": got.headers["etag"]},
    )
    assert edited.status_code == 200
    assert edited.json()["name"] == "Customer"
    stale = await client.patch(
        f"/identities/{ident}",
        json={"name": "Late"},
        headers={**admin, "If-Match": got.headers["etag"]},
    )
    assert stale.status_code == 412
    for action, status in (("disable", "disabled"), ("enable", "active"), ("revoke", "revoked")):
        changed = await client.post(f"/identities/{ident}/{action}", headers=admin)
        assert changed.status_code == 200
        assert changed.json()["status"] == status
    await memory_manager.create_identity("other", workspace="globex")
    mine = await client.get("/identities/other", headers=admin)
    unknown = await client.get("/identities/nobody", headers=admin)
    assert mine.status_code == unknown.status_code == 404
    assert mine.json() == unknown.json()


async def test_the_api_draws_identity_ids_so_a_create_tells_nothing_of_other_workspaces(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    await memory_manager.create_identity("acme-corp", workspace="globex")
    admin = await caller(memory_manager, ["apikeys:read", "apikeys:admin"])
    named = await client.post("/identities", json={"id": "acme-corp"}, headers=admin)
    assert named.status_code == 400
    assert named.json()["errors"] == [{"field": "id", "message": "is not a field of this request"}]
    ids = set()
    for _ in range(20):
        made = await client.post("/identities", json={"name": "n"}, headers=admin)
        assert made.status_code == 201, made.text
        ids.add(made.json()["id"])
    assert len(ids) == 20
    for ident in ids:
        assert re.fullmatch(r"idn_[0-9A-Za-z]{22}", ident)
        assert check_identity_id(ident) == ident
        assert (await memory_manager.get_identity(ident)).workspace == "acme"


async def test_if_match_refuses_a_stale_edit_and_changes_nothing(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    auth = await caller(memory_manager, WRITER)
    key = await memory_manager.create(name="k", workspace="acme", scopes=["contacts:read"])
    etag = (await client.get(f"/keys/{key.record.id}", headers=auth)).headers["etag"]
    first = await client.patch(
        f"/keys/{key.record.id}", json={"name": "one"}, headers={**auth, "If-Match": etag}
    )
    assert first.status_code == 200
    second = await client.patch(
        f"/keys/{key.record.id}", json={"name": "two"}, headers={**auth, "If-Match": etag}
    )
    assert second.status_code == 412
    assert second.json()["code"] == "precondition_failed"
    revoke = await client.post(f"/keys/{key.record.id}/revoke", headers={**auth, "If-Match": etag})
    assert revoke.status_code == 412
    assert (await memory_manager.get(key.record.id)).name == "one"
    assert (await memory_manager.get(key.record.id)).status == "active"


async def test_a_retried_create_makes_one_key_and_shows_the_secret_only_to_its_caller(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    auth = await caller(memory_manager, WRITER)
    other = await caller(memory_manager, WRITER)
    body = {"name": "once", "scopes": ["contacts:read"]}
    first = await client.post("/keys", json=body, headers={**auth, "Idempotency-Key": "abc"})
    retry = await client.post("/keys", json=body, headers={**auth, "Idempotency-Key": "abc"})
    assert first.status_code == retry.status_code == 201
    assert retry.json() == first.json()
    assert retry.headers["idempotent-replayed"] == "true"
    names = [record.name for record in await memory_manager.list("acme")]
    assert names.count("once") == 1
    changed = await client.post(
        "/keys", json={**body, "name": "twice"}, headers={**auth, "Idempotency-Key": "abc"}
    )
    assert changed.status_code == 422
    assert changed.json()["code"] == "idempotency_key_reused"
    theirs = await client.post("/keys", json=body, headers={**other, "Idempotency-Key": "abc"})
    assert theirs.status_code == 201
    assert theirs.json()["key"] != first.json()["key"]
    # The store keeps the answer sealed: the secret is nowhere in it.
    kept = " ".join(str(value) for value in vars(memory_manager.store).values())
    assert first.json()["key"] not in kept


async def test_bad_input_is_a_clear_4xx_and_changes_nothing(
    client: httpx.AsyncClient, memory_manager: KeyManager
) -> None:
    auth = await caller(memory_manager, WRITER)
    cases = [
        (b"{", {"content-type": "application/json"}, 400, "malformed_json"),
        (b'{"name": "x"}', {"content-type": "text/plain"}, 415, "unsupported_media_type"),
        (
            b'{"name": "x", "colour": 1}',
            {"content-type": "application/json"},
            400,
            "invalid_payload",
        ),
        (b'{"name": 1}', {"content-type": "application/json"}, 400, "invalid_payload"),
        (b"[]", {"content-type": "application/json"}, 400, "invalid_payload"),
        (
            b'{"name":"' + b"x" * 20000 + b'"}',
            {"content-type": "application/json"},
            413,
            "payload_too_large",
        ),
        (
            b'{"name": "x", "scopes": ["contacts:read"], "expires_at": "tomorrow"}',
            {"content-type": "application/json"},
            400,
            "invalid_payload",
        ),
    ]
    for content, headers, status, code in cases:
        answer = await client.post("/keys", content=content, headers={**auth, **headers})
        assert answer.status_code == status, (content[:40], answer.text)
        assert answer.json()["code"] == code
        assert answer.headers["content-type"] == "application/problem+json"
    assert len(await memory_manager.list("acme")) == 1
    wrong = await client.put("/keys", headers=auth)
    assert wrong.status_code == 405


def test_every_operation_needs_a_management_scope() -> None:
    assert {operation.scope for operation in OPERATIONS} == {
        "apikeys:read",
        "apikeys:write",
        "apikeys:admin",
    }
    assert all(
        operation.scope == "apikeys:read"
        for operation in OPERATIONS
        if operation.method == "GET" and not operation.operators_only
    )
    # The operators' (webhooks) need apikeys:admin named, from an operator's workspace.
    assert all(
        operation.scope == "apikeys:admin" and operation.path.startswith("/webhooks")
        for operation in OPERATIONS
        if operation.operators_only
    )
    assert all(
        operation.scope == "apikeys:admin"
        for operation in OPERATIONS
        if operation.path.startswith("/identities") and operation.method != "GET"
    )


@pytest.mark.parametrize(
    "module",
    [
        "apikeys.api",
        "apikeys.api.app",
        "apikeys.api.http",
        "apikeys.api.identities",
        "apikeys.api.idempotency",
        "apikeys.api.keys",
        "apikeys.api.merging",
        "apikeys.api.openapi",
        "apikeys.api.operations",
        "apikeys.api.reference",
        "apikeys.api.schemas",
        "apikeys.api.webhooks",
    ],
)
def test_the_public_names_of_the_api_are_exported_and_documented(module: str) -> None:
    assert_all_is_complete(module)
    assert_exports_are_documented(module)


@pytest.mark.parametrize(
    ("header", "scheme"),
    [
        ("Authorization", {"type": "http", "scheme": "bearer"}),
        ("X-API-Key", {"type": "apiKey", "in": "header", "name": "X-API-Key"}),
    ],
)
def test_the_openapi_document_shows_the_header_the_api_reads_the_key_from(
    header: str, scheme: dict[str, str]
) -> None:
    document = ManagementAPI(KeyManager("memory://"), header=header).document
    shown = document["components"]["securitySchemes"]["apiKey"]
    assert {name: shown[name] for name in scheme} == scheme
    assert shown["description"].startswith("A key of the workspace it manages")


def test_the_openapi_document_documents_every_operation_and_its_errors() -> None:
    document = ManagementAPI(KeyManager("memory://"), operators=["ops"]).document
    assert document["openapi"] == "3.1.0"
    for operation in OPERATIONS:
        answer = document["paths"][operation.path][operation.method.lower()]
        assert str(operation.status) in answer["responses"]
        for code in ("400", "401", "403", "429", "503"):
            content = answer["responses"][code]["content"]
            assert content["application/problem+json"]["schema"] == {
                "$ref": "#/components/schemas/Problem"
            }
    # The bodies come from the field table: every field a role may set, and nothing else.
    create = document["paths"]["/keys"]["post"]["requestBody"]["content"]["application/json"]
    assert set(create["schema"]["properties"]) == set(KEY_FIELDS)  # the caller's environment
    assert create["schema"]["additionalProperties"] is False


async def test_a_retry_while_running_conflicts_and_only_the_callers_key_opens_the_answer() -> None:
    store = MemoryStore()

    def guard(token: str, body: bytes = b"{}") -> Idempotency:
        return Idempotency(
            store, caller_id="abc", caller_token=token, idempotency_key="k1", request=body
        )

    first = guard("ak_live_token")
    assert await first.begin() is None
    with pytest.raises(Conflict):
        await guard("ak_live_token").begin()
    await first.keep(201, b'{"key": "secret"}')
    replay = await guard("ak_live_token").begin()
    assert replay is not None
    assert (replay.status, replay.body) == (201, b'{"key": "secret"}')
    with pytest.raises(IdempotencyKeyReused):
        await guard("another token").begin()
    with pytest.raises(IdempotencyKeyReused):
        await guard("ak_live_token", b'{"name": "other"}').begin()
    with pytest.raises(InvalidPayload):
        Idempotency(store, caller_id="abc", caller_token="t", idempotency_key="é", request=b"")


# A value of every field a key's create or update body may set (`KEY_FIELDS`): a field added
# to the table needs one here, and then reaches the manager through the API with no more code.
EVERY_FIELD: dict[str, tuple[Any, Any]] = {
    "name": ("Zapier", "Zapier 2"),
    "access": ("restricted", "restricted"),
    "scopes": (["contacts:read"], ["contacts:write"]),
    "rate_limit": ("5/second", "6/second"),
    "expires_at": ("2999-01-01T00:00:00+00:00", "2998-01-01T00:00:00+00:00"),
    "owner": ("ann", "bob"),
    "metadata": ({"a": 1}, {"b": 2}),
    "allowed_ips": (["10.0.0.0/8"], ["192.168.0.0/16"]),
    "credits": (5, 6),
    "credit_refill": ("100/day", "200/day"),
    "identity": ("cust", "cust2"),
}


async def test_every_field_a_body_may_set_is_stored_on_create_and_update(
    memory_manager: KeyManager,
) -> None:
    assert set(EVERY_FIELD) == set(KEY_FIELDS)
    # Every field the operator may hand to workspace users handed to them; a key's identity
    # is never theirs to set (`OPERATOR_ONLY`): the API refuses it.
    handed = {name for name in KEY_FIELDS if name not in OPERATOR_ONLY}
    api = ManagementAPI(memory_manager, rate_limit="100000/minute", workspace_fields=handed)
    app = Starlette(routes=[Mount("/v1/api-keys", app=api)])
    auth = await caller(memory_manager)
    fields = {name: values for name, values in EVERY_FIELD.items() if name in handed}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as c:
        made = await c.post("/keys", json={n: v[0] for n, v in fields.items()}, headers=auth)
        assert made.status_code == 201, made.text
        before = (await memory_manager.get(made.json()["id"])).to_dict()
        path = f"/keys/{before['id']}"
        updated = await c.patch(path, json={n: v[1] for n, v in fields.items()}, headers=auth)
        assert updated.status_code == 200, updated.text
        after = (await memory_manager.get(before["id"])).to_dict()
        for name in OPERATOR_ONLY:
            refused = await c.patch(path, json={name: EVERY_FIELD[name][1]}, headers=auth)
            assert refused.status_code == 403
            assert refused.json()["field"] == name
    for name in fields:
        if name != "access":  # restricted before and after: the scopes show it
            assert before[name] != after[name], name
