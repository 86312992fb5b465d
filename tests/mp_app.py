"""The app `test_multiprocess.py` serves with real uvicorn processes, configured by environment.

- `APIKEYS_STORE_URL`, `APIKEYS_TEST_STORE_OPTIONS` (JSON keyword arguments of the store),
- `APIKEYS_LIMITER_URL`, `APIKEYS_RATE_LIMIT` (the default per-key limit),
- `APIKEYS_PEPPER`, `APIKEYS_TEST_FLUSH_INTERVAL` (seconds between usage flushes).

Every response names the process that answered it (`pid`), so a test can tell the workers
apart.
"""

from __future__ import annotations

import json
import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from apikeys import APIKeyMiddleware, Hasher, KeyManager, store_from_url

SCOPES = {
    "GET /api/v1/contacts": "contacts:read",
    "GET /api/v1/admin": "admin:write",
}


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"pid": os.getpid()})


async def whoami(request: Request) -> JSONResponse:
    return JSONResponse({"pid": os.getpid(), "id": request.scope["apikey"].id})


def build() -> APIKeyMiddleware:
    options = json.loads(os.environ.get("APIKEYS_TEST_STORE_OPTIONS") or "{}")
    manager = KeyManager(
        store_from_url(os.environ["APIKEYS_STORE_URL"], **options),
        hasher=Hasher(pepper=os.environ["APIKEYS_PEPPER"]),
        usage_flush_interval=float(os.environ.get("APIKEYS_TEST_FLUSH_INTERVAL") or 1.0),
    )
    inner = Starlette(
        routes=[
            Route("/health", health),
            Route("/api/v1/contacts", whoami),
            Route("/api/v1/admin", whoami),
        ]
    )
    return APIKeyMiddleware(
        inner,
        manager=manager,
        scopes=SCOPES,
        protect="/api/",
        rate_limit=os.environ.get("APIKEYS_RATE_LIMIT") or "100000/minute",
        limiter_url=os.environ["APIKEYS_LIMITER_URL"],
    )


app = build()
