"""The management API's OpenAPI 3.1 document, made from the table of its operations
(`apikeys.api.operations`) and the field tables its bodies come from
(`apikeys.api.schemas`): what the document says is what the code checks.

Every operation lists every error it can answer, each an `application/problem+json`
`Problem` (`apikeys.problems`): 401 and 503 (the key or the store), 403 (scopes, and
`forbidden_field` for a change the caller may not make), 429 (rate limits), 400 for bad
input, 404 for an id the caller cannot see, 409 for a state that forbids the change, 412
for a stale `If-Match`, 413 and 415 for a body too large or not JSON, 422 for a reused
`Idempotency-Key`. The webhook operations, for operators only, are listed when the API has
operators (`ManagementAPI(operators=…)`).
"""

from __future__ import annotations

from typing import Any, Final

from apikeys.api.idempotency import MAX_IDEMPOTENCY_KEY
from apikeys.api.operations import ADMIN_SCOPE, OPERATIONS, READ_SCOPE, WRITE_SCOPE, Operation
from apikeys.api.schemas import DELIVERY_RESPONSE, KEY_RESPONSE, WEBHOOK_RESPONSE
from apikeys.identities import IDENTITY_FIELDS
from apikeys.problems import PROBLEM_CONTENT_TYPE

__all__ = ["openapi_document"]

_ERRORS: Final = {
    400: "Bad input: malformed JSON, an unknown field, a value the field does not take",
    401: "No key, or a key that is not valid (unknown, revoked, disabled, expired)",
    403: "The key lacks the scope, its address is not allowed, or the change is not its to make",
    404: "No such resource in the caller's workspace",
    405: "The path takes another method",
    409: "The state of the key or identity forbids it, or a retry is still running",
    412: "If-Match names another version: it changed since it was read",
    413: "The body is too large",
    415: "The body is not JSON",
    422: "The Idempotency-Key was sent with another request",
    429: "Rate limited, or out of credits",
    503: "The key store cannot be reached (nothing is let through)",
}

_PROBLEM: Final = {
    "type": "object",
    "required": ["type", "title", "status", "detail", "code"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "code": {"type": "string"},
        "field": {"type": "string"},
        "errors": {"type": "array", "items": {"type": "object"}},
        "required_scopes": {"type": "array", "items": {"type": "string"}},
        "retry_after": {"type": "integer"},
    },
}


def _identity_schema() -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for field in IDENTITY_FIELDS:
        for name in field.shown_as:
            properties[name] = {"description": field.description}
    return {
        "type": "object",
        "properties": properties,
        "required": [name for f in IDENTITY_FIELDS if f.required for name in f.shown_as],
    }


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _list_of(name: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["items"],
        "properties": {"items": {"type": "array", "items": _ref(name)}},
    }


def _security_scheme(header: str) -> dict[str, Any]:
    if header.lower() == "authorization":
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A key of the workspace it manages: `Authorization: Bearer ak_…`.",
        }
    return {
        "type": "apiKey",
        "in": "header",
        "name": header,
        "description": f"A key of the workspace it manages: `{header}: ak_…`.",
    }


def _components(header: str) -> dict[str, Any]:
    created = {
        "type": "object",
        "allOf": [_ref("Key")],
        "required": ["key"],
        "properties": {
            "key": {"type": "string", "description": "the full key: shown here, and never again"},
            "confirmed": {"type": "boolean"},
            "warning": {"type": "string"},
        },
    }
    items = {"type": "object", "required": ["items"], "properties": {"items": {"type": "array"}}}

    def page(item: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "required": ["items", "next_cursor"],
            "properties": {
                "items": {"type": "array", "items": item},
                "next_cursor": {"type": ["string", "null"]},
            },
        }

    created_webhook = {
        "type": "object",
        "allOf": [_ref("Webhook")],
        "required": ["secret"],
        "properties": {
            "secret": {
                "type": "string",
                "description": "the signing secret, `whsec_…`: shown here, and never again",
            }
        },
    }
    return {
        "schemas": {
            "Key": KEY_RESPONSE,
            "CreatedKey": created,
            "KeyPage": page(_ref("Key")),
            "Identity": _identity_schema(),
            "IdentityPage": page(_ref("Identity")),
            "Usage": items,
            "AuditPage": page({"type": "object"}),
            "Webhook": WEBHOOK_RESPONSE,
            "CreatedWebhook": created_webhook,
            "Webhooks": _list_of("Webhook"),
            "Delivery": DELIVERY_RESPONSE,
            "DeliveryPage": page(_ref("Delivery")),
            "Problem": _PROBLEM,
        },
        "securitySchemes": {"apiKey": _security_scheme(header)},
    }


def _errors(operation: Operation) -> list[int]:
    codes = [400, 401, 403, 405, 429, 503]
    if "{" in operation.path or operation.operators_only:
        codes.append(404)
    if operation.method != "GET":
        codes += [409, 413, 415]
    if operation.versioned and operation.method != "GET":
        codes.append(412)
    if operation.method == "POST":
        codes.append(422)
    return sorted(codes)


def _parameters(operation: Operation) -> list[dict[str, Any]]:
    parameters: list[dict[str, Any]] = []
    for segment in operation.path.split("/"):
        if segment.startswith("{"):
            name = segment.strip("{}")
            schema = {"type": "string", "minLength": 1, "maxLength": 64}
            parameters.append({"name": name, "in": "path", "required": True, "schema": schema})
    for name, schema in operation.query:
        parameters.append({"name": name, "in": "query", "required": False, "schema": schema})
    if operation.versioned and operation.method != "GET":
        parameters.append(
            {"name": "If-Match", "in": "header", "required": False, "schema": {"type": "string"}}
        )
    if operation.method == "POST":
        key = {"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY}
        parameters.append(
            {"name": "Idempotency-Key", "in": "header", "required": False, "schema": key}
        )
    return parameters


def _operation(operation: Operation) -> dict[str, Any]:
    problem = {"content": {PROBLEM_CONTENT_TYPE: {"schema": _ref("Problem")}}}
    responses: dict[str, Any] = {
        str(operation.status): {
            "description": operation.summary,
            "content": {"application/json": {"schema": _ref(operation.answer)}},
        }
    }
    for code in _errors(operation):
        responses[str(code)] = {"description": _ERRORS[code], **problem}
    needs = f"Needs the scope `{operation.scope}`."
    if operation.operators_only:
        needs = (
            f"For operators only: a key of an operator workspace that names `{ADMIN_SCOPE}` "
            f"among its scopes, and holds `{READ_SCOPE}`. Any other caller is answered 404, "
            "as on a path that is no operation."
        )
    # The scopes the caller's key must hold, as the security requirement's roles (OpenAPI
    # 3.1 lets a requirement of any scheme list them).
    scopes = [READ_SCOPE, ADMIN_SCOPE] if operation.operators_only else [operation.scope]
    document: dict[str, Any] = {
        "operationId": operation.id,
        "summary": operation.summary,
        "description": needs,
        "security": [{"apiKey": scopes}],
        "parameters": _parameters(operation),
        "responses": responses,
    }
    if operation.body is not None:
        document["requestBody"] = {
            "required": operation.body_required,
            "content": {"application/json": {"schema": operation.body}},
        }
    return document


def openapi_document(
    *,
    title: str = "API keys",
    version: str = "1",
    webhooks: bool = True,
    header: str = "Authorization",
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the management API, its paths relative to where it is
    mounted; with the operators' webhook operations unless `webhooks` is false. The key
    goes in `header`: as a Bearer token in Authorization, else bare."""
    paths: dict[str, dict[str, Any]] = {}
    for operation in OPERATIONS:
        if operation.operators_only and not webhooks:
            continue
        paths.setdefault(operation.path, {})[operation.method.lower()] = _operation(operation)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": version,
            "description": (
                f"Manage a workspace's API keys. Scopes: `{READ_SCOPE}` reads, "
                f"`{WRITE_SCOPE}` changes keys (never beyond the caller's own rights), "
                f"`{ADMIN_SCOPE}` changes identities (and, for an operator, webhooks)."
            ),
        },
        "security": [{"apiKey": []}],
        "paths": paths,
        "components": _components(header),
    }
