"""docs/reference/management-api.md is what `python -m apikeys.api.reference` writes from
the served OpenAPI document now, so it never drifts from the API; it names every
operation with its scope, parameters, body fields and answers, and an operation added to
the document shows up on it by itself."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from apikeys import KeyManager, MemoryStore
from apikeys.api import OPERATIONS, ManagementAPI, Operation
from apikeys.api.reference import main, markdown_reference

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "management-api.md"


async def served_document() -> dict[str, Any]:
    """The document `GET /openapi.json` answers, of an API titled as the page is."""
    async with KeyManager(MemoryStore()) as manager:
        # With operators, so the operators' webhook operations are in it too.
        api = ManagementAPI(manager, title="Management API", operators={"ops"})
        return api.document


def sections(page: str) -> dict[str, str]:
    """Each operation's section of `page`, by its heading (`POST /keys`)."""
    found = re.split(r"^### `([A-Z]+ [^`]+)`.*$", page, flags=re.MULTILINE)
    return dict(zip(found[1::2], found[2::2], strict=True))


async def test_the_checked_in_page_is_what_the_generator_writes_from_the_served_document() -> None:
    assert PAGE.read_text() == markdown_reference(await served_document()), (
        "run: python -m apikeys.api.reference --output docs/reference/management-api.md"
    )


def test_the_command_writes_and_checks_the_page(tmp_path: Path) -> None:
    written = tmp_path / "page.md"
    assert main(["--output", str(written)]) == 0
    assert written.read_text() == PAGE.read_text()
    assert main(["--check", str(PAGE)]) == 0
    written.write_text(PAGE.read_text().replace("apikeys:write", "apikeys:read"))
    assert main(["--check", str(written)]) == 1
    # As documented, as a module run from the command line.
    result = subprocess.run(
        [sys.executable, "-m", "apikeys.api.reference", "--check", str(PAGE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda operation: operation.id)
async def test_every_operation_is_on_the_page_with_its_scope_fields_and_answers(
    operation: Operation,
) -> None:
    section = sections(PAGE.read_text())[operation.rule]
    document = await served_document()
    described = document["paths"][operation.path][operation.method.lower()]
    assert described["description"] in section
    assert f"`{operation.scope}`" in section
    for parameter in described["parameters"]:
        assert f"| `{parameter['name']}` | {parameter['in']} |" in section
    for field in (operation.body or {}).get("properties", {}):
        assert f"| `{field}` |" in section
    for status in described["responses"]:
        assert f"| `{status}` |" in section
    assert f"| `{operation.status}` |" in section
    assert "| `401` |" in section
    assert "| `403` |" in section


async def test_an_operation_added_to_the_document_shows_up_by_itself() -> None:
    document = copy.deepcopy(await served_document())
    document["paths"]["/hooks"] = {
        "get": {
            "operationId": "list_hooks",
            "summary": "The webhook endpoints",
            "description": "Needs the scope `apikeys:admin`.",
            "security": [{"apiKey": ["apikeys:admin"]}],
            "parameters": [{"name": "limit", "in": "query", "schema": {"type": "integer"}}],
            "responses": {"200": {"description": "The endpoints"}, "418": {"description": "No"}},
        }
    }
    section = sections(markdown_reference(document))["GET /hooks"]
    assert "The webhook endpoints. Needs the scope `apikeys:admin`." in section
    assert "| `limit` | query | no | integer |" in section
    assert "| `418` | No | none |" in section
    assert "[`GET /hooks`](#list_hooks) | `apikeys:admin` |" in markdown_reference(document)


def test_each_operation_names_the_scope_its_route_rule_needs_in_its_security_requirement() -> None:
    from apikeys.api.openapi import openapi_document
    from apikeys.api.operations import ADMIN_SCOPE, OPERATIONS, READ_SCOPE, scope_rules

    rules = scope_rules()
    document = openapi_document()
    for operation in OPERATIONS:
        shown = document["paths"][operation.path][operation.method.lower()]["security"]
        if operation.operators_only:
            assert shown == [{"apiKey": [READ_SCOPE, ADMIN_SCOPE]}]
        else:
            assert shown == [{"apiKey": [rules[operation.rule]]}], operation.id
