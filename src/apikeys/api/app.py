"""`ManagementAPI`: the management API as an ASGI app, behind its own `APIKeyMiddleware`.

```python
app = Starlette(routes=[Mount("/v1/api-keys", app=ManagementAPI(manager))])
```

Every call but `GET /openapi.json` is authenticated by a key through the same request path
as any call (`apikeys.gate`): its scopes, rate limits (with `RateLimit` headers), address
allowlist and credits apply. The routes, the scope each needs and the OpenAPI document
come from one table (`apikeys.api.operations`). The webhook routes answer the operators
only (`apikeys.api.webhooks`): to every other caller they are paths that are no operation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive as StarletteReceive

from apikeys.api.http import (
    MAX_BODY_BYTES,
    Caller,
    Endpoint,
    answers,
    json_response,
    problem_response,
    refusal_of,
)
from apikeys.api.idempotency import Idempotency
from apikeys.api.identities import IdentityEndpoints
from apikeys.api.keys import KeyEndpoints
from apikeys.api.openapi import openapi_document
from apikeys.api.operations import OPERATIONS, scope_rules
from apikeys.api.webhooks import OperatorsOnly, WebhookEndpoints
from apikeys.credentials import KeyReader
from apikeys.errors import APIKeyError, ConfigurationError, MethodNotAllowed, ResourceNotFound
from apikeys.fields import check_workspace_fields
from apikeys.leaks.http import read_body
from apikeys.manager import KeyManager
from apikeys.middleware import APIKeyMiddleware
from apikeys.ratelimit import RateLimiter
from apikeys.types import Message, Receive, Scope, Send

__all__ = ["ManagementAPI"]


def _replaying(body: bytes) -> StarletteReceive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


class ManagementAPI:
    """The management API of `manager`'s keys: mount it (`Mount("/v1/api-keys",
    app=ManagementAPI(manager))`) or serve it alone.

    - `workspace_fields`: key fields the operator lets callers with `apikeys:write` set
      besides their own (`apikeys.fields`; the settings page's option of the same name).
    - `rate_limit`, `limiter_url`, `limiter`, `header`, `realm`, `trusted_proxies`: as
      `APIKeyMiddleware`'s, for the management calls themselves.
    - `operators`: the workspaces whose callers are operators: a key of one of them that
      names `apikeys:admin` among its scopes manages the webhooks of every workspace
      (`apikeys.api.webhooks`). None by default: then the webhook routes answer nobody,
      and the OpenAPI document does not list them. The store must keep webhooks
      (`KeyStore.webhooks()`) when operators are named.
    - `title`: the OpenAPI document's title.

    The key store must keep one-time values (`KeyStore.put_once`; every store of apikeys
    does): `Idempotency-Key` answers are kept there, sealed.
    """

    def __init__(
        self,
        manager: KeyManager,
        *,
        workspace_fields: Collection[str] = (),
        rate_limit: str | Mapping[str, str] | None = None,
        limiter_url: str = "memory://",
        limiter: RateLimiter | None = None,
        header: str = "Authorization",
        realm: str = "apikeys",
        trusted_proxies: int = 0,
        operators: Collection[str] = (),
        title: str = "API keys",
    ) -> None:
        store = manager.store
        if not (store.keeps_one_time_values() and store.compares_one_time_values()):
            raise ConfigurationError(
                "the management API keeps Idempotency-Key answers in the key store: "
                f"{type(store).__name__} does not keep one-time values atomically (put_once, "
                "take_once, peek_once, put_once_if_absent and replace_once)"
            )
        if isinstance(operators, str):
            raise ConfigurationError("operators is a collection of workspaces, not one string")
        hooks = store.webhooks()
        if operators and hooks is None:
            raise ConfigurationError(
                f"operators manage webhooks: {type(store).__name__} keeps none here "
                "(a shared SQL or Redis store does, and MemoryStore)"
            )
        self.manager = manager
        self._reader = KeyReader(header)
        self.document = openapi_document(title=title, webhooks=bool(operators), header=header)
        """The OpenAPI 3.1 document served at `/openapi.json`."""
        keys = KeyEndpoints(manager, check_workspace_fields(workspace_fields))
        identities = IdentityEndpoints(manager)
        endpoints: dict[str, Endpoint] = {
            "create_key": keys.create,
            "list_keys": keys.list,
            "get_key": keys.get,
            "update_key": keys.update,
            "roll_key": keys.roll,
            "key_usage": keys.usage,
            "audit": keys.audit,
            "create_identity": identities.create,
            "list_identities": identities.list,
            "get_identity": identities.get,
            "update_identity": identities.update,
        }
        for action in ("disable", "enable", "revoke"):
            endpoints[f"{action}_key"] = keys.state_change(action)
            endpoints[f"{action}_identity"] = identities.state_change(action)
        if operators and hooks is not None:
            webhooks = WebhookEndpoints(manager, hooks)
            endpoints.update(
                list_webhook_deliveries=webhooks.deliveries,
                get_webhook_delivery=webhooks.get_delivery,
                replay_webhook_delivery=webhooks.replay,
                create_webhook=webhooks.create,
                list_webhooks=webhooks.list,
                get_webhook=webhooks.get,
                remove_webhook=webhooks.remove,
                roll_webhook_secret=webhooks.roll,
            )
        routes = [Route("/openapi.json", self._openapi, methods=["GET"])]
        for operation in OPERATIONS:
            if operation.id not in endpoints:
                continue  # an operators' operation, with no operators
            endpoint = answers(endpoints[operation.id], [name for name, _ in operation.query])
            if operation.method == "POST":
                endpoint = self._idempotent(endpoint)
            routes.append(Route(operation.path, endpoint, methods=[operation.method]))
        router = Starlette(
            routes=routes,
            exception_handlers={HTTPException: self._http_error},
        )
        self.middleware = APIKeyMiddleware(
            OperatorsOnly(router, operators),
            manager=manager,
            scopes=scope_rules(),
            protect="/",
            public=["/openapi.json"],
            rate_limit=rate_limit,
            limiter_url=limiter_url,
            limiter=limiter,
            realm=realm,
            header=header,
            trusted_proxies=trusted_proxies,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.middleware(scope, receive, send)

    async def _openapi(self, request: Request) -> Response:
        return json_response(200, self.document)

    @staticmethod
    async def _http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "GET")
            return problem_response(MethodNotAllowed([m.strip() for m in allowed.split(",")]))
        return problem_response(ResourceNotFound())

    def _idempotent(self, endpoint: Endpoint) -> Endpoint:
        """`endpoint`, giving a retry with the same `Idempotency-Key` the first answer."""
        reader = self._reader
        store = self.manager.store

        async def answer(request: Request) -> Response:
            idempotency_key = request.headers.get("idempotency-key")
            if idempotency_key is None:
                return await endpoint(request)
            try:
                body = await read_body(request.scope, request.receive, MAX_BODY_BYTES)
                guard = Idempotency(
                    store,
                    caller_id=Caller.of(request).record.id,
                    caller_token=reader.read(request.scope["headers"]),
                    idempotency_key=idempotency_key,
                    request=b"\0".join((request.method.encode(), request.url.path.encode(), body)),
                )
                kept = await guard.begin()
            except APIKeyError as exc:
                return problem_response(refusal_of(exc))
            if kept is not None:
                headers = {"idempotent-replayed": "true", "cache-control": "no-store"}
                return Response(kept.body, kept.status, headers, "application/json")
            response = await self._run(endpoint, Request(request.scope, _replaying(body)), guard)
            return response

        return answer

    @staticmethod
    async def _run(endpoint: Endpoint, request: Request, guard: Idempotency) -> Response:
        try:
            response = await endpoint(request)
        except BaseException:
            await _quietly(guard.abandon())
            raise
        if 200 <= response.status_code < 300:
            # The answer goes out even if it cannot be kept: a retry then runs again.
            await _quietly(guard.keep(response.status_code, bytes(response.body)))
        else:
            await _quietly(guard.abandon())
        return response


async def _quietly(step: Any) -> None:
    with contextlib.suppress(APIKeyError):
        await step
