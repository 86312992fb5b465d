"""The management API's key endpoints: create, list, get, update, roll, disable, enable,
revoke, usage, and the workspace's audit trail.

Every change a caller asks for goes through `apikeys.fields.check_change` as a workspace
user's, exactly as the settings page's does: the fields the table gives the workspace
(and those the operator handed over, `workspace_fields`), scopes within the caller's own
(any, for a full-access caller), an expiry no later than the key's nor the caller's own
(a key made by a key that expires expires with it at the latest). A roll hands the caller a
new secret with the key's grants, so it is a create of them: refused for a key with scopes
beyond the caller's; the new key keeps the key's expiry (`workspace_roll_expiry`), or the
caller's if that comes first. The audit trail names the caller as `key:<id>`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import timedelta
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import Response

from apikeys.api.http import Caller, Endpoint, check_if_match, etag_of, json_response, read_json
from apikeys.api.operations import ADMIN_SCOPE
from apikeys.api.schemas import KEY_CREATE, KEY_UPDATE, NO_BODY, ROLL, check_body
from apikeys.errors import (
    Conflict,
    ForbiddenField,
    InvalidPayload,
    KeyNotFound,
    ResourceNotFound,
)
from apikeys.fields import KEY_FIELDS, Role, check_change, workspace_roll_expiry
from apikeys.lifecycle import refusal
from apikeys.listing import MAX_PAGE_SIZE
from apikeys.manager import KeyManager
from apikeys.types import Environment, KeyRecord, utcnow

__all__ = ["KeyEndpoints", "choice_param", "int_param", "text_param"]

MAX_ID_LENGTH: Final = 64
_STATES: Final = ("active", "disabled", "expired", "revoked")
_ENVIRONMENTS: Final = ("live", "test")
# The fields a body passes on to the manager as they are (None clears them on update):
# every field of the table a create or update may set, but the access, which `_access` reads.
_ACCESS_FIELDS: Final = ("access", "scopes")
_PLAIN: Final = tuple(name for name in KEY_FIELDS if name not in _ACCESS_FIELDS)


def _bad_param(name: str, message: str) -> InvalidPayload:
    return InvalidPayload([{"field": name, "message": message}])


def int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    """The query parameter `name` as an integer from `low` to `high`; else `InvalidPayload`."""
    text = request.query_params.get(name)
    if text is None:
        return default
    if not (text.isascii() and text.isdigit() and len(text) <= 10 and low <= int(text) <= high):
        raise _bad_param(name, f"must be an integer from {low} to {high}")
    return int(text)


def choice_param(request: Request, name: str, choices: Collection[str]) -> str | None:
    """The query parameter `name`, one of `choices`, or None; else `InvalidPayload`."""
    text = request.query_params.get(name)
    if text is not None and text not in choices:
        raise _bad_param(name, f"must be one of {', '.join(choices)}")
    return text


def text_param(request: Request, name: str, limit: int = 200) -> str | None:
    """The query parameter `name`, 1 to `limit` characters, or None; else `InvalidPayload`."""
    text = request.query_params.get(name)
    if text is not None and not 1 <= len(text) <= limit:
        raise _bad_param(name, f"must be 1 to {limit} characters")
    return text


def _access(body: Mapping[str, Any], current: KeyRecord | None) -> dict[str, Any]:
    if "access" not in body and "scopes" not in body:
        return {}
    access = body.get("access") or ("restricted" if current is None else current.access)
    if access == "full":
        return {"full_access": True, "scopes": body.get("scopes") or ()}
    scopes = body.get("scopes")
    if scopes is None and current is not None:
        scopes = current.scopes
    return {"full_access": False, "scopes": scopes or ()}


def _inherited(caller: KeyRecord, given: Mapping[str, Any]) -> dict[str, Any]:
    """`given` with what a key made by the `caller` key takes of it: its identity (whose
    limits and credits then bound both), its rate limit, its allowlist and its expiry,
    where `given` names none; a key with credits of its own makes none (`ForbiddenField`):
    theirs would add to its own. So making keys never gets a caller more than it holds."""
    if caller.credits is not None:
        raise ForbiddenField(
            "credits", "a key with credits of its own makes none: theirs would add to its own"
        )
    inherited = {
        "identity": caller.identity,
        "rate_limit": caller.rate_limit,
        "allowed_ips": caller.allowed_ips,
        "expires_at": caller.expires_at,
    }
    kept = {name: value for name, value in inherited.items() if value not in (None, ())}
    return {**kept, **given}


def _check_roll_bounds(caller: KeyRecord, record: KeyRecord) -> None:
    """`ForbiddenField` unless the key `record` is bounded as the `caller` key is: a roll
    hands the caller a new secret of it, limits and all, so a caller bound by an identity,
    a rate limit, an allowlist or credits of its own rolls only keys bound alike (those it
    made inherit its bounds), and a key with credits of its own only itself."""
    if record.id == caller.id:
        return
    bounds = (
        ("credits", caller.credits is not None, "a key with credits of its own rolls no other"),
        ("identity", caller.identity not in (None, record.identity), "it is not of yours"),
        ("rate_limit", caller.rate_limit not in (None, record.rate_limit), "it differs"),
        (
            "allowed_ips",
            bool(caller.allowed_ips)
            and not (record.allowed_ips and set(record.allowed_ips) <= set(caller.allowed_ips)),
            "it allows addresses yours does not",
        ),
    )
    for field, exceeds, why in bounds:
        if exceeds:
            raise ForbiddenField(field, f"the key's {field} is beyond the caller's: {why}")


class KeyEndpoints:
    """The key endpoints of one `ManagementAPI`, on `manager`."""

    def __init__(self, manager: KeyManager, workspace_fields: Collection[str]) -> None:
        self.manager = manager
        self.workspace_fields = frozenset(workspace_fields)

    async def own(self, caller: Caller, key_id: str) -> KeyRecord:
        """The caller's workspace's key `key_id`; `ResourceNotFound` for an unknown id and
        for another workspace's alike."""
        if len(key_id) > MAX_ID_LENGTH:
            raise ResourceNotFound()
        try:
            record = await self.manager.get(
                key_id, workspace=caller.workspace, environment=caller.record.environment
            )
        except KeyNotFound:
            raise ResourceNotFound() from None
        if not caller.sees_key(record):
            raise ResourceNotFound()
        return record

    def check(self, caller: Caller, body: Mapping[str, Any], current: KeyRecord | None) -> None:
        """`ForbiddenField` unless the caller may ask for `body` (the page's rule)."""
        asked = dict(body)
        if current is not None and asked.get("access") == "restricted" and "scopes" not in asked:
            # Restricted to the scopes it has: as if they were asked for, within the caller's.
            asked["scopes"] = current.scopes
        check_change(
            asked,
            role=Role.WORKSPACE,
            current=current,
            scope_ceiling=caller.scope_ceiling,
            workspace_fields=self.workspace_fields,
            expiry_ceiling=caller.record.expires_at,
        )
        scopes = asked.get("scopes")
        if isinstance(scopes, (list, tuple)) and ADMIN_SCOPE in scopes:
            # Full access and wildcards (`apikeys:*`) pass every other scope's ceiling, but
            # never give `apikeys:admin`: only a key that names it grants it.
            caller.check_admin()

    async def create(self, request: Request) -> Response:
        caller = Caller.of(request)
        body = check_body(await read_json(request), KEY_CREATE)
        self.check(caller, body, None)
        given = {name: body[name] for name in _PLAIN if body.get(name) is not None}
        created = await self.manager.create(
            workspace=caller.workspace,
            environment=caller.record.environment,
            actor=caller.actor,
            **_access(body, None),
            **_inherited(caller.record, given),
        )
        return json_response(201, created.to_dict(), etag=etag_of(created.record))

    async def list(self, request: Request) -> Response:
        caller = Caller.of(request)
        own = caller.record.environment
        filters = {
            "owner": text_param(request, "owner"),
            "status": choice_param(request, "state", _STATES),
            "limit": int_param(request, "limit", 100, 1, MAX_PAGE_SIZE),
            "cursor": text_param(request, "cursor", 1000),
            "identity": text_param(request, "identity", 64),
        }
        if choice_param(request, "environment", _ENVIRONMENTS) not in (None, own):
            # The caller sees keys of its own environment only: none of the other one.
            return json_response(200, {"items": [], "next_cursor": None})
        page = await self.manager.list_page(caller.workspace, environment=own, **filters)  # type: ignore[arg-type]
        items = [record.to_dict() for record in page.records]
        return json_response(200, {"items": items, "next_cursor": page.next_cursor})

    async def get(self, request: Request) -> Response:
        record = await self.own(Caller.of(request), request.path_params["key_id"])
        return json_response(200, record.to_dict(), etag=etag_of(record))

    async def update(self, request: Request) -> Response:
        caller = Caller.of(request)
        record = await self.own(caller, request.path_params["key_id"])
        body = check_body(await read_json(request), KEY_UPDATE)
        check_if_match(request, record)
        self.check(caller, body, record)
        given = {name: body[name] for name in _PLAIN if name in body}
        updated = await self.manager.update(
            record.id, actor=caller.actor, **_access(body, record), **given
        )
        return json_response(200, updated.to_dict(), etag=etag_of(updated))

    async def roll(self, request: Request) -> Response:
        caller = Caller.of(request)
        record = await self.own(caller, request.path_params["key_id"])
        body = check_body(await read_json(request, empty_ok=True), ROLL)
        check_if_match(request, record)
        why = refusal(record, "roll")
        if why is not None:
            raise Conflict(f"The key cannot be rolled: {why}.")
        # A roll hands the caller a new key with this one's grants: as if it asked for them,
        # and bounded as the caller is.
        self.check(caller, {"access": record.access, "scopes": record.scopes}, None)
        _check_roll_bounds(caller.record, record)
        # Never later than the key's own expiry (the operator's to move), nor the caller's.
        expires_at = workspace_roll_expiry(record, utcnow())
        ceiling = caller.record.expires_at
        if ceiling is not None and (expires_at is None or expires_at > ceiling):
            expires_at = ceiling
        created = await self.manager.roll(
            record.id,
            grace=timedelta(seconds=body.get("grace_seconds", 24 * 3600)),
            expires_at=expires_at,
            actor=caller.actor,
        )
        return json_response(201, created.to_dict(), etag=etag_of(created.record))

    def state_change(self, action: str) -> Endpoint:
        """The endpoint of `action`: `disable`, `enable` or `revoke`."""
        change = {
            "disable": self.manager.disable,
            "enable": self.manager.enable,
            "revoke": self.manager.revoke,
        }[action]

        async def endpoint(request: Request) -> Response:
            caller = Caller.of(request)
            record = await self.own(caller, request.path_params["key_id"])
            check_body(await read_json(request, empty_ok=True), NO_BODY)
            check_if_match(request, record)
            changed = await change(record.id, actor=caller.actor)
            return json_response(200, changed.to_dict(), etag=etag_of(changed))

        return endpoint

    async def usage(self, request: Request) -> Response:
        record = await self.own(Caller.of(request), request.path_params["key_id"])
        days = int_param(request, "days", 30, 1, 366)
        history = await self.manager.usage(record.id, days)
        return json_response(200, {"items": [day.to_dict() for day in history]})

    async def audit(self, request: Request) -> Response:
        caller = Caller.of(request)
        key_id = text_param(request, "key_id", MAX_ID_LENGTH)
        limit = int_param(request, "limit", 100, 1, MAX_PAGE_SIZE)
        cursor = text_param(request, "cursor", 1000)
        environment: Environment | None = caller.record.environment
        if key_id is not None:
            try:
                await self.own(caller, key_id)  # of its workspace and environment
            except ResourceNotFound:
                # Another's key shows what an unknown one shows: nothing.
                return json_response(200, {"items": [], "next_cursor": None})
            environment = None  # the key's, as just read
        page = await self.manager.audit_page(
            caller.workspace, key_id=key_id, environment=environment, limit=limit, cursor=cursor
        )
        items = [event.to_dict() for event in page.events]
        return json_response(200, {"items": items, "next_cursor": page.next_cursor})
