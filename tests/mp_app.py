"""The app `test_multiprocess.py` serves with real uvicorn processes, configured by environment.

- `APIKEYS_STORE_URL`, `APIKEYS_TEST_STORE_OPTIONS` (JSON keyword arguments of the store),
- `APIKEYS_LIMITER_URL`, `APIKEYS_RATE_LIMIT` (the default per-key limit),
- `APIKEYS_PEPPER`, `APIKEYS_TEST_FLUSH_INTERVAL` (seconds between usage flushes),
- `APIKEYS_TEST_CHANNEL_PORT`: the key cache's channel goes to this port of 127.0.0.1 (a TCP
  proxy a test can cut) instead of the store's own address.
- `APIKEYS_TEST_IDENTITY_ROUTE`: when set, `POST /test/identity` creates an identity and its
  keys in this process (the only way into a `memory://` store) and answers their secrets.

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

from apikeys import (
    APIKeyMiddleware,
    Channel,
    Hasher,
    KeyManager,
    KeyStore,
    RateLimiter,
    store_from_url,
)

SCOPES = {
    "GET /api/v1/contacts": "contacts:read",
    "GET /api/v1/admin": "admin:write",
}


async def health(request: Request) -> JSONResponse:
    cache = MANAGER.cache
    state = None if cache is None else {"fresh": cache.fresh, "hits": cache.hits}
    return JSONResponse({"pid": os.getpid(), "cache": state})


async def whoami(request: Request) -> JSONResponse:
    return JSONResponse({"pid": os.getpid(), "id": request.scope["apikey"].id})


async def make_identity(request: Request) -> JSONResponse:
    """Create the identity `{"identity": id, "rate_limit": …, "credits": …}` and one key per
    item of its `"keys"` (`{"rate_limit": …, "credits": …}`): their ids and secrets."""
    spec = await request.json()
    identity = spec["identity"]
    await MANAGER.create_identity(
        identity, workspace="mp", rate_limit=spec.get("rate_limit"), credits=spec.get("credits")
    )
    made = [
        await MANAGER.create(
            name=f"{identity}-{index}",
            workspace="mp",
            scopes=["contacts:read"],
            identity=identity,
            rate_limit=key.get("rate_limit"),
            credits=key.get("credits"),
        )
        for index, key in enumerate(spec["keys"])
    ]
    return JSONResponse({"keys": [{"id": one.record.id, "key": one.key} for one in made]})


def proxied_channel(store: KeyStore, port: int) -> Channel:
    """The store's own channel, but connecting to 127.0.0.1:`port`."""
    from apikeys.stores.redis.channel import RedisChannel
    from apikeys.stores.sql.postgres_channel import PostgresChannel

    channel = store.channel()
    if isinstance(channel, RedisChannel):
        kwargs = {**channel._connection_kwargs, "host": "127.0.0.1", "port": port}
        return RedisChannel(connection_kwargs=kwargs, key_prefix=store.key_prefix)  # type: ignore[attr-defined]
    if isinstance(channel, PostgresChannel):
        return PostgresChannel(
            (),
            {**channel._kwargs, "host": "127.0.0.1", "port": port},
            table_name=channel._table_name,
            readers_table=channel._readers_table,
        )
    raise AssertionError(f"no network channel for {store!r}")


def build() -> tuple[APIKeyMiddleware, KeyManager]:
    options = json.loads(os.environ.get("APIKEYS_TEST_STORE_OPTIONS") or "{}")
    store = store_from_url(os.environ["APIKEYS_STORE_URL"], **options)
    port = os.environ.get("APIKEYS_TEST_CHANNEL_PORT")
    manager = KeyManager(
        store,
        hasher=Hasher(pepper=os.environ["APIKEYS_PEPPER"]),
        usage_flush_interval=float(os.environ.get("APIKEYS_TEST_FLUSH_INTERVAL") or 1.0),
        channel=proxied_channel(store, int(port)) if port else None,
    )
    routes = [
        Route("/health", health),
        Route("/api/v1/contacts", whoami),
        Route("/api/v1/admin", whoami),
    ]
    if os.environ.get("APIKEYS_TEST_IDENTITY_ROUTE"):
        routes.append(Route("/test/identity", make_identity, methods=["POST"]))
    inner = Starlette(routes=routes)
    app = APIKeyMiddleware(
        inner,
        manager=manager,
        scopes=SCOPES,
        protect="/api/",
        # A limiter of its own, so its counters carry the test's Redis prefix.
        limiter=RateLimiter(
            os.environ.get("APIKEYS_RATE_LIMIT") or "100000/minute",
            os.environ["APIKEYS_LIMITER_URL"],
            key_prefix=os.environ.get("APIKEYS_TEST_LIMITER_PREFIX") or "apikeys",
        ),
    )
    return app, manager


app, MANAGER = build()
