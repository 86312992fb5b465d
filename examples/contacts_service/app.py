"""The contacts service: a Starlette app whose API is protected by `APIKeyMiddleware`.

```shell
python -m uvicorn examples.contacts_service.app:app
curl -H "Authorization: Bearer <key>" http://127.0.0.1:8000/api/v1/contacts
```

Configured by the environment (see `settings.py`). The middleware needs its `KeyManager`
when it is built, so the manager is made when the app is, from the store URL; the lifespan
prepares the key store and the service's tables at startup and closes both at shutdown.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute, Route

from apikeys import APIKeyMiddleware, KeyManager
from examples.contacts_service import api
from examples.contacts_service.db import Database
from examples.contacts_service.openapi import openapi_json
from examples.contacts_service.problems import exception_handlers
from examples.contacts_service.settings import Settings

__all__ = ["app", "create_app"]


def create_app(settings: Settings | None = None, manager: KeyManager | None = None) -> Starlette:
    """The service for `settings` (the environment's by default)."""
    settings = settings or Settings.from_env()
    manager = manager or KeyManager(settings.store_url)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        database = Database(settings.database_url)
        try:
            await manager.store.setup()
            await database.create_tables()
            await database.ensure_workspace(settings.workspace)
            app.state.database = database
            yield
        finally:
            await database.aclose()
            await manager.aclose()

    routes: list[BaseRoute] = [
        *api.routes(),
        # Outside the protected prefixes: readable without a key.
        Route("/api/v1/openapi.json", openapi_json, methods=["GET"]),
        # The settings UI (/login, /settings/integrations/api-keys) will join here.
    ]
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(
                APIKeyMiddleware,
                manager=manager,
                scopes=api.scope_rules(),
                protect=api.protected_prefixes(),
                rate_limit=settings.rate_limit,
                limiter_url=settings.limiter_url,
            )
        ],
        exception_handlers=exception_handlers,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.manager = manager
    return app


app = create_app()
