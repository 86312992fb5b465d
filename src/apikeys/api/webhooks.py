"""The management API's webhook endpoints, for operators only: list, add, show and remove
webhook endpoints, roll an endpoint's signing secret, list and show deliveries, and replay
one; the verbs of `apikeys webhooks …`, on every workspace's endpoints and deliveries.

Webhooks are the operator's (CONTRACT 14): an endpoint may be sent every workspace's
events, and it is how the operator's systems learn of changes. So a caller is an operator
only when both hold (`is_operator`):

- its key's workspace is one that `ManagementAPI(manager, operators={"ops"})` names (none
  by default: then nobody is);
- its key names `apikeys:admin` among its scopes (full access alone does not give it, as
  for identities: `Caller.check_admin`).

To any other caller, each webhook path answers exactly what a path that is no operation
answers (`OperatorsOnly`): `404 not_found` with the same problem+json body whatever the
method, so nothing tells that the routes exist. An operator sees the endpoints and
deliveries of every workspace. An endpoint's signing secret is in the answer of its
create and of each roll, once, as a key's secret is; it is never shown again. As through
the CLI, these changes make no audit event (the audit trail is of keys and identities).
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta
from typing import Final

from starlette.requests import Request
from starlette.responses import Response

from apikeys.api.http import json_response, problem_response, read_json
from apikeys.api.keys import choice_param, int_param, text_param
from apikeys.api.operations import ADMIN_SCOPE
from apikeys.api.schemas import NO_BODY, WEBHOOK_CREATE, WEBHOOK_ROLL, check_body
from apikeys.errors import (
    Conflict,
    DeliveryInProgress,
    InvalidKeyParameters,
    InvalidPayload,
    ResourceNotFound,
    WebhookTargetRefused,
)
from apikeys.gate import route_path
from apikeys.listing import MAX_PAGE_SIZE, decode_delivery_cursor, encode_cursor
from apikeys.manager import KeyManager
from apikeys.policies import check_text
from apikeys.routes import routed_as
from apikeys.stores.contract import WebhookStore
from apikeys.types import ASGIApp, KeyRecord, Receive, Scope, Send, utcnow
from apikeys.webhooks.admin import DEFAULT_OVERLAP, add_endpoint, roll_endpoint_secret
from apikeys.webhooks.model import Delivery, Endpoint

__all__ = ["WEBHOOKS_PATH", "OperatorsOnly", "WebhookEndpoints", "is_operator"]

WEBHOOKS_PATH: Final = "/webhooks"
"""Where the webhook operations are, relative to where the API is mounted."""

_MAX_ID_LENGTH: Final = 64
_STATUSES: Final = ("pending", "delivered", "failed")


def is_operator(record: KeyRecord, operators: Collection[str]) -> bool:
    """Whether the caller's key `record` is an operator's: of a workspace of `operators`,
    with `apikeys:admin` named among its scopes."""
    return record.workspace in operators and ADMIN_SCOPE in record.scopes


class OperatorsOnly:
    """The ASGI app `app` (the management API's router, behind its `APIKeyMiddleware`),
    answering a request under `/webhooks` of a caller who is no operator as a path that is
    no operation: `404 not_found`, body for body."""

    def __init__(self, app: ASGIApp, operators: Collection[str]) -> None:
        self.app = app  # `app`, so that `apikeys.routes.routes_of` looks through this
        self.operators = frozenset(operators)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._refused(scope):
            await problem_response(ResourceNotFound())(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refused(self, scope: Scope) -> bool:
        path = routed_as(route_path(scope))  # `/webhooks` and a line break is routed there
        if path != WEBHOOKS_PATH and not path.startswith(WEBHOOKS_PATH + "/"):
            return False
        record = scope.get("apikey")
        return not (isinstance(record, KeyRecord) and is_operator(record, self.operators))


class WebhookEndpoints:
    """The webhook endpoints of one `ManagementAPI`, on `manager`'s store (which keeps
    webhooks: `ManagementAPI` checks it when it is given operators)."""

    def __init__(self, manager: KeyManager, hooks: WebhookStore) -> None:
        self.manager = manager
        self.hooks = hooks

    async def endpoint(self, webhook_id: str) -> Endpoint:
        """The endpoint `webhook_id`; `ResourceNotFound` when there is none."""
        if len(webhook_id) <= _MAX_ID_LENGTH:
            for endpoint in await self.hooks.endpoints():
                if endpoint.id == webhook_id:
                    return endpoint
        raise ResourceNotFound()

    async def delivery(self, delivery_id: str) -> Delivery:
        """The delivery `delivery_id`; `ResourceNotFound` when there is none."""
        found = None
        if len(delivery_id) <= _MAX_ID_LENGTH:
            found = await self.hooks.delivery(delivery_id)
        if found is None:
            raise ResourceNotFound()
        return found

    async def create(self, request: Request) -> Response:
        body = check_body(await read_json(request), WEBHOOK_CREATE)
        try:
            endpoint = await add_endpoint(
                self.hooks,
                body["url"],
                events=body.get("events") or (),
                workspace=body.get("workspace"),
                hasher=self.manager.hasher,
            )
        except WebhookTargetRefused as exc:
            raise InvalidPayload([{"field": "url", "message": str(exc)[:300]}]) from None
        return json_response(201, {**endpoint.to_dict(), "secret": endpoint.secret})

    async def list(self, request: Request) -> Response:
        endpoints = await self.hooks.endpoints()
        return json_response(200, {"items": [endpoint.to_dict() for endpoint in endpoints]})

    async def get(self, request: Request) -> Response:
        endpoint = await self.endpoint(request.path_params["webhook_id"])
        return json_response(200, endpoint.to_dict())

    async def remove(self, request: Request) -> Response:
        endpoint = await self.endpoint(request.path_params["webhook_id"])
        if not await self.hooks.remove_endpoint(endpoint.id):
            raise ResourceNotFound()  # removed meanwhile
        return json_response(200, endpoint.to_dict())

    async def roll(self, request: Request) -> Response:
        endpoint = await self.endpoint(request.path_params["webhook_id"])
        body = check_body(await read_json(request, empty_ok=True), WEBHOOK_ROLL)
        overlap = body.get("overlap_seconds")
        span = DEFAULT_OVERLAP if overlap is None else timedelta(seconds=overlap)
        secret = await roll_endpoint_secret(
            self.hooks, endpoint.id, span, hasher=self.manager.hasher
        )
        if secret is None:
            raise ResourceNotFound()  # removed meanwhile
        return json_response(200, {**endpoint.to_dict(), "secret": secret})

    async def deliveries(self, request: Request) -> Response:
        size = int_param(request, "limit", 100, 1, MAX_PAGE_SIZE)
        cursor, workspace = text_param(request, "cursor", 1000), text_param(request, "workspace")
        try:
            start = None if cursor is None else decode_delivery_cursor(cursor)
        except InvalidKeyParameters as exc:
            raise InvalidPayload([{"field": "cursor", "message": str(exc)}]) from None
        try:
            # Text no workspace is (a control character) names none: refused, as for keys.
            workspace = None if workspace is None else check_text(workspace, "workspace")
        except InvalidKeyParameters as exc:
            raise InvalidPayload([{"field": "workspace", "message": str(exc)}]) from None
        found = await self.hooks.deliveries_page(
            start,
            status=choice_param(request, "status", _STATUSES),  # type: ignore[arg-type]
            workspace=workspace,
            limit=size + 1,
        )
        page, next_cursor = found[:size], None
        # A store of your own whose deliveries carry no order is listed one page deep.
        if len(found) > size and page[-1].order is not None:
            next_cursor = encode_cursor((page[-1].order, page[-1].id))
        items = [delivery.to_dict() for delivery in page]
        return json_response(200, {"items": items, "next_cursor": next_cursor})

    async def get_delivery(self, request: Request) -> Response:
        delivery = await self.delivery(request.path_params["delivery_id"])
        return json_response(200, delivery.to_dict())

    async def replay(self, request: Request) -> Response:
        delivery = await self.delivery(request.path_params["delivery_id"])
        check_body(await read_json(request, empty_ok=True), NO_BODY)
        try:
            replayed = await self.hooks.replay(delivery.id, utcnow())
        except DeliveryInProgress:
            raise Conflict(
                "The delivery is being sent now: replay it once this attempt has ended."
            ) from None
        if not replayed:
            raise ResourceNotFound()  # pruned or removed meanwhile
        return json_response(200, (await self.delivery(delivery.id)).to_dict())
