"""The management API in a FastAPI app: `include_management_api` mounts it, and the app's own
OpenAPI document (so `/docs`) lists its operations under the mount's path, its schemas and
security scheme beside the app's, which stay as they were. schemathesis, loading the app's
document, finds nothing in those operations (on SQLite)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Security
from pydantic import BaseModel
from schemathesis.specs.openapi.definitions import OPENAPI_31_VALIDATOR

from apikeys import KeyManager, KeyRecord
from apikeys.api import ManagementAPI
from apikeys.api.merging import merge_document
from apikeys.errors import ConfigurationError
from apikeys.integrations.fastapi import (
    APIKeySecurity,
    include_management_api,
    install_error_handler,
)
from tests.api.test_schemathesis import Service, finds_nothing, serving
from tests.public_surface import assert_all_is_complete, assert_exports_are_documented

PATH = "/v1/api-keys"


class Key(BaseModel):
    """The app's own model named as the management API's `Key` schema, to collide."""

    id: str
    workspace: str


def build(
    manager: KeyManager,
    *,
    handler: str | None = "before",
    include: bool = True,
    scheme_name: str = "APIKey",
    **options: Any,
) -> FastAPI:
    """An app with its own route behind `APIKeySecurity`, the management API included, and
    the error handler installed before or after it (or not at all)."""
    api_key = APIKeySecurity(manager, scheme_name=scheme_name)
    app = FastAPI(title="Contacts")
    if handler == "before":
        install_error_handler(app)

    @app.get("/contacts", operation_id="list_contacts")
    async def contacts(key: KeyRecord = Security(api_key, scopes=["contacts:read"])) -> Key:
        return Key(id=key.id, workspace=key.workspace)

    if include:
        include_management_api(app, manager, path=PATH, **options)
    if handler == "after":
        install_error_handler(app)
    return app


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def references(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from references(value)
    elif isinstance(node, list):
        for item in node:
            yield from references(item)


def operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in document["paths"].items():
        for method, operation in item.items():
            yield path, method, operation


def assert_valid(document: dict[str, Any]) -> None:
    """`document` is OpenAPI 3.1, each `$ref` names a component it has, each security
    requirement a scheme it has, and no two operations share an operationId."""
    OPENAPI_31_VALIDATOR.validate(document)
    components = document["components"]
    for reference in references(document):
        kind, name = reference.removeprefix("#/components/").split("/")
        assert name in components[kind], reference
    ids = [operation["operationId"] for _, _, operation in operations(document)]
    assert len(ids) == len(set(ids))
    for _, _, operation in operations(document):
        for requirement in operation.get("security", []):
            assert set(requirement) <= set(components["securitySchemes"])


async def test_if_included_then_a_key_made_and_revoked_through_it_works_then_is_refused(
    memory_manager: KeyManager,
) -> None:
    admin = await memory_manager.create(
        name="provisioning",
        workspace="acme",
        scopes=["apikeys:read", "apikeys:write", "contacts:read"],
    )
    transport = httpx.ASGITransport(app=build(memory_manager))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        made = await client.post(
            f"{PATH}/keys",
            json={"name": "Zapier", "scopes": ["contacts:read"]},
            headers={**bearer(admin.key), "Idempotency-Key": "zapier-1"},
        )
        assert made.status_code == 201
        new = made.json()
        answer = await client.get("/contacts", headers=bearer(new["key"]))
        assert answer.json() == {"id": new["id"], "workspace": "acme"}

        revoked = await client.post(f"{PATH}/keys/{new['id']}/revoke", headers=bearer(admin.key))
        assert revoked.json()["status"] == "revoked"
        refused = await client.get("/contacts", headers=bearer(new["key"]))
        assert refused.status_code == 401
        assert refused.json()["code"] == "key_revoked"

        # The API answers as it does alone: its own problem+json, its own document.
        unknown = await client.get(f"{PATH}/keys/nope", headers=bearer(admin.key))
        assert unknown.status_code == 404
        assert unknown.headers["content-type"] == "application/problem+json"
        served = await client.get(f"{PATH}/openapi.json")
        assert served.json() == ManagementAPI(memory_manager).document


async def test_a_path_under_the_api_with_a_line_break_is_answered_by_the_api(
    memory_manager: KeyManager,
) -> None:
    admin = await memory_manager.create(name="n", workspace="acme", scopes=["apikeys:read"])
    alone = httpx.ASGITransport(app=ManagementAPI(memory_manager))
    async with httpx.AsyncClient(transport=alone, base_url="http://t") as client:
        expected = await client.get("/keys/a%0Ab", headers=bearer(admin.key))
    transport = httpx.ASGITransport(app=build(memory_manager))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        answer = await client.get(f"{PATH}/keys/a%0Ab", headers=bearer(admin.key))
    assert answer.status_code == expected.status_code == 404
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.content == expected.content


def test_the_apps_document_lists_every_operation_under_the_path_with_valid_references(
    memory_manager: KeyManager,
) -> None:
    document = build(memory_manager).openapi()
    alone = ManagementAPI(memory_manager).document
    assert_valid(document)
    listed = {(path, method) for path, method, _ in operations(document)}
    assert listed == {("/contacts", "get")} | {
        (PATH + path, method) for path, method, _ in operations(alone)
    }
    for path, method, operation in operations(alone):
        merged = document["paths"][PATH + path][method]
        assert merged["operationId"] == operation["operationId"]
        assert merged["tags"] == ["API keys"]
        # The scopes each needs, in its security requirement, as in the API's own document.
        assert merged["security"] == operation["security"]
    assert (
        document["components"]["securitySchemes"]["apiKey"]
        == (alone["components"]["securitySchemes"]["apiKey"])
    )


def test_the_apps_own_paths_and_schemas_are_untouched(memory_manager: KeyManager) -> None:
    plain = build(memory_manager, include=False).openapi()
    document = build(memory_manager).openapi()
    assert document["paths"]["/contacts"] == plain["paths"]["/contacts"]
    for kind, named in plain["components"].items():
        for name, value in named.items():
            assert document["components"][kind][name] == value
    assert document["info"] == plain["info"]


def test_if_a_schema_name_is_the_apps_then_the_apis_is_renamed_and_its_references_follow(
    memory_manager: KeyManager,
) -> None:
    document = build(memory_manager).openapi()
    alone = ManagementAPI(memory_manager).document["components"]["schemas"]
    schemas = document["components"]["schemas"]
    # The app's `Key` model and the `Problem` of install_error_handler keep their names.
    assert schemas["Key"]["properties"].keys() == {"id", "workspace"}
    assert schemas["Problem"]["required"] == ["type", "title", "status", "code"]
    assert schemas["APIKeysKey"] == alone["Key"]
    assert schemas["APIKeysProblem"] == alone["Problem"]
    assert schemas["CreatedKey"]["allOf"] == [{"$ref": "#/components/schemas/APIKeysKey"}]
    created = document["paths"][f"{PATH}/keys"]["post"]["responses"]
    assert created["400"]["content"] == {
        "application/problem+json": {"schema": {"$ref": "#/components/schemas/APIKeysProblem"}}
    }
    # The app's own operation still points at its own schemas.
    contacts = document["paths"]["/contacts"]["get"]["responses"]
    assert contacts["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Key"
    }
    assert contacts["401"]["content"]["application/problem+json"]["schema"] == {
        "$ref": "#/components/schemas/Problem"
    }


@pytest.mark.parametrize("handler", ["before", "after"])
def test_install_error_handler_before_or_after_makes_the_same_document(
    memory_manager: KeyManager, handler: str
) -> None:
    document = build(memory_manager, handler=handler).openapi()
    assert document == build(memory_manager, handler="before").openapi()
    assert_valid(document)
    # The problem answers go on the app's own operation only: the API declares its own.
    assert "401" in document["paths"]["/contacts"]["get"]["responses"]
    assert "Problem" in document["components"]["schemas"]


def test_without_error_handler_the_apis_problem_keeps_its_name(
    memory_manager: KeyManager,
) -> None:
    document = build(memory_manager, handler=None).openapi()
    assert_valid(document)
    alone = ManagementAPI(memory_manager).document["components"]["schemas"]
    assert document["components"]["schemas"]["Problem"] == alone["Problem"]
    assert "APIKeysProblem" not in document["components"]["schemas"]


def test_if_the_scheme_name_is_the_apps_then_the_apis_is_renamed_in_every_requirement(
    memory_manager: KeyManager,
) -> None:
    document = build(memory_manager, scheme_name="apiKey").openapi()
    assert_valid(document)
    schemes = document["components"]["securitySchemes"]
    alone = ManagementAPI(memory_manager).document["components"]["securitySchemes"]
    assert schemes["apiKey"]["bearerFormat"] == "apikeys"  # the app's
    assert schemes["APIKeysApiKey"] == alone["apiKey"]
    assert document["paths"][f"{PATH}/keys"]["post"]["security"] == [
        {"APIKeysApiKey": ["apikeys:write"]}
    ]
    assert document["paths"]["/contacts"]["get"]["security"] == [{"apiKey": ["contacts:read"]}]


def test_if_an_operation_id_is_the_apps_then_the_apis_is_renamed(
    memory_manager: KeyManager,
) -> None:
    app = build(memory_manager)

    @app.get("/other", operation_id="create_key")
    async def other() -> dict[str, str]:
        return {}

    document = app.openapi()
    assert_valid(document)
    assert document["paths"]["/other"]["get"]["operationId"] == "create_key"
    assert document["paths"][f"{PATH}/keys"]["post"]["operationId"] == "apikeys_create_key"


def test_if_operators_are_named_then_the_webhook_operations_are_listed(
    memory_manager: KeyManager,
) -> None:
    without = build(memory_manager).openapi()
    document = build(memory_manager, operators=["ops"]).openapi()
    assert f"{PATH}/webhooks" not in without["paths"]
    assert f"{PATH}/webhooks" in document["paths"]
    assert_valid(document)


def test_if_the_api_reads_another_header_then_the_document_shows_that_scheme(
    memory_manager: KeyManager,
) -> None:
    document = build(memory_manager, header="X-Management-Key").openapi()
    assert_valid(document)
    assert document["components"]["securitySchemes"]["apiKey"] == {
        "type": "apiKey",
        "in": "header",
        "name": "X-Management-Key",
        "description": "A key of the workspace it manages: `X-Management-Key: ak_…`.",
    }


def test_if_not_in_schema_then_mounted_but_not_listed(memory_manager: KeyManager) -> None:
    document = build(memory_manager, include_in_schema=False).openapi()
    assert list(document["paths"]) == ["/contacts"]


def test_if_the_document_was_made_before_the_api_was_included_then_it_is_made_again(
    memory_manager: KeyManager,
) -> None:
    app = build(memory_manager, include=False)
    assert f"{PATH}/keys" not in app.openapi()["paths"]
    include_management_api(app, memory_manager, path=PATH)
    assert f"{PATH}/keys" in app.openapi()["paths"]


def test_if_an_app_route_is_at_a_path_of_the_api_then_configuration_error(
    memory_manager: KeyManager,
) -> None:
    app = build(memory_manager)

    @app.get(f"{PATH}/keys")
    async def shadow() -> dict[str, str]:
        return {}

    with pytest.raises(ConfigurationError, match="/v1/api-keys/keys"):
        app.openapi()
    assert app.openapi_schema is None  # no document half made is kept


@pytest.mark.parametrize("path", ["v1/api-keys", "/{tenant}/api-keys"])
def test_if_the_path_is_no_plain_path_then_configuration_error(
    memory_manager: KeyManager, path: str
) -> None:
    with pytest.raises(ConfigurationError, match="path"):
        include_management_api(FastAPI(), memory_manager, path=path)


def test_a_component_the_app_has_word_for_word_is_shared() -> None:
    api_document = {
        "paths": {"/a": {"get": {"responses": {"200": {"$ref": "#/components/responses/R"}}}}},
        "components": {"responses": {"R": {"description": "r"}}},
    }
    target: dict[str, Any] = {"paths": {}, "components": {"responses": {"R": {"description": "r"}}}}
    before = copy.deepcopy(target["components"])
    merge_document(target, api_document, "/x")
    assert target["components"] == before
    assert target["paths"]["/x/a"]["get"]["responses"]["200"] == {
        "$ref": "#/components/responses/R"
    }


@pytest.mark.parametrize("module", ["apikeys.integrations.fastapi"])
def test_the_public_names_are_exported_and_documented(module: str) -> None:
    assert_all_is_complete(module)
    assert_exports_are_documented(module)


class InFastAPI(Service):
    """The API as `include_management_api` puts it in a FastAPI app beside a route of the
    app's own: schemathesis reads the app's document and calls the app."""

    prefix = PATH

    def serve(self, **options: Any) -> tuple[Any, dict[str, Any]]:
        app = build(self.manager, **options)
        return app, app.openapi()


@pytest.fixture
def in_fastapi(
    store_url: str, store_options: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Service]:
    yield from serving(InFastAPI, store_url, store_options, monkeypatch)


@pytest.mark.sqlite
@pytest.mark.parametrize("store_kind", ["sqlite"])
def test_schemathesis_on_the_apps_document_finds_nothing_in_the_apis_operations(
    in_fastapi: Service,
) -> None:
    finds_nothing(in_fastapi)
