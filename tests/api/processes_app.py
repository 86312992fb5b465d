"""The app `test_api_processes.py` serves with `uvicorn --workers 2`: the management API
mounted at `/v1/api-keys` beside a protected route, as an application mounts it.

Configured by environment: `APIKEYS_STORE_URL`, `APIKEYS_PEPPER`, and
`APIKEYS_WEBHOOKS_ALLOW_PRIVATE` (the test's receiver listens on 127.0.0.1). Each process
caches keys and delivers webhooks as any process with a `KeyManager` does.

Every answer, a refusal of the middleware too, names the process that gave it in the
`X-Worker-Pid` header, so a test can tell that both workers answered; `/health` says how
many answers the process's key cache gave.
"""

from __future__ import annotations

import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from apikeys import APIKeyMiddleware, Hasher, KeyManager
from apikeys.api import ManagementAPI
from apikeys.types import ASGIApp, Message, Receive, Scope, Send

PID_HEADER = "x-worker-pid"


async def health(request: Request) -> JSONResponse:
    """This process, and the answers its key cache gave (None: it caches no keys)."""
    cache = request.app.state.manager.cache
    return JSONResponse(
        {
            "pid": os.getpid(),
            "cache_hits": None if cache is None else cache.hits,
            "cache_fresh": None if cache is None else cache.fresh,
        }
    )


async def whoami(request: Request) -> JSONResponse:
    return JSONResponse({"id": request.scope["apikey"].id})


class NamesWorker:
    """Adds `X-Worker-Pid` to every HTTP answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.pid = str(os.getpid()).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (PID_HEADER.encode(), self.pid)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, named)


def build() -> ASGIApp:
    manager = KeyManager(
        os.environ["APIKEYS_STORE_URL"], hasher=Hasher(pepper=os.environ["APIKEYS_PEPPER"])
    )
    routes = [
        Route("/health", health),
        Route("/api/v1/contacts", whoami),
        Mount("/v1/api-keys", app=ManagementAPI(manager, rate_limit="100000/minute")),
    ]
    inner = Starlette(routes=routes)
    inner.state.manager = manager
    protected = APIKeyMiddleware(
        inner,
        manager=manager,
        scopes={"GET /api/v1/contacts": "contacts:read"},
        protect="/api/",
        rate_limit="100000/minute",
    )
    return NamesWorker(protected)


app = build()
