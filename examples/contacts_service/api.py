"""The public API, `/api/v1/…`: each operation with the scope its key needs.

`OPERATIONS` is the one table of the API: it gives the routes, the middleware's scope rules
and the path prefixes the middleware protects, so an endpoint cannot be added without a key
check. Handlers read the caller's workspace from `request.scope["apikey"]`, which the
middleware sets, and pass it to every query.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from examples.contacts_service.db import Database, Page, campaign_json, contact_json
from examples.contacts_service.payload import read_json, validate_contact
from examples.contacts_service.problems import Problem

__all__ = [
    "MANAGEMENT_PATH",
    "OPENAPI_PATH",
    "OPERATIONS",
    "Operation",
    "protected_prefixes",
    "routes",
    "scope_rules",
]

Endpoint = Callable[[Request], Awaitable[Response]]

DEFAULT_LIMIT = 50
MAX_LIMIT = 200
MAX_CURSOR_LENGTH = 512
# Ids the service issues: `c_…`, `cmp_…`. Anything else cannot name a row, so it is a 404
# without a query (and a NUL byte never reaches PostgreSQL).
_ID = re.compile(r"[A-Za-z0-9_]{1,64}")
_DIGITS = re.compile(r"[0-9]{1,6}")


def _database(request: Request) -> Database:
    database: Database = request.app.state.database
    return database


async def _workspace(request: Request) -> str:
    """The caller's workspace, created (with its demo campaigns) on its first request."""
    workspace: str = request.scope["apikey"].workspace
    await _database(request).ensure_workspace(workspace)
    return workspace


# -- pagination ----------------------------------------------------------------------------


def _single(request: Request, name: str) -> str | None:
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise Problem.invalid_parameter(name, "must be given at most once")
    return values[0] if values else None


def _limit(request: Request) -> int:
    raw = _single(request, "limit")
    if raw is None:
        return DEFAULT_LIMIT
    if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= MAX_LIMIT:
        raise Problem.invalid_parameter("limit", f"must be an integer from 1 to {MAX_LIMIT}")
    return int(raw)


def encode_cursor(after: tuple[datetime, str]) -> str:
    """An opaque cursor: base64url of the last row's `[created_at, id]`."""
    created_at, row_id = after
    raw = json.dumps([created_at.isoformat(), row_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _cursor(request: Request) -> tuple[datetime, str] | None:
    raw = _single(request, "cursor")
    if raw is None:
        return None
    invalid = Problem.invalid_parameter("cursor", "is not a cursor this API returned")
    if not raw or len(raw) > MAX_CURSOR_LENGTH:
        raise invalid
    try:
        decoded = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except (ValueError, binascii.Error, RecursionError):
        raise invalid from None
    if not (isinstance(decoded, list) and len(decoded) == 2):
        raise invalid
    created, row_id = decoded
    if not (isinstance(created, str) and isinstance(row_id, str) and _ID.fullmatch(row_id)):
        raise invalid
    try:
        created_at = datetime.fromisoformat(created)
        if created_at.tzinfo is None:
            raise invalid
        # In range as a time of its own zone, but maybe not once moved to UTC.
        created_at = created_at.astimezone(UTC)
    except (ValueError, OverflowError):
        raise invalid from None
    return created_at, row_id


def _page_json(page: Page, render: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    return {
        "data": [render(row) for row in page.rows],
        "next_cursor": None if page.after is None else encode_cursor(page.after),
    }


# -- endpoints -----------------------------------------------------------------------------


async def list_contacts(request: Request) -> Response:
    limit, after = _limit(request), _cursor(request)
    workspace = await _workspace(request)
    page = await _database(request).list_contacts(workspace, limit, after)
    return JSONResponse(_page_json(page, contact_json))


async def create_contact(request: Request) -> Response:
    fields = validate_contact(await read_json(request))
    workspace = await _workspace(request)
    row = await _database(request).add_contact(workspace, fields)
    return JSONResponse(
        contact_json(row),
        status_code=201,
        headers={"Location": f"/api/v1/contacts/{row['id']}"},
    )


async def get_contact(request: Request) -> Response:
    contact_id: str = request.path_params["contact_id"]
    if not _ID.fullmatch(contact_id):
        raise Problem.not_found("contact")
    workspace = await _workspace(request)
    row = await _database(request).get_contact(workspace, contact_id)
    if row is None:  # another workspace's contact is just as absent
        raise Problem.not_found("contact")
    return JSONResponse(contact_json(row))


async def list_campaigns(request: Request) -> Response:
    limit, after = _limit(request), _cursor(request)
    workspace = await _workspace(request)
    page = await _database(request).list_campaigns(workspace, limit, after)
    return JSONResponse(_page_json(page, campaign_json))


async def trigger_campaign(request: Request) -> Response:
    campaign_id: str = request.path_params["campaign_id"]
    if not _ID.fullmatch(campaign_id):
        raise Problem.not_found("campaign")
    workspace = await _workspace(request)
    run_id = await _database(request).trigger_campaign(workspace, campaign_id)
    if run_id is None:
        raise Problem.not_found("campaign")
    return JSONResponse(
        {"campaign_id": campaign_id, "run_id": run_id, "status": "queued"}, status_code=202
    )


# -- the table -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Operation:
    method: str
    path: str
    scope: str
    endpoint: Endpoint
    query: frozenset[str] = frozenset()
    """The query parameters it takes; others are refused, like unknown body fields."""


_PAGE = frozenset({"limit", "cursor"})


OPERATIONS: tuple[Operation, ...] = (
    Operation("GET", "/api/v1/contacts", "contacts:read", list_contacts, _PAGE),
    Operation("POST", "/api/v1/contacts", "contacts:write", create_contact),
    Operation("GET", "/api/v1/contacts/{contact_id}", "contacts:read", get_contact),
    Operation("GET", "/api/v1/campaigns", "campaigns:read", list_campaigns, _PAGE),
    Operation(
        "POST", "/api/v1/campaigns/{campaign_id}/trigger", "campaigns:trigger", trigger_campaign
    ),
)


def scope_rules() -> dict[str, str]:
    """The middleware's `scopes` table: `{"GET /api/v1/contacts": "contacts:read", …}`."""
    return {f"{op.method} {op.path}": op.scope for op in OPERATIONS}


OPENAPI_PATH = "/api/v1/openapi.json"
"""Served without a key under `/api/`, like GitHub's signed alerts (`leaks.PATH`)."""


MANAGEMENT_PATH = "/v1/api-keys"
"""Where the management API (`apikeys.api`) is mounted: outside `/api/`, since it
authenticates its own calls, with the scopes `apikeys:read` and `apikeys:write`."""


def protected_prefixes() -> list[str]:
    """What the middleware protects: everything under `/api/` but its `public` paths
    (`OPENAPI_PATH`, and `leaks.PATH`, which checks GitHub's signature instead).

    So a path no operation serves is authenticated too, and its 404 carries the same
    RateLimit headers as any other answer to a key.
    """
    return ["/api/"]


def _by_method(operations: dict[str, Operation]) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        operation = operations["GET" if request.method == "HEAD" else request.method]
        for name in request.query_params:
            # A misspelt `limt=10` is a bug worth hearing about, not a silent default.
            if name not in operation.query:
                raise Problem.invalid_parameter(name, "is not a parameter of this operation")
        return await operation.endpoint(request)

    return endpoint


def routes() -> list[Route]:
    """One route per path, so a wrong method gets 405 with every allowed method in `Allow`."""
    paths: dict[str, dict[str, Operation]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = op
    return [
        Route(path, _by_method(operations), methods=list(operations))
        for path, operations in paths.items()
    ]
