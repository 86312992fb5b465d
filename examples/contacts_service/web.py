"""The settings UI: log in, and manage the workspace's API keys at
`/settings/integrations/api-keys/`.

The keys page is the library's own (`apikeys.ui.KeysPage`), mounted here; this module adds
what is the service's business: its login (`auth.py`), and the HTML error pages of the rest
of the site. The page asks `page_user` who is logged in: the user of this service's session.

- A visit to the keys page without a session is sent to `/login?next=…`; a form posted
  without one is refused.
- The login and logout forms carry the session's CSRF token, checked on every POST before
  anything else happens; a missing or wrong token gets a 403 page.
- The page uses the service's own `KeyManager`, the one the API middleware counts usage
  with, so request counts include this process's not-yet-flushed requests.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.templating import Jinja2Templates

from apikeys import KeyManager
from apikeys.errors import AuthUnavailable
from apikeys.ui import KeysPage, PageUser
from apikeys.ui.forms import Form, FormRefused, read_form
from apikeys.ui.page import PAGE_HEADERS
from examples.contacts_service import api
from examples.contacts_service.auth import (
    CSRF_FIELD,
    PASSWORDS,
    LoginThrottle,
    check_csrf,
    csrf_token,
    end_session,
    hash_password,
    normalize_email,
    session_user,
    start_session,
    verify_password,
)
from examples.contacts_service.db import Database
from examples.contacts_service.settings import Settings

__all__ = ["KEYS_PATH", "LIST_URL", "UI", "PageError", "exception_handlers", "keys_page", "routes"]

logger = logging.getLogger("examples.contacts_service")

KEYS_PATH = "/settings/integrations/api-keys"
LIST_URL = KEYS_PATH + "/"
HERE = Path(__file__).parent
_NEXT = re.compile(r"/settings/[A-Za-z0-9/_-]{0,200}")

SCOPE_LABELS = {
    "contacts:read": "List and read contacts",
    "contacts:write": "Create contacts",
    "campaigns:read": "List campaigns",
    "campaigns:trigger": "Trigger campaign runs",
}
SCOPES: tuple[str, ...] = tuple(dict.fromkeys(op.scope for op in api.OPERATIONS))
"""The API's scopes, in the order of its operations."""


class PageError(Exception):
    """Raise it from a page to answer with the error page."""

    def __init__(
        self, status: int, title: str, message: str, *, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.title = title
        self.message = message
        self.headers = headers or {}


# The service's pages look like the keys page: they extend its templates.
templates = Jinja2Templates(
    env=jinja2.Environment(
        loader=jinja2.ChoiceLoader(
            [jinja2.FileSystemLoader(HERE / "templates"), jinja2.PackageLoader("apikeys.ui")]
        ),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
)


# -- plumbing ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UI:
    """What the pages share, on `app.state.ui`."""

    settings: Settings
    manager: KeyManager
    throttle: LoginThrottle


def _ui(request: Request) -> UI:
    ui: UI = request.app.state.ui
    return ui


def _database(request: Request) -> Database:
    database: Database = request.app.state.database
    return database


def render(
    request: Request,
    template: str,
    *,
    status: int = 200,
    headers: dict[str, str] | None = None,
    **context: Any,
) -> Response:
    context.update(
        user=None,
        csrf_token=csrf_token(request.session),
        CSRF_FIELD=CSRF_FIELD,
        KEYS_PATH=KEYS_PATH,
        LIST_URL=LIST_URL,
        STATIC_URL=KEYS_PATH + "/static",
        product="Contacts",
        login_url="/login",
        logout_url=None,
    )
    return templates.TemplateResponse(
        request, template, context, status_code=status, headers={**PAGE_HEADERS, **(headers or {})}
    )


def redirect(url: str) -> Response:
    return RedirectResponse(url, status_code=303, headers={"Cache-Control": "no-store"})


def _notice(request: Request, text: str) -> None:
    """A one-line message for the next page (not secret: the cookie is readable)."""
    request.session["notice"] = text


async def _read_form(request: Request) -> Form:
    try:
        return await read_form(request)
    except FormRefused as exc:
        raise PageError(exc.status, exc.title, exc.message) from None


def _require_csrf(request: Request, form: Form) -> None:
    if not check_csrf(request.session, form.get(CSRF_FIELD)):
        raise PageError(
            403,
            "Form expired",
            "This form was not accepted: it did not carry this session's security token. "
            "It may come from another site, or from a page opened before you logged in "
            "again. Reload the page and try again.",
        )


# -- the keys page -------------------------------------------------------------------------


async def page_user(request: Request) -> PageUser | None:
    """The keys page's login hook: the user of this service's session, if any."""
    user = await session_user(_database(request), request.session)
    if user is None:
        return None
    return PageUser(id=user.id, workspace=user.workspace, name=user.email)


def keys_page(settings: Settings, manager: KeyManager, secret_key: str) -> KeysPage:
    """The library's settings page, for this service's scopes and login."""
    return KeysPage(
        manager,
        user=page_user,
        secret_key=secret_key,
        scopes={scope: SCOPE_LABELS.get(scope, "") for scope in SCOPES},
        login_url="/login",
        logout_url="/logout",
        product="Contacts",
        default_rate_limit=settings.rate_limit,
        https_only=settings.secure_cookies,
    )


# -- login ---------------------------------------------------------------------------------


def _safe_next(value: object) -> str:
    """Where to go after login: a settings page of this site, never another site."""
    if isinstance(value, str) and _NEXT.fullmatch(value) and "//" not in value:
        return value
    return LIST_URL


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def _login_page(
    request: Request,
    *,
    status: int = 200,
    email: str = "",
    error: str | None = None,
    next_url: object = None,
    **extra: Any,
) -> Response:
    return render(
        request,
        "login.html",
        status=status,
        title="Log in",
        email=email,
        error=error,
        next=_safe_next(next_url),
        notice=request.session.pop("notice", None),
        configured=_ui(request).settings.admin_email is not None,
        **extra,
    )


async def login_form(request: Request) -> Response:
    if await session_user(_database(request), request.session) is not None:
        return redirect(LIST_URL)
    return _login_page(request, next_url=request.query_params.get("next"))


async def login(request: Request) -> Response:
    form = await _read_form(request)
    _require_csrf(request, form)
    ui, database = _ui(request), _database(request)
    email = normalize_email(form.get("email", ""))[:320]
    password = form.get("password", "")
    client = _client(request)
    next_url = form.get("next")
    # Reserved before the password is checked (in a thread): concurrent guesses all count.
    wait, attempt = ui.throttle.attempt(client, email)
    if wait:
        minutes = max(1, round(wait / 60))
        return _login_page(
            request,
            status=429,
            email=email,
            error=f"Too many failed attempts. Try again in {minutes} minute"
            f"{'' if minutes == 1 else 's'}.",
            next_url=next_url,
            headers={"Retry-After": str(wait)},
        )
    user = await database.get_user_by_email(email) if email else None
    # The same work whether or not the user exists: a dummy hash is checked when not.
    if not await verify_password(password, user["password_hash"] if user else None):
        logger.info("failed login from %s", client)
        return _login_page(
            request,
            status=400,
            email=email,
            error="Incorrect e-mail address or password.",
            next_url=next_url,
        )
    assert user is not None
    ui.throttle.succeeded(client, email, attempt)
    if PASSWORDS.needs_update(user["password_hash"]):  # e.g. a bcrypt hash: now argon2
        await database.save_user(user["workspace"], email, await hash_password(password))
    await start_session(database, request.session, user["id"])
    return redirect(_safe_next(next_url))


async def logout_form(request: Request) -> Response:
    if await session_user(_database(request), request.session) is None:
        return redirect("/login")
    return render(request, "logout.html", title="Log out")


async def logout(request: Request) -> Response:
    form = await _read_form(request)
    _require_csrf(request, form)
    await end_session(_database(request), request.session)
    _notice(request, "You have logged out.")
    return redirect("/login")


async def home(request: Request) -> Response:
    return redirect(LIST_URL)


# -- errors --------------------------------------------------------------------------------


def error_page(
    request: Request, status: int, title: str, message: str, headers: dict[str, str] | None = None
) -> Response:
    if "session" not in request.scope:  # e.g. a 404 under /static/
        request.scope["session"] = {}
    return render(
        request,
        "error.html",
        status=status,
        headers=headers,
        title=title,
        message=message,
        status_code=status,
    )


async def _page_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PageError)
    return error_page(request, exc.status, exc.title, exc.message, exc.headers)


_HTTP_TITLES = {
    404: ("Page not found", "There is no page at this address."),
    405: ("Method not allowed", "This page cannot be used that way."),
}


def _is_api(request: Request) -> bool:
    # Never `request.url`: building it decodes the query string as UTF-8, so any other bytes
    # there (HTTP/2 servers pass them through) made the error handler itself fail with a 500.
    path: str = request.scope["path"]
    return path.startswith("/api/")


def exception_handlers(
    api_handlers: Mapping[Any, Callable[[Request, Exception], Awaitable[Response]]],
) -> dict[Any, Callable[[Request, Exception], Awaitable[Response]]]:
    """The API's handlers (problem+json under `/api/`), with HTML pages everywhere else."""

    def html_elsewhere(
        handler: Callable[[Request, Exception], Awaitable[Response]],
    ) -> Callable[[Request, Exception], Awaitable[Response]]:
        async def wrapped(request: Request, exc: Exception) -> Response:
            if _is_api(request):
                return await handler(request, exc)
            if isinstance(exc, HTTPException):
                title, message = _HTTP_TITLES.get(exc.status_code, (exc.detail, exc.detail))
                return error_page(request, exc.status_code, title, message, dict(exc.headers or {}))
            if isinstance(exc, AuthUnavailable):
                return error_page(
                    request,
                    503,
                    "Keys are unavailable",
                    "The key store cannot be reached right now. Try again shortly.",
                    {"Retry-After": "1"},
                )
            response = await handler(request, exc)
            status = response.status_code
            if status >= 500:
                logger.warning("settings page failed with %s", status)
                return error_page(
                    request,
                    status,
                    "Something went wrong",
                    "The page could not be shown. Try again shortly.",
                    {"Retry-After": "1"} if status == 503 else None,
                )
            return response

        return wrapped

    handlers = {kind: html_elsewhere(handler) for kind, handler in api_handlers.items()}
    handlers.setdefault(AuthUnavailable, html_elsewhere(api_handlers[Exception]))
    handlers[PageError] = _page_error
    return handlers


# -- routes --------------------------------------------------------------------------------


def by_method(**handlers: Callable[[Request], Awaitable[Response]]) -> Any:
    """One endpoint for a path's methods (`get=…, post=…`), so 405 lists them all."""

    async def endpoint(request: Request) -> Response:
        method = "get" if request.method == "HEAD" else request.method.lower()
        return await handlers[method](request)

    return endpoint


def routes(page: KeysPage) -> list[BaseRoute]:
    return [
        Route("/", home, methods=["GET"]),
        Route("/login", by_method(get=login_form, post=login), methods=["GET", "POST"]),
        Route("/logout", by_method(get=logout_form, post=logout), methods=["GET", "POST"]),
        Route(KEYS_PATH, home, methods=["GET"]),  # the list is at KEYS_PATH + "/"
        Mount(KEYS_PATH, app=page),
    ]
