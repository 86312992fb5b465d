"""`KeysPage`: the settings page where a workspace's users manage its API keys.

This module assembles the page (its routes, cookie and templates); the views are in
`apikeys.ui.views`, one module per section, and what they share in `apikeys.ui.request`.

Server-rendered (Jinja2 templates and a stylesheet in this package, a few lines of
JavaScript for the copy button); every page works without JavaScript. Mount it at any path:

- Who is looking is the application's business: `user(request)` returns a `PageUser` (or
  None), from the application's own login. A visitor without one is sent to `login_url`
  (with `?next=`), or shown a 403 page; a form posted without one changes nothing.
- Every form carries a CSRF token, checked before anything else; a missing or wrong token
  gets a 403 page. The token lives in the page's own signed cookie (`cookie_name`,
  HttpOnly, SameSite=Lax, Secure with `https_only`), bound to the user it was made for; the
  application's own session cookie is never read or written.
- A user sees and changes only their workspace's keys: an id of another workspace's key
  gets the same 404 page as an id that does not exist.
- A new key (created or rolled) is shown once, on the page the form redirects to, whichever
  worker serves it, and never again (`RevealStore`: sealed in the key store, the browser
  holding the other half).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Final

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

try:
    import jinja2
    from starlette.middleware.sessions import SessionMiddleware
    from starlette.templating import Jinja2Templates
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installed extras
    raise ModuleNotFoundError(
        "the settings page needs Jinja2 and itsdangerous. "
        "Install them with: pip install 'apikeys[ui]'",
        name=exc.name,
    ) from None

from apikeys.errors import ConfigurationError
from apikeys.fields import KEY_FIELDS, check_workspace_fields, workspace_may_change
from apikeys.manager import KeyManager
from apikeys.ratelimit import DEFAULT_RATE_LIMIT
from apikeys.types import ACTIVE, DISABLED, REVOKED, Receive, Scope, Send
from apikeys.ui.errorpages import EXCEPTION_HANDLERS
from apikeys.ui.forms import OPERATOR_FIELDS, POLICY_INPUTS, exact, iso, relative
from apikeys.ui.onetime import RevealStore
from apikeys.ui.request import (
    CSRF_FIELD,
    PAGE_HEADERS,
    USER_SCOPE_KEY,
    PageUser,
    UserHook,
    methods,
    route_path,
)
from apikeys.ui.views import activity, edit, keys, roll, states, usage, webhooks

__all__ = ["PAGE_HEADERS", "KeysPage", "PageUser", "UserHook"]

HERE = Path(__file__).parent
_GET_POST: Final = ["GET", "POST"]


class KeysPage:
    """The API keys settings page, an ASGI app: create, list, edit, disable, enable, roll and
    revoke the keys of the logged-in user's workspace.

    - `manager`: the application's `KeyManager`, best the one its middleware uses (request
      counts then include this process's unflushed requests).
    - `user`: the login hook, `async def user(request) -> PageUser | None`.
    - `secret_key`: signs the page's cookie; keep it secret, the same in every process.
    - `scopes`: the scopes a restricted key may be given, in the order shown; a mapping
      gives each a description.
    - `login_url`: where to send a visitor who is not logged in (`?next=` the page asked
      for); None shows a 403 page instead. `logout_url`: a "Log out" link, if given.
    - `product`: the name the page shows for the API (`"Contacts"`).
    - `default_rate_limit`: the limit a key without one gets, shown as a hint.
    - `https_only`: mark the page's cookie Secure (set it when served over https).
    - `workspace_fields`: key fields the operator's by default (`apikeys.fields.KEY_FIELDS`)
      that this page's users may set too, e.g. `{"rate_limit"}`. By default users set a
      key's name, access, scopes and expiry (never later than it is); the other fields are
      shown read-only, and a form that sends one is refused (403 `forbidden_field`).
    - `reveals`: where new keys wait to be shown once. By default the manager's key store,
      which every worker and host shares: a new key is sealed there for 5 minutes and
      shown once by whichever process serves the next page (see `RevealStore`).
    """

    def __init__(
        self,
        manager: KeyManager,
        *,
        user: UserHook,
        secret_key: str,
        scopes: Mapping[str, str] | Iterable[str] = (),
        login_url: str | None = None,
        logout_url: str | None = None,
        product: str = "API",
        default_rate_limit: str | None = None,
        https_only: bool = False,
        reveals: RevealStore | None = None,
        cookie_name: str = "apikeys_page",
        workspace_fields: Collection[str] = (),
    ) -> None:
        if not secret_key:
            raise ValueError("KeysPage needs a secret_key to sign its cookie")
        self.workspace_fields = check_workspace_fields(workspace_fields)
        self.editable_fields = frozenset(
            field for field in KEY_FIELDS if workspace_may_change(field, self.workspace_fields)
        )
        self.manager = manager
        self.user = user
        self.scope_labels: dict[str, str] = (
            dict(scopes) if isinstance(scopes, Mapping) else dict.fromkeys(scopes, "")
        )
        self.login_url = login_url
        self.logout_url = logout_url
        self.product = product
        self.default_rate_limit = default_rate_limit or DEFAULT_RATE_LIMIT
        if reveals is None:
            if not manager.store.keeps_one_time_values():
                raise ConfigurationError(
                    f"the settings page shows each new key once through its key store, and "
                    f"{type(manager.store).__name__} keeps no one-time values: implement "
                    "put_once and take_once, or pass reveals=RevealStore(MemoryStore()) "
                    "to a page served by one process"
                )
            reveals = RevealStore(manager.store)
        self.reveals = reveals
        self.templates = Jinja2Templates(env=self._environment())
        self._app = Starlette(
            routes=[
                Route("/", methods(get=keys.list_page, post=keys.create), methods=_GET_POST),
                Route(
                    "/{key_id}/edit",
                    methods(get=edit.edit_page, post=edit.edit),
                    methods=_GET_POST,
                ),
                Route("/activity", activity.activity_page, methods=["GET"]),
                Route("/webhooks", webhooks.deliveries_page, methods=["GET"]),
                Route("/webhooks/{delivery_id}/replay", webhooks.replay, methods=["POST"]),
                Route("/{key_id}/usage", usage.usage_page, methods=["GET"]),
                Route("/{key_id}/disable", states.disable, methods=["POST"]),
                Route("/{key_id}/enable", states.enable, methods=["POST"]),
                Route(
                    "/{key_id}/roll",
                    methods(get=roll.roll_page, post=roll.roll),
                    methods=_GET_POST,
                ),
                Route(
                    "/{key_id}/revoke",
                    methods(get=states.revoke_page, post=states.revoke),
                    methods=_GET_POST,
                ),
                Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static"),
            ],
            middleware=[
                Middleware(
                    SessionMiddleware,
                    secret_key=secret_key,
                    session_cookie=cookie_name,
                    max_age=8 * 3600,
                    same_site="lax",
                    https_only=https_only,
                )
            ],
            exception_handlers=EXCEPTION_HANDLERS,
        )
        # Never redirect a path to its slashed twin: Starlette builds that URL from the query
        # string as UTF-8, and any other bytes there would make it fail with a 500.
        self._app.router.redirect_slashes = False
        self._app.state.page = self

    def __repr__(self) -> str:
        return f"KeysPage(manager={self.manager!r}, product={self.product!r})"

    def _environment(self) -> jinja2.Environment:
        env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        env.filters.update(relative=relative, exact=exact, iso=iso)
        env.globals.update(
            CSRF_FIELD=CSRF_FIELD,
            POLICY_INPUTS=POLICY_INPUTS,
            OPERATOR_FIELDS=OPERATOR_FIELDS,
            SCOPE_LABELS=self.scope_labels,
            ACTIVE=ACTIVE,
            DISABLED=DISABLED,
            REVOKED=REVOKED,
            product=self.product,
            logout_url=self.logout_url,
            login_url=self.login_url,
        )
        return env

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan: nothing to start
            await self._app(scope, receive, send)
            return
        # A scope of its own: the page's session middleware must not replace the
        # application's `scope["session"]` on the way out.
        scope = dict(scope)
        if not route_path(scope).startswith("/static/"):
            scope[USER_SCOPE_KEY] = await self.user(Request(scope, receive))
        await self._app(scope, receive, send)
