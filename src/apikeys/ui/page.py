"""`KeysPage`: the settings page where a workspace's users manage its API keys.

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
- A new key (created or rolled) is shown once, on the page the form redirects to, and never
  again (`RevealStore`).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
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

from apikeys.durations import format_duration
from apikeys.errors import AuthUnavailable, InvalidKeyParameters, InvalidTransition, KeyNotFound
from apikeys.manager import UNSET, KeyManager, refusal
from apikeys.ratelimit import DEFAULT_RATE_LIMIT
from apikeys.types import (
    ACTIVE,
    DISABLED,
    REVOKED,
    DailyUsage,
    KeyRecord,
    Receive,
    Scope,
    Send,
    utcnow,
)
from apikeys.ui.forms import (
    UNCHANGED,
    Form,
    FormRefused,
    KeyForm,
    exact,
    iso,
    read_form,
    read_key_form,
    read_policies,
    relative,
)
from apikeys.ui.onetime import Reveal, RevealStore

__all__ = ["KeysPage", "PageUser", "UserHook"]

HERE = Path(__file__).parent
CSRF_FIELD: Final = "csrf_token"
_USER: Final = "apikeys.page_user"
_KEY_ID = re.compile(r"[0-9A-Za-z]{12}")
_GET_POST: Final = ["GET", "POST"]

GRACE_CHOICES: dict[str, tuple[str, timedelta]] = {
    "0": ("None: the old key stops working now", timedelta(0)),
    "1h": ("1 hour", timedelta(hours=1)),
    "24h": ("24 hours", timedelta(hours=24)),
    "7d": ("7 days", timedelta(days=7)),
}
DEFAULT_GRACE = "24h"

# `?status=` of the list: the filter's value, and its label ("" is every key in use).
STATUS_FILTERS: tuple[tuple[str, str], ...] = (
    ("", "In use"),
    ("active", "Active"),
    ("disabled", "Disabled"),
    ("expired", "Expired"),
    ("revoked", "Revoked"),
)

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


@dataclass(frozen=True, slots=True)
class KeyRow:
    """A key as the list shows it, with the actions it offers."""

    record: KeyRecord
    status: str
    replaced_by: KeyRecord | None
    replaces: KeyRecord | None

    @property
    def being_replaced(self) -> bool:
        """Rolled: its successor takes over, so it offers no Roll or Disable."""
        return self.record.replaced_by is not None

    @property
    def can_disable(self) -> bool:
        return self.status == ACTIVE and not self.being_replaced

    @property
    def can_enable(self) -> bool:
        return self.status == DISABLED

    @property
    def can_roll(self) -> bool:
        return self.status != REVOKED and not self.being_replaced

    @property
    def can_edit(self) -> bool:
        return self.status != REVOKED

    @property
    def can_revoke(self) -> bool:
        return self.status != REVOKED

    @property
    def has_actions(self) -> bool:
        return self.can_disable or self.can_enable or self.can_roll or self.can_revoke


def _lifetime(record: KeyRecord) -> str | None:
    """How long the key was made to last, to the minute ("30d", not "29d23h59m59s")."""
    if record.expires_at is None:
        return None
    seconds = (record.expires_at - record.created_at).total_seconds()
    if seconds >= 3600:
        seconds = round(seconds / 60) * 60
    return format_duration(timedelta(seconds=max(1, round(seconds))))


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
    - `reveals`: where new keys wait to be shown once; by default this process's memory, so
      with several workers the page after a create must reach the same process (sticky
      sessions), or the page says the key can no longer be shown.
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
    ) -> None:
        if not secret_key:
            raise ValueError("KeysPage needs a secret_key to sign its cookie")
        self.manager = manager
        self.user = user
        self.scope_labels: dict[str, str] = (
            dict(scopes) if isinstance(scopes, Mapping) else dict.fromkeys(scopes, "")
        )
        self.login_url = login_url
        self.logout_url = logout_url
        self.product = product
        self.default_rate_limit = default_rate_limit or DEFAULT_RATE_LIMIT
        self.reveals = reveals or RevealStore()
        self.templates = Jinja2Templates(env=self._environment())
        self._app = Starlette(
            routes=[
                Route("/", _methods(get=_list_page, post=_create), methods=["GET", "POST"]),
                Route(
                    "/{key_id}/edit", _methods(get=_edit_page, post=_edit), methods=["GET", "POST"]
                ),
                Route("/activity", _activity_page, methods=["GET"]),
                Route("/{key_id}/usage", _usage_page, methods=["GET"]),
                Route("/{key_id}/disable", _disable, methods=["POST"]),
                Route("/{key_id}/enable", _enable, methods=["POST"]),
                Route(
                    "/{key_id}/roll", _methods(get=_roll_page, post=_roll), methods=["GET", "POST"]
                ),
                Route(
                    "/{key_id}/revoke",
                    _methods(get=_revoke_page, post=_revoke),
                    methods=["GET", "POST"],
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
            exception_handlers={
                PageError: _page_error,
                FormRefused: _page_error,
                HTTPException: _http_error,
                AuthUnavailable: _unavailable,
            },
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
        if not _route_path(scope).startswith("/static/"):
            scope[_USER] = await self.user(Request(scope, receive))
        await self._app(scope, receive, send)


# -- plumbing ------------------------------------------------------------------------------

Endpoint = Callable[[Request], Awaitable[Response]]


def _route_path(scope: Scope) -> str:
    """The path below the page's mount point."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _page(request: Request) -> KeysPage:
    page: KeysPage = request.app.state.page
    return page


def _base(request: Request) -> str:
    """The path the page is mounted at (no trailing slash)."""
    root: str = request.scope.get("root_path", "")
    return root.rstrip("/")


def _user(request: Request) -> PageUser | None:
    user = request.scope.get(_USER)
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


def _render(request: Request, template: str, *, status: int = 200, **context: Any) -> Response:
    base = _base(request)
    context.update(
        user=request.scope.get(_USER),
        csrf_token=_csrf_token(request),
        KEYS_PATH=base,
        LIST_URL=base + "/",
        STATIC_URL=base + "/static",
    )
    return _page(request).templates.TemplateResponse(
        request, template, context, status_code=status, headers=PAGE_HEADERS
    )


def _redirect(url: str) -> Response:
    return RedirectResponse(url, status_code=303, headers={"Cache-Control": "no-store"})


def _notice(request: Request, text: str) -> None:
    """A one-line message for the next page (not secret: the cookie is readable)."""
    request.session["notice"] = text


def _methods(**handlers: Endpoint) -> Endpoint:
    """One endpoint for a path's methods (`get=…, post=…`), so 405 lists them all."""

    async def endpoint(request: Request) -> Response:
        method = "get" if request.method == "HEAD" else request.method.lower()
        return await handlers[method](request)

    return endpoint


View = Callable[[Request, PageUser], Awaitable[Response]]
Action = Callable[[Request, PageUser, Form], Awaitable[Response]]


def _view(handler: View) -> Endpoint:
    """A page for the logged-in user; anyone else goes to the login page."""

    async def endpoint(request: Request) -> Response:
        user = _user(request)
        if user is None:
            login_url = _page(request).login_url
            if login_url is None:
                raise PageError(403, "You are not logged in", "Log in to manage API keys.")
            # The path from the scope, never `request.url`: building that decodes the
            # query string as UTF-8 and fails on other bytes, which servers pass through.
            path: str = request.scope["path"]
            separator = "&" if "?" in login_url else "?"
            return _redirect(f"{login_url}{separator}next={quote(path)}")
        return await handler(request, user)

    return endpoint


def _action(handler: Action) -> Endpoint:
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


async def _own_key(request: Request, user: PageUser) -> KeyRecord:
    """The key named in the path, if it is one of the user's workspace; else the 404 page."""
    key_id: str = request.path_params["key_id"]
    if not _KEY_ID.fullmatch(key_id):
        raise PageError.no_such_key()
    try:
        record = await _page(request).manager.get(key_id)
    except KeyNotFound:
        raise PageError.no_such_key() from None
    if record.workspace != user.workspace:  # just as absent as a key that does not exist
        raise PageError.no_such_key()
    return record


def _refused(record: KeyRecord, verb: str) -> PageError:
    return PageError(
        409,
        f"This key cannot be {verb}",
        f"Key “{record.name}” ({record.prefix}) is {record.status}, so it cannot be {verb}.",
    )


# -- the list, and creating a key ----------------------------------------------------------


def _rows(records: list[KeyRecord], now: datetime) -> list[KeyRow]:
    by_id = {record.id: record for record in records}
    return [
        KeyRow(
            record=record,
            status=record.status_at(now),
            replaced_by=by_id.get(record.replaced_by or ""),
            replaces=by_id.get(record.replaces or ""),
        )
        for record in reversed(records)  # newest first
    ]


async def _show_list(
    request: Request,
    user: PageUser,
    *,
    form: KeyForm | None = None,
    errors: dict[str, str] | None = None,
    status: int = 200,
) -> Response:
    page = _page(request)
    reveal: Reveal | None = None
    reveal_lost = False
    if "reveal" in request.session:
        reveal = page.reveals.pop(request.session.pop("reveal"), user.id)
        reveal_lost = reveal is None
    now = utcnow()
    rows = _rows(await page.manager.list(user.workspace), now)
    # Revoked keys stay in the list for audit, but folded away unless asked for: the list
    # would otherwise grow with every revoke and roll.
    wanted = request.query_params.get("status", "")
    if wanted not in dict(STATUS_FILTERS):
        wanted = ""
    hidden_revoked = 0
    if wanted:
        rows = [row for row in rows if row.status == wanted]
    else:
        hidden_revoked = sum(row.status == REVOKED for row in rows)
        rows = [row for row in rows if row.status != REVOKED]
    return _render(
        request,
        "keys.html",
        status=status,
        title="API keys",
        rows=rows,
        now=now,
        reveal=reveal,
        reveal_lost=reveal_lost,
        notice=request.session.pop("notice", None),
        form=form or KeyForm(),
        errors=errors or {},
        scopes=tuple(page.scope_labels),
        default_rate_limit=page.default_rate_limit,
        status_filters=STATUS_FILTERS,
        status_filter=wanted,
        hidden_revoked=hidden_revoked,
    )


@_view
async def _list_page(request: Request, user: PageUser) -> Response:
    return await _show_list(request, user)


@_action
async def _create(request: Request, user: PageUser, form: Form) -> Response:
    page = _page(request)
    values, errors, expires_at = read_key_form(form, page.scope_labels)
    policy = read_policies(values, errors)
    if not errors:
        assert expires_at is None or isinstance(expires_at, datetime)
        try:
            created = await page.manager.create(
                name=values.name,
                workspace=user.workspace,
                scopes=values.scopes if values.access == "restricted" else (),
                full_access=values.access == "full",
                rate_limit=values.rate_limit or None,
                expires_at=expires_at,
                actor=user.name,
                **policy,
            )
        except InvalidKeyParameters as exc:
            errors["form"] = str(exc)
    if errors:
        return await _show_list(request, user, form=values, errors=errors, status=422)
    request.session["reveal"] = page.reveals.put(Reveal(created.key, created.record, user.id))
    return _redirect(f"{_base(request)}/#new-key")


# -- editing -------------------------------------------------------------------------------


def _show_edit(
    request: Request,
    record: KeyRecord,
    form: KeyForm,
    errors: dict[str, str],
    *,
    status: int = 200,
) -> Response:
    page = _page(request)
    offered = tuple(dict.fromkeys([*page.scope_labels, *record.scopes]))
    return _render(
        request,
        "edit.html",
        status=status,
        title="Edit key",
        record=record,
        form=form,
        errors=errors,
        scopes=offered,
        default_rate_limit=page.default_rate_limit,
    )


@_view
async def _edit_page(request: Request, user: PageUser) -> Response:
    record = await _own_key(request, user)
    if record.state == REVOKED:
        raise _refused(record, "edited")
    return _show_edit(request, record, KeyForm.of(record), {})


@_action
async def _edit(request: Request, user: PageUser, form: Form) -> Response:
    record = await _own_key(request, user)
    if record.state == REVOKED:
        raise _refused(record, "edited")
    page = _page(request)
    values, errors, expires_at = read_key_form(form, page.scope_labels, current=record)
    policy = read_policies(values, errors)
    if errors:
        return _show_edit(request, record, values, errors, status=422)
    full = values.access == "full"
    if values.credits == KeyForm.of(record).credits:
        # Left as shown: requests may have spent some since the form was drawn.
        del policy["credits"]
    try:
        await page.manager.update(
            record.id,
            name=values.name,
            full_access=full,
            scopes=None if full else values.scopes,
            rate_limit=values.rate_limit or None,
            expires_at=UNSET if expires_at is UNCHANGED else expires_at,  # type: ignore[arg-type]
            actor=user.name,
            **policy,
        )
    except InvalidTransition:
        raise _refused(await page.manager.get(record.id), "edited") from None
    except InvalidKeyParameters as exc:
        return _show_edit(request, record, values, {"form": str(exc)}, status=422)
    _notice(
        request,
        f"Key “{values.name}” ({record.prefix}) is saved. The next request with it is "
        "checked against what you saved.",
    )
    return _redirect(f"{_base(request)}/#key-{record.id}")


# -- disable, enable, revoke ---------------------------------------------------------------


async def _change_state(
    request: Request, user: PageUser, method: str, target: str, verb: str, outcome: str
) -> Response:
    record = await _own_key(request, user)
    manager = _page(request).manager
    why = refusal(record, method)
    if why is not None and record.state != target:
        raise PageError(
            409,
            f"This key cannot be {verb}",
            f"Key “{record.name}” ({record.prefix}) cannot be {verb}: {why}.",
        )
    try:
        await getattr(manager, method)(record.id, actor=user.name)
    except InvalidTransition:
        current = await manager.get(record.id)
        if current.state != target:  # already done (a second click) is not an error
            raise _refused(current, verb) from None
    _notice(request, f"Key “{record.name}” ({record.prefix}) is {verb}. {outcome}")
    return _redirect(_base(request) + "/")


@_action
async def _disable(request: Request, user: PageUser, form: Form) -> Response:
    return await _change_state(
        request,
        user,
        "disable",
        DISABLED,
        "disabled",
        "Requests with it get 401 until you enable it again.",
    )


@_action
async def _enable(request: Request, user: PageUser, form: Form) -> Response:
    return await _change_state(
        request, user, "enable", ACTIVE, "enabled", "It authenticates requests again."
    )


@_view
async def _revoke_page(request: Request, user: PageUser) -> Response:
    record = await _own_key(request, user)
    if record.state == REVOKED:
        raise _refused(record, "revoked")
    return _render(request, "revoke.html", title="Revoke key", record=record)


@_action
async def _revoke(request: Request, user: PageUser, form: Form) -> Response:
    return await _change_state(
        request,
        user,
        "revoke",
        REVOKED,
        "revoked",
        "Every request with it now gets 401. It stays in the list for the record.",
    )


# -- roll ----------------------------------------------------------------------------------


def _show_roll(
    request: Request, record: KeyRecord, *, grace: str, error: str | None, status: int
) -> Response:
    return _render(
        request,
        "roll.html",
        status=status,
        title="Roll key",
        record=record,
        grace=grace,
        grace_choices=GRACE_CHOICES,
        error=error,
        lifetime=_lifetime(record),
    )


def _check_rollable(record: KeyRecord) -> None:
    why = refusal(record, "roll")
    if why is not None:
        raise PageError(
            409,
            "This key cannot be rolled",
            f"Key “{record.name}” ({record.prefix}) cannot be rolled: {why}.",
        )


@_view
async def _roll_page(request: Request, user: PageUser) -> Response:
    record = await _own_key(request, user)
    _check_rollable(record)
    return _show_roll(request, record, grace=DEFAULT_GRACE, error=None, status=200)


@_action
async def _roll(request: Request, user: PageUser, form: Form) -> Response:
    record = await _own_key(request, user)
    _check_rollable(record)
    grace = form.get("grace", "")
    if grace not in GRACE_CHOICES:
        return _show_roll(
            request,
            record,
            grace=DEFAULT_GRACE,
            error="Choose how long the old key keeps working.",
            status=422,
        )
    page = _page(request)
    try:
        created = await page.manager.roll(record.id, grace=GRACE_CHOICES[grace][1], actor=user.name)
    except InvalidTransition:
        raise _refused(await page.manager.get(record.id), "rolled") from None
    old = await page.manager.get(record.id)
    reveal = Reveal(
        created.key, created.record, user.id, rolled_from=old, old_expires_at=old.expires_at
    )
    request.session["reveal"] = page.reveals.put(reveal)
    return _redirect(f"{_base(request)}/#new-key")


# -- activity ------------------------------------------------------------------------------

ACTIVITY_LIMIT = 200


@_view
async def _activity_page(request: Request, user: PageUser) -> Response:
    """The workspace's audit trail, newest first; `?key=ID` for one key's."""
    page = _page(request)
    key_id = request.query_params.get("key", "")
    record: KeyRecord | None = None
    if key_id:
        if not _KEY_ID.fullmatch(key_id):
            raise PageError.no_such_key()
        try:
            record = await page.manager.get(key_id)
        except KeyNotFound:
            raise PageError.no_such_key() from None
        if record.workspace != user.workspace:
            raise PageError.no_such_key()
    events = await page.manager.audit(
        workspace=user.workspace, key_id=key_id or None, limit=ACTIVITY_LIMIT
    )
    names = {r.id: r for r in await page.manager.list(user.workspace)}
    return _render(
        request,
        "activity.html",
        title="Activity",
        events=list(reversed(events)),
        names=names,
        record=record,
        now=utcnow(),
        limit=ACTIVITY_LIMIT,
    )


# -- usage ---------------------------------------------------------------------------------

USAGE_DAYS = 30
CHART_WIDTH, CHART_HEIGHT, CHART_TOP = 720, 200, 16


@dataclass(frozen=True, slots=True)
class Bar:
    """One day of the usage chart: where its two stacked rectangles go."""

    usage: DailyUsage
    x: float
    width: float
    admitted_y: float
    admitted_height: float
    refused_y: float
    refused_height: float

    @property
    def label(self) -> str:
        refused = ", ".join(f"{count} {code}" for code, count in self.usage.refused.items())
        text = f"{self.usage.day.isoformat()}: {self.usage.admitted} admitted"
        return text + (f"; refused: {refused}" if refused else "")


def chart(history: list[DailyUsage]) -> tuple[list[Bar], int]:
    """The bars of a stacked bar chart of `history` (admitted below, refused above), and
    the top of its scale (a round number at or above the busiest day)."""
    busiest = max((day.total for day in history), default=0)
    top = _round_up(busiest)
    slot = CHART_WIDTH / max(1, len(history))
    bars = []
    for index, day in enumerate(history):
        scale = (CHART_HEIGHT - CHART_TOP) / top
        admitted = day.admitted * scale
        refused = (day.total - day.admitted) * scale
        base = CHART_HEIGHT
        bars.append(
            Bar(
                usage=day,
                x=round(index * slot + slot * 0.15, 2),
                width=round(slot * 0.7, 2),
                admitted_y=round(base - admitted, 2),
                admitted_height=round(admitted, 2),
                refused_y=round(base - admitted - refused, 2),
                refused_height=round(refused, 2),
            )
        )
    return bars, top


def _round_up(value: int) -> int:
    """1, 2, 5, 10, 20, 50, … : the smallest at or above `value` (at least 1)."""
    step = 1
    while True:
        for factor in (1, 2, 5):
            if step * factor >= value:
                return step * factor
        step *= 10


@_view
async def _usage_page(request: Request, user: PageUser) -> Response:
    record = await _own_key(request, user)
    history = await _page(request).manager.usage(record.id, days=USAGE_DAYS)
    bars, top = chart(history)
    codes = sorted({code for day in history for code in day.refused})
    return _render(
        request,
        "usage.html",
        title="Usage",
        record=record,
        history=history,
        bars=bars,
        top=top,
        codes=codes,
        days=USAGE_DAYS,
        width=CHART_WIDTH,
        height=CHART_HEIGHT,
        chart_top=CHART_TOP,
        admitted=sum(day.admitted for day in history),
        refused=sum(day.total - day.admitted for day in history),
    )


# -- errors --------------------------------------------------------------------------------

_HTTP_TITLES = {
    404: ("Page not found", "There is no page at this address."),
    405: ("Method not allowed", "This page cannot be used that way."),
}


def _error_page(
    request: Request, status: int, title: str, message: str, headers: Mapping[str, str] = {}
) -> Response:
    if "session" not in request.scope:  # e.g. a 404 under /static/
        request.scope["session"] = {}
    response = _render(
        request, "error.html", status=status, title=title, message=message, status_code=status
    )
    response.headers.update(headers)
    return response


async def _page_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, PageError | FormRefused)
    return _error_page(request, exc.status, exc.title, exc.message)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    title, message = _HTTP_TITLES.get(exc.status_code, (exc.detail, exc.detail))
    return _error_page(request, exc.status_code, title, message, exc.headers or {})


async def _unavailable(request: Request, exc: Exception) -> Response:
    return _error_page(
        request,
        503,
        "Keys are unavailable",
        "The key store cannot be reached right now. Try again shortly.",
        {"Retry-After": "1"},
    )
