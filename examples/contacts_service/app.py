"""The contacts service: a Starlette app whose API is protected by `APIKeyMiddleware`.

```shell
python -m uvicorn examples.contacts_service.app:app --no-proxy-headers
curl -H "Authorization: Bearer <key>" http://127.0.0.1:8000/api/v1/contacts
```

Configured by the environment (see `settings.py`). The middleware needs its `KeyManager`
when it is built, so the manager is made when the app is, from the store URL; the lifespan
prepares the key store and the service's tables (and the admin user, when
`EXAMPLE_ADMIN_EMAIL` and `EXAMPLE_ADMIN_PASSWORD` are set) at startup and closes both at
shutdown. The settings UI (`web.py`) uses the same manager as the middleware, and so do
the leak endpoints (`leaks.py`): `/api/v1/secret-scanning`, which revokes the keys GitHub
finds in public, and `/api/v1/credentials/revoke`, where anyone can report leaked keys.
The management API (`apikeys.api`) is mounted at `/v1/api-keys`: a workspace's scripts
create, roll and revoke its keys there with a key holding `apikeys:write` (a full-access
key holds it), its OpenAPI document at `/v1/api-keys/openapi.json`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute, Mount, Route

from apikeys import APIKeyMiddleware, KeyManager
from apikeys.api import ManagementAPI
from examples.contacts_service import api, leaks, web
from examples.contacts_service.auth import (
    LoginThrottle,
    SessionCookies,
    ensure_user,
    prepare_passwords,
    session_secret,
)
from examples.contacts_service.db import Database
from examples.contacts_service.openapi import openapi_json
from examples.contacts_service.problems import exception_handlers, logger
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
            await prepare_passwords()
            if settings.admin_email is not None and settings.admin_password is not None:
                await ensure_user(
                    database, settings.workspace, settings.admin_email, settings.admin_password
                )
                logger.info(
                    "settings UI: %s can log in to workspace %r",
                    settings.admin_email,
                    settings.workspace,
                )
            app.state.database = database
            yield
        finally:
            await database.aclose()
            await manager.aclose()

    secret = session_secret(settings)
    routes: list[BaseRoute] = [
        *api.routes(),
        # Outside the protected prefixes: readable without a key.
        Route(api.OPENAPI_PATH, openapi_json, methods=["GET"]),
        # GitHub's secret scanning alerts (signed by GitHub) and the public bulk revoke:
        # neither is sent with a key.
        *leaks.routes(settings, manager),
        # The settings UI: /login, /logout, and the library's keys page, mounted at
        # /settings/integrations/api-keys/ (its static files under it).
        *web.routes(web.keys_page(settings, manager, secret)),
        # The management API checks its callers' keys itself, with the same manager.
        Mount(
            api.MANAGEMENT_PATH,
            app=ManagementAPI(
                manager, rate_limit=settings.rate_limit, limiter_url=settings.limiter_url
            ),
        ),
    ]
    app = Starlette(
        routes=routes,
        middleware=[
            # Sessions for the web pages only; the API reads keys, never cookies.
            Middleware(
                SessionCookies,
                secret_key=secret,
                always_secure=settings.secure_cookies,
            ),
            Middleware(
                APIKeyMiddleware,
                manager=manager,
                scopes=api.scope_rules(),
                protect=api.protected_prefixes(),
                public=[api.OPENAPI_PATH, leaks.PATH, leaks.BULK_REVOKE_PATH],
                rate_limit=settings.rate_limit,
                limiter_url=settings.limiter_url,
            ),
        ],
        exception_handlers=web.exception_handlers(exception_handlers),
        lifespan=lifespan,
    )
    # No redirect to a path's slashed twin: Starlette builds that URL by decoding the query
    # string as UTF-8, and other bytes there would make it answer 500.
    app.router.redirect_slashes = False
    app.state.settings = settings
    app.state.manager = manager
    app.state.ui = web.UI(settings, manager, LoginThrottle())
    return app


app = create_app()
