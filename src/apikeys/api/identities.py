"""The management API's identity endpoints: create, list, get, update, disable, enable,
revoke; the CLI's verbs (`apikeys identities …`), in the caller's workspace.

Every field of an identity is the operator's (`apikeys.identities.EDITABLE_FIELDS`), so
its writes need `apikeys:admin` (the route table of `apikeys.api.app`), named among the
caller's scopes: full access alone, which passes every other scope check, does not let a
customer's key lift its own identity's limits or credits. Reads need `apikeys:read`.
Another workspace's identity answers as an unknown one.

An identity made here gets an id the API draws (`new_identity_id`), never one the caller
names: identity ids are the store's, shared by every workspace, so a create that named one
would answer "taken" for another workspace's id, telling the caller which ids exist there.
A customer's own reference for it goes in `metadata`. The Python API and the command line
(the operator's) keep ids the application chooses.
"""

from __future__ import annotations

import secrets
from typing import Final

from starlette.requests import Request
from starlette.responses import Response

from apikeys.api.http import Caller, Endpoint, check_if_match, etag_of, json_response, read_json
from apikeys.api.keys import int_param, text_param
from apikeys.api.schemas import IDENTITY_CREATE, IDENTITY_UPDATE, NO_BODY, check_body
from apikeys.errors import InvalidKeyParameters, KeyNotFound, ResourceNotFound
from apikeys.identities import IdentityRecord
from apikeys.keys import BASE62
from apikeys.listing import MAX_PAGE_SIZE
from apikeys.manager import KeyManager

__all__ = ["IDENTITY_ID_PREFIX", "IdentityEndpoints", "new_identity_id"]

IDENTITY_ID_PREFIX: Final = "idn_"
"""How the ids of identities made through the API start."""


def new_identity_id() -> str:
    """A new identity id: `idn_` and 22 random base62 characters (131 bits, so no two are
    ever drawn alike and none can be guessed), a valid `check_identity_id` id."""
    return IDENTITY_ID_PREFIX + "".join(secrets.choice(BASE62) for _ in range(22))


class IdentityEndpoints:
    """The identity endpoints of one `ManagementAPI`, on `manager`."""

    def __init__(self, manager: KeyManager) -> None:
        self.manager = manager

    async def own(self, caller: Caller, identity_id: str) -> IdentityRecord:
        """The caller's workspace's identity; `ResourceNotFound` for any other id."""
        try:
            record = await self.manager.get_identity(identity_id)
        except (KeyNotFound, InvalidKeyParameters):
            raise ResourceNotFound() from None
        if not caller.sees(record.workspace):
            raise ResourceNotFound()
        return record

    async def create(self, request: Request) -> Response:
        caller = Caller.of(request)
        caller.check_admin()
        body = check_body(await read_json(request), IDENTITY_CREATE)
        given = {name: value for name, value in body.items() if value is not None}
        record = await self.manager.create_identity(
            new_identity_id(), workspace=caller.workspace, actor=caller.actor, **given
        )
        return json_response(201, record.to_dict(), etag=etag_of(record))

    async def list(self, request: Request) -> Response:
        page = await self.manager.list_identities_page(
            Caller.of(request).workspace,
            limit=int_param(request, "limit", 100, 1, MAX_PAGE_SIZE),
            cursor=text_param(request, "cursor", 1000),
        )
        items = [record.to_dict() for record in page.records]
        return json_response(200, {"items": items, "next_cursor": page.next_cursor})

    async def get(self, request: Request) -> Response:
        record = await self.own(Caller.of(request), request.path_params["identity_id"])
        return json_response(200, record.to_dict(), etag=etag_of(record))

    async def update(self, request: Request) -> Response:
        caller = Caller.of(request)
        caller.check_admin()
        record = await self.own(caller, request.path_params["identity_id"])
        body = check_body(await read_json(request), IDENTITY_UPDATE)
        check_if_match(request, record)
        updated = await self.manager.update_identity(record.id, actor=caller.actor, **body)
        return json_response(200, updated.to_dict(), etag=etag_of(updated))

    def state_change(self, action: str) -> Endpoint:
        """The endpoint of `action`: `disable`, `enable` or `revoke`."""
        change = {
            "disable": self.manager.disable_identity,
            "enable": self.manager.enable_identity,
            "revoke": self.manager.revoke_identity,
        }[action]

        async def endpoint(request: Request) -> Response:
            caller = Caller.of(request)
            caller.check_admin()
            record = await self.own(caller, request.path_params["identity_id"])
            check_body(await read_json(request, empty_ok=True), NO_BODY)
            check_if_match(request, record)
            changed = await change(record.id, actor=caller.actor)
            return json_response(200, changed.to_dict(), etag=etag_of(changed))

        return endpoint
