"""The OpenAPI 3.1 document of the public API, written by hand and served as it is.

Served without a key at `GET /api/v1/openapi.json`, so that clients and generators can
fetch it before they have one.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

__all__ = ["OPENAPI", "openapi_json"]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _problem(description: str, schema: str = "Problem") -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/problem+json": {"schema": _ref(schema)}},
    }


def _header(ref: str) -> dict[str, str]:
    return {"$ref": f"#/components/headers/{ref}"}


# Every authenticated response carries the rate-limit headers.
_RATE_HEADERS = {"RateLimit": _header("RateLimit"), "RateLimit-Policy": _header("RateLimitPolicy")}


def _ok(description: str, schema: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "description": description,
        "headers": {**_RATE_HEADERS, **(headers or {})},
        "content": {"application/json": {"schema": _ref(schema)}},
    }


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(status): {"$ref": f"#/components/responses/{status}"} for status in statuses}


def _protected(scope: str, operation: dict[str, Any], *statuses: int) -> dict[str, Any]:
    """An operation that needs a key with `scope`: security, scope, and its error responses."""
    operation["description"] = (
        operation.get("description", "") + f"\n\nRequires an API key with the scope `{scope}`."
    ).strip()
    operation["security"] = [{"bearerAuth": []}]
    operation["x-required-scopes"] = [scope]
    operation["responses"].update(_errors(*sorted({*statuses, 401, 403, 429, 503})))
    return operation


_STRING_OR_NULL = ["string", "null"]

_SCHEMAS: dict[str, Any] = {
    "Contact": {
        "type": "object",
        "required": ["id", "name", "phone", "email", "company", "created_at"],
        "additionalProperties": False,
        "properties": {
            "id": {"type": "string", "pattern": "^c_[A-Za-z0-9]+$"},
            "name": {"type": "string", "minLength": 1, "maxLength": 200},
            "phone": {
                "type": _STRING_OR_NULL,
                "pattern": "^\\+[1-9][0-9]{1,14}$",
                "description": "E.164, normalised: '+', country code and number, no spaces.",
            },
            "email": {
                "type": _STRING_OR_NULL,
                "maxLength": 254,
                "description": "Normalised (the domain in lower case).",
            },
            "company": {"type": _STRING_OR_NULL, "maxLength": 200},
            "created_at": {"type": "string", "format": "date-time", "pattern": "Z$"},
        },
    },
    "ContactInput": {
        "type": "object",
        "required": ["name"],
        "additionalProperties": False,
        "description": (
            "A new contact. `name` and `company` are trimmed of surrounding whitespace "
            "(a blank `company` is stored as null); no field may contain control characters."
        ),
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 200},
            "phone": {
                "type": _STRING_OR_NULL,
                "maxLength": 32,
                "pattern": "^\\+",
                "description": (
                    "International format: '+', country code and number "
                    "(E.164, e.g. +14155552671; spaces and dashes are accepted). "
                    "Must be a valid number; stored as E.164."
                ),
            },
            "email": {
                "type": _STRING_OR_NULL,
                "maxLength": 254,
                "format": "email",
                "description": "A valid e-mail address (deliverability is not checked).",
            },
            "company": {"type": _STRING_OR_NULL, "maxLength": 200},
        },
        "examples": [
            {
                "name": "Ada Lovelace",
                "phone": "+442071838750",
                "email": "ada@example.com",
                "company": "Analytical Engines Ltd",
            }
        ],
    },
    "ContactList": {
        "type": "object",
        "required": ["data", "next_cursor"],
        "additionalProperties": False,
        "properties": {
            "data": {"type": "array", "items": _ref("Contact")},
            "next_cursor": {
                "type": _STRING_OR_NULL,
                "description": "Pass it as `cursor` for the next page; null on the last page.",
            },
        },
    },
    "Campaign": {
        "type": "object",
        "required": ["id", "name", "channel", "created_at"],
        "additionalProperties": False,
        "properties": {
            "id": {"type": "string", "pattern": "^cmp_[A-Za-z0-9]+$"},
            "name": {"type": "string"},
            "channel": {"type": "string", "enum": ["email", "sms"]},
            "created_at": {"type": "string", "format": "date-time", "pattern": "Z$"},
        },
    },
    "CampaignList": {
        "type": "object",
        "required": ["data", "next_cursor"],
        "additionalProperties": False,
        "properties": {
            "data": {"type": "array", "items": _ref("Campaign")},
            "next_cursor": {"type": _STRING_OR_NULL},
        },
    },
    "CampaignRun": {
        "type": "object",
        "required": ["campaign_id", "run_id", "status"],
        "additionalProperties": False,
        "properties": {
            "campaign_id": {"type": "string"},
            "run_id": {"type": "string", "pattern": "^run_[A-Za-z0-9]+$"},
            "status": {"type": "string", "enum": ["queued"]},
        },
    },
    "Problem": {
        "type": "object",
        "description": "An RFC 9457 problem: every error of this API, with a stable `code`.",
        "required": ["type", "title", "status", "detail", "code"],
        "properties": {
            "type": {"type": "string", "examples": ["urn:apikeys:problem:missing_api_key"]},
            "title": {"type": "string"},
            "status": {"type": "integer", "minimum": 400, "maximum": 599},
            "detail": {"type": "string"},
            "code": {
                "type": "string",
                "description": (
                    "missing_api_key, malformed_api_key, invalid_api_key, key_disabled, "
                    "key_revoked, key_expired, insufficient_scope, rate_limited, "
                    "auth_unavailable, invalid_parameter, malformed_json, not_found, "
                    "method_not_allowed, payload_too_large, unsupported_media_type, "
                    "validation_failed, service_unavailable"
                ),
            },
            "required_scopes": {
                "type": "array",
                "items": {"type": "string"},
                "description": "With `insufficient_scope`: the scopes the operation needs.",
            },
            "retry_after": {"type": "integer", "minimum": 1},
            "errors": {"type": "array", "items": _ref("FieldError")},
        },
    },
    "ValidationProblem": {
        "allOf": [_ref("Problem"), {"type": "object", "required": ["errors"]}],
    },
    "FieldError": {
        "type": "object",
        "required": ["field", "message"],
        "properties": {"field": {"type": "string"}, "message": {"type": "string"}},
    },
}

_RESPONSES: dict[str, Any] = {
    "400": _problem(
        "`invalid_parameter`: a query parameter is invalid or unknown; "
        "or `malformed_json`: the body is not JSON."
    ),
    "401": {
        **_problem(
            "`missing_api_key`, `malformed_api_key`, `invalid_api_key`, `key_disabled`, "
            "`key_revoked` or `key_expired`."
        ),
        "headers": {"WWW-Authenticate": _header("WWWAuthenticate")},
    },
    "403": {
        **_problem("`insufficient_scope`: the key lacks the scope; see `required_scopes`."),
        "headers": {"WWW-Authenticate": _header("WWWAuthenticate")},
    },
    "404": _problem("`not_found`: no such resource in the key's workspace."),
    "413": _problem("`payload_too_large`: the body is over 64 KiB."),
    "415": _problem("`unsupported_media_type`: the body is not `application/json`."),
    "422": _problem(
        "`validation_failed`: `errors` lists every invalid field.", "ValidationProblem"
    ),
    "429": {
        **_problem("`rate_limited`: the key's rate limit is exhausted."),
        "headers": {"Retry-After": _header("RetryAfter"), **_RATE_HEADERS},
    },
    "503": {
        **_problem(
            "`auth_unavailable` (keys cannot be checked) or `service_unavailable` (database)."
        ),
        "headers": {"Retry-After": _header("RetryAfter")},
    },
}

_HEADERS: dict[str, Any] = {
    "RateLimit": {
        "description": 'Remaining requests and seconds to reset: `"default";r=99;t=60`.',
        "schema": {"type": "string"},
    },
    "RateLimitPolicy": {
        "description": 'The key\'s limit: `"default";q=100;w=60`.',
        "schema": {"type": "string"},
    },
    "RetryAfter": {
        "description": "Seconds to wait before retrying.",
        "required": True,
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    },
    "WWWAuthenticate": {
        "description": 'RFC 6750 challenge, e.g. `Bearer realm="api", error="invalid_token"`.',
        "required": True,
        "schema": {"type": "string"},
    },
    "Location": {
        "description": "The new contact's URL.",
        "required": True,
        "schema": {"type": "string", "pattern": "^/api/v1/contacts/c_"},
    },
}

_PARAMETERS: dict[str, Any] = {
    "limit": {
        "name": "limit",
        "in": "query",
        "required": False,
        "description": "Items per page.",
        "schema": {"type": "integer", "minimum": 1, "maximum": 200, "default": 50},
    },
    "cursor": {
        "name": "cursor",
        "in": "query",
        "required": False,
        "description": "The `next_cursor` of the previous page. Opaque.",
        "schema": {"type": "string", "minLength": 1, "maxLength": 512},
    },
}


def _path_id(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": description,
        "schema": {"type": "string", "minLength": 1, "maxLength": 64},
    }


_PAGE_PARAMETERS = [
    {"$ref": "#/components/parameters/limit"},
    {"$ref": "#/components/parameters/cursor"},
]

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "Contacts API",
        "version": "1.0.0",
        "summary": "Contacts and campaigns of a workspace, for server-side integrations.",
        "description": (
            "Authenticate with an API key of the workspace: `Authorization: Bearer <key>`. "
            "A key sees only its own workspace's data. A restricted key works only for the "
            "scopes enabled on it; a full-access key for every operation. Requests are "
            "rate-limited per key (`RateLimit`, `RateLimit-Policy` and, on 429, "
            "`Retry-After` headers). Every error is `application/problem+json` with a "
            "machine-readable `code`."
        ),
    },
    "paths": {
        "/api/v1/contacts": {
            "get": _protected(
                "contacts:read",
                {
                    "operationId": "listContacts",
                    "summary": "List contacts, oldest first",
                    "tags": ["contacts"],
                    "parameters": _PAGE_PARAMETERS,
                    "responses": {"200": _ok("A page of contacts.", "ContactList")},
                },
                400,
            ),
            "post": _protected(
                "contacts:write",
                {
                    "operationId": "createContact",
                    "summary": "Create a contact",
                    "tags": ["contacts"],
                    "requestBody": {
                        "required": True,
                        "description": "At most 64 KiB of JSON.",
                        "content": {"application/json": {"schema": _ref("ContactInput")}},
                    },
                    "responses": {
                        "201": _ok(
                            "The contact, as stored.",
                            "Contact",
                            {"Location": _header("Location")},
                        )
                    },
                },
                400,
                413,
                415,
                422,
            ),
        },
        "/api/v1/contacts/{contact_id}": {
            "get": _protected(
                "contacts:read",
                {
                    "operationId": "getContact",
                    "summary": "Get a contact",
                    "tags": ["contacts"],
                    "parameters": [_path_id("contact_id", "The contact's id, `c_…`.")],
                    "responses": {"200": _ok("The contact.", "Contact")},
                },
                400,
                404,
            ),
        },
        "/api/v1/campaigns": {
            "get": _protected(
                "campaigns:read",
                {
                    "operationId": "listCampaigns",
                    "summary": "List campaigns, oldest first",
                    "tags": ["campaigns"],
                    "parameters": _PAGE_PARAMETERS,
                    "responses": {"200": _ok("A page of campaigns.", "CampaignList")},
                },
                400,
            ),
        },
        "/api/v1/campaigns/{campaign_id}/trigger": {
            "post": _protected(
                "campaigns:trigger",
                {
                    "operationId": "triggerCampaign",
                    "summary": "Trigger a campaign",
                    "description": "Queues a run of the campaign; no request body.",
                    "tags": ["campaigns"],
                    "parameters": [_path_id("campaign_id", "The campaign's id, `cmp_…`.")],
                    "responses": {"202": _ok("The run is queued.", "CampaignRun")},
                },
                400,
                404,
            ),
        },
        "/api/v1/openapi.json": {
            "get": {
                "operationId": "getOpenAPI",
                "summary": "This document",
                "description": "Needs no API key.",
                "tags": ["meta"],
                "security": [],
                "responses": {
                    "200": {
                        "description": "The OpenAPI 3.1 document.",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            },
        },
    },
    "components": {
        "securitySchemes": {
            "bearerAuth": {
                "type": "http",
                "scheme": "bearer",
                "bearerFormat": "ak_<id>_<secret><checksum>",
                "description": "An API key created in Settings → Integrations → API keys.",
            }
        },
        "schemas": _SCHEMAS,
        "responses": _RESPONSES,
        "headers": _HEADERS,
        "parameters": _PARAMETERS,
    },
    "tags": [
        {"name": "contacts", "description": "People of the workspace."},
        {"name": "campaigns", "description": "Campaigns that can be listed and triggered."},
        {"name": "meta", "description": "About the API itself."},
    ],
}
"""The document; `GET /api/v1/openapi.json` serves it."""


async def openapi_json(request: Request) -> Response:
    return JSONResponse(OPENAPI, headers={"Cache-Control": "public, max-age=300"})
