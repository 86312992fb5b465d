"""What every view of the settings page shares: who is asking, the CSRF check, rendering
and redirects, and the decorators that turn a view or a form action into an endpoint.

A view is `async def view(request, user) -> Response` wrapped in `@view` (anyone not logged
in goes to the login page); a form action is `async def action(request, user, form)` wrapped
in `@action` (the CSRF token is checked before the action runs). Views live in
`apikeys.ui.views`, one module per section of the page; `KeysPage` routes to them.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from apikeys.errors import KeyNotFound
from apikeys.types import KeyRecord, Scope
from apikeys.ui.forms import Form, read_form

if TYPE_CHECKING:
    from apikeys.ui.page import KeysPage

__all__ = [
    "CSRF_FIELD",
    "KEY_ID",
    "PAGE_HEADERS",
    "USER_SCOPE_KEY",
    "Action",
    "Endpoint",
    "PageError",
    "PageUser",
    "UserHook",
    "View",
    "action",
    "base_path",
    "methods",
    "notice",
    "own_key",
    "page_of",
    "redirect",
    "refused",
    "render",
    "route_path",
    "view",
]

CSRF_FIELD: Final = "csrf_token"
USER_SCOPE_KEY: Final = "apikeys.page_user"
KEY_ID = re.compile(r"[0-9A-Za-z]{12}")

PAGE_HEADERS = {
    # Pages can show a key once: no cache, back button or proxy may keep a copy.
    "Cache-Control": "no-store",
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "Referrer-Policy": "same-origin",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
}


@dataclass(frozen=True, slots=True)
class PageUser:
    """Who is looking at the page: what the application's `user` hook returns."""

    id: str
    """A stable id of the user: one-time keys and the page's cookie are bound to it."""
    workspace: str
    """The workspace whose keys the user manages."""
    name: str
    """Shown at the top of the page (an e-mail address, a user name)."""


UserHook = Callable[[Request], Awaitable[PageUser | None]]
"""`async def user(request) -> PageUser | None`. It must not read the request's body."""

Endpoint = Callable[[Request], Awaitable[Response]]
View = Callable[[Request, PageUser], Awaitable[Response]]
Action = Callable[[Request, PageUser, Form], Awaitable[Response]]


class PageError(Exception):
    """Raised by a view to answer with the error page."""

    def __init__(self, status: int, title: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.title = title
        self.message = message

    @classmethod
    def no_such_key(cls) -> PageError:
        return cls(
            404,
            "No such API key",
            "This workspace has no API key with that id. It may have been typed wrong, or "
            "belong to another workspace.",
        )


def route_path(scope: Scope) -> str:
    """The path below the page's mount point."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def page_of(request: Request) -> KeysPage:
    """The `KeysPage` serving `request`."""
    page: KeysPage = request.app.state.page
    return page


def base_path(request: Request) -> str:
    """The path the page is mounted at (no trailing slash)."""
    root: str = request.scope.get("root_path", "")
    return root.rstrip("/")


def _user(request: Request) -> PageUser | None:
    user = request.scope.get(USER_SCOPE_KEY)
    if user is None:
        return None
    if not isinstance(user, PageUser):
        raise TypeError("the KeysPage user hook must return a PageUser or None")
    # The page's cookie belongs to one user: another user's notices and keys never show.
    session = request.session
    if session.get("uid") != user.id:
        session.clear()
        session["uid"] = user.id
    return user


def _csrf_token(request: Request) -> str:
    session = request.session
    token = session.get("csrf")
    if not isinstance(token, str):
        token = session["csrf"] = secrets.token_urlsafe(32)
    return token


def _check_csrf(request: Request, form: Form) -> None:
    expected = request.session.get("csrf")
    sent = form.get(CSRF_FIELD)
    if not (
        isinstance(expected, str)
        and isinstance(sent, str)
        and sent.isascii()
        and secrets.compare_digest(expected, sent)
    ):
        raise PageError(
            403,
            "Form expired",
            "This form was not accepted: it did not carry this session's security token. "
            "It may come from another site, or from a page opened before you logged in "
            "again. Reload the page and try again.",
        )


def render(request: Request, template: str, *, status: int = 200, **context: Any) -> Response:
    """`template` with `context` and what every page shows (user, CSRF token, paths)."""
    base = base_path(request)
    context.update(
        user=request.scope.get(USER_SCOPE_KEY),
        csrf_token=_csrf_token(request),
        KEYS_PATH=base,
        LIST_URL=base + "/",
        STATIC_URL=base + "/static",
    )
    return page_of(request).templates.TemplateResponse(
        request, template, context, status_code=status, headers=PAGE_HEADERS
    )


def redirect(url: str) -> Response:
    """303 to `url` (Post/Redirect/Get), never cached."""
    return RedirectResponse(url, status_code=303, headers={"Cache-Control": "no-store"})


def notice(request: Request, text: str) -> None:
    """A one-line message for the next page (not secret: the cookie is readable)."""
    request.session["notice"] = text


def methods(**handlers: Endpoint) -> Endpoint:
    """One endpoint for a path's methods (`get=…, post=…`), so 405 lists them all."""

    async def endpoint(request: Request) -> Response:
        method = "get" if request.method == "HEAD" else request.method.lower()
        return await handlers[method](request)

    return endpoint


def view(handler: View) -> Endpoint:
    """A page for the logged-in user; anyone else goes to the login page."""

    async def endpoint(request: Request) -> Response:
        user = _user(request)
        if user is None:
            login_url = page_of(request).login_url
            if login_url is None:
                raise PageError(403, "You are not logged in", "Log in to manage API keys.")
            # The path from the scope, never `request.url`: building that decodes the
            # query string as UTF-8 and fails on other bytes, which servers pass through.
            path: str = request.scope["path"]
            separator = "&" if "?" in login_url else "?"
            return redirect(f"{login_url}{separator}next={quote(path)}")
        return await handler(request, user)

    return endpoint


def action(handler: Action) -> Endpoint:
    """A form post of the logged-in user, with this session's CSRF token; else 403."""

    async def endpoint(request: Request) -> Response:
        user = _user(request)
        if user is None:
            raise PageError(
                403,
                "You are not logged in",
                "Your session has ended, so nothing was changed. Log in and try again.",
            )
        form = await read_form(request)
        _check_csrf(request, form)
        return await handler(request, user, form)

    return endpoint


async def own_key(request: Request, user: PageUser) -> KeyRecord:
    """The key named in the path, if it is one of the user's workspace; else the 404 page."""
    key_id: str = request.path_params["key_id"]
    if not KEY_ID.fullmatch(key_id):
        raise PageError.no_such_key()
    try:
        record = await page_of(request).manager.get(key_id)
    except KeyNotFound:
        raise PageError.no_such_key() from None
    if record.workspace != user.workspace:  # just as absent as a key that does not exist
        raise PageError.no_such_key()
    return record


def refused(record: KeyRecord, verb: str) -> PageError:
    """The 409 page for a change that `record`'s state does not allow."""
    return PageError(
        409,
        f"This key cannot be {verb}",
        f"Key “{record.name}” ({record.prefix}) is {record.status}, so it cannot be {verb}.",
    )
