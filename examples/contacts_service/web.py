"""The settings UI: log in, and manage the workspace's API keys at
`/settings/integrations/api-keys`.

Server-rendered with Jinja2 (`templates/`), a stylesheet and a few lines of JavaScript
(`static/`) for the copy button; every page works without JavaScript.

- Every page needs a logged-in user (`auth.py`); a visit without one is sent to `/login`,
  and a form posted without one is refused.
- Every form carries the session's CSRF token, checked on every POST before anything
  else happens; a missing or wrong token gets a 403 page.
- A user sees and changes only their workspace's keys: an id of another workspace's key
  gets the same 404 page as an id that does not exist.
- The pages use the service's own `KeyManager`, the one the API middleware counts usage
  with, so request counts include this process's not-yet-flushed requests.
- A new key (created or rolled) is shown once, on the page the form redirects to
  (`onetime.py`), and never again.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote

import jinja2
from starlette.datastructures import ImmutableMultiDict
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from apikeys import KeyManager
from apikeys.durations import MAX_DURATION, format_duration, parse_duration
from apikeys.errors import (
    AuthUnavailable,
    InvalidKeyParameters,
    InvalidTransition,
    KeyNotFound,
)
from apikeys.ratelimit import DEFAULT_RATE_LIMIT, parse_rate_limit
from apikeys.types import ACTIVE, DISABLED, REVOKED, KeyRecord, utcnow
from examples.contacts_service import api
from examples.contacts_service.auth import (
    CSRF_FIELD,
    PASSWORDS,
    LoginThrottle,
    User,
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
from examples.contacts_service.onetime import Reveal, RevealStore
from examples.contacts_service.settings import Settings

__all__ = ["KEYS_PATH", "PageError", "exception_handlers", "routes"]

logger = logging.getLogger("examples.contacts_service")

KEYS_PATH = "/settings/integrations/api-keys"
HERE = Path(__file__).parent
MAX_FORM_BYTES = 16 * 1024
MAX_LABEL = 200
_KEY_ID = re.compile(r"[0-9A-Za-z]{12}")
_NEXT = re.compile(r"/settings/[A-Za-z0-9/_-]{0,200}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")

SCOPE_LABELS = {
    "contacts:read": "List and read contacts",
    "contacts:write": "Create contacts",
    "campaigns:read": "List campaigns",
    "campaigns:trigger": "Trigger campaign runs",
}
SCOPES: tuple[str, ...] = tuple(dict.fromkeys(op.scope for op in api.OPERATIONS))
"""The API's scopes, in the order of its operations."""

GRACE_CHOICES: dict[str, tuple[str, timedelta]] = {
    "0": ("None: the old key stops working now", timedelta(0)),
    "1h": ("1 hour", timedelta(hours=1)),
    "24h": ("24 hours", timedelta(hours=24)),
    "7d": ("7 days", timedelta(days=7)),
}
DEFAULT_GRACE = "24h"

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

Form = ImmutableMultiDict[str, str]


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

    @classmethod
    def no_such_key(cls) -> PageError:
        return cls(
            404,
            "No such API key",
            "This workspace has no API key with that id. It may have been typed wrong, or "
            "belong to another workspace.",
        )


# -- showing times -------------------------------------------------------------------------

_UNITS = (
    ("year", 365 * 86400),
    ("month", 30 * 86400),
    ("day", 86400),
    ("hour", 3600),
    ("minute", 60),
    ("second", 1),
)


def relative(moment: datetime, now: datetime | None = None) -> str:
    """`3 minutes ago`, `in 23 hours`, `just now`."""
    seconds = ((now or utcnow()) - moment).total_seconds()
    if 0 <= seconds < 10:
        return "just now"
    span = abs(seconds)
    for unit, size in _UNITS:
        if span >= size or unit == "second":
            amount = int(span // size)
            text = f"{amount} {unit}{'' if amount == 1 else 's'}"
            return f"{text} ago" if seconds > 0 else f"in {text}"
    raise AssertionError("unreachable")  # pragma: no cover


def exact(moment: datetime) -> str:
    """`2026-01-31 12:00:00 UTC`."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(relative=relative, exact=exact, iso=iso)
    env.globals.update(
        KEYS_PATH=KEYS_PATH,
        CSRF_FIELD=CSRF_FIELD,
        SCOPE_LABELS=SCOPE_LABELS,
        ACTIVE=ACTIVE,
        DISABLED=DISABLED,
        REVOKED=REVOKED,
    )
    return env


templates = Jinja2Templates(env=_environment())


# -- plumbing ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UI:
    """What the pages share, on `app.state.ui`."""

    settings: Settings
    manager: KeyManager
    reveals: RevealStore
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
    user: User | None = None,
    headers: dict[str, str] | None = None,
    **context: Any,
) -> Response:
    context.update(user=user, csrf_token=csrf_token(request.session))
    return templates.TemplateResponse(
        request, template, context, status_code=status, headers={**PAGE_HEADERS, **(headers or {})}
    )


def redirect(url: str) -> Response:
    return RedirectResponse(url, status_code=303, headers={"Cache-Control": "no-store"})


def _notice(request: Request, text: str) -> None:
    """A one-line message for the next page (not secret: the cookie is readable)."""
    request.session["notice"] = text


async def read_form(request: Request) -> Form:
    """The posted form, read within `MAX_FORM_BYTES`; refused unless URL-encoded UTF-8.

    An empty body without a content type is an empty form (which then fails the CSRF check).
    """
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type not in ("application/x-www-form-urlencoded", ""):
        raise PageError(415, "Unsupported form", "This page accepts only its own forms.")
    too_large = PageError(413, "Form too large", "The form you sent is too large.")
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > MAX_FORM_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise too_large
    if not media_type and body:
        raise PageError(415, "Unsupported form", "This page accepts only its own forms.")
    try:
        pairs = parse_qsl(
            body.decode("ascii"),
            keep_blank_values=True,
            max_num_fields=100,
            encoding="utf-8",
            errors="strict",
        )
    except (UnicodeDecodeError, ValueError):
        raise PageError(400, "Unreadable form", "The form you sent could not be read.") from None
    return ImmutableMultiDict(pairs)


def _require_csrf(request: Request, form: Form) -> None:
    if not check_csrf(request.session, form.get(CSRF_FIELD)):
        raise PageError(
            403,
            "Form expired",
            "This form was not accepted: it did not carry this session's security token. "
            "It may come from another site, or from a page opened before you logged in "
            "again. Reload the page and try again.",
        )


Endpoint = Callable[[Request], Awaitable[Response]]
View = Callable[[Request, User], Awaitable[Response]]
Action = Callable[[Request, User, Form], Awaitable[Response]]


def view(handler: View) -> Endpoint:
    """A page for the logged-in user; anyone else is sent to the login page."""

    async def endpoint(request: Request) -> Response:
        user = await session_user(_database(request), request.session)
        if user is None:
            # The path from the scope: `request.url` decodes the query string as UTF-8 and
            # fails on other bytes, which HTTP/2 servers pass through.
            return redirect(f"/login?next={quote(request.scope['path'])}")
        return await handler(request, user)

    return endpoint


def action(handler: Action) -> Endpoint:
    """A form post of the logged-in user, with this session's CSRF token; else 403."""

    async def endpoint(request: Request) -> Response:
        user = await session_user(_database(request), request.session)
        if user is None:
            raise PageError(
                403,
                "You are not logged in",
                "Your session has ended, so nothing was changed. Log in and try again.",
            )
        form = await read_form(request)
        _require_csrf(request, form)
        return await handler(request, user, form)

    return endpoint


def by_method(**handlers: Endpoint) -> Endpoint:
    """One endpoint for a path's methods (`get=…, post=…`), so 405 lists them all."""

    async def endpoint(request: Request) -> Response:
        method = "get" if request.method == "HEAD" else request.method.lower()
        return await handlers[method](request)

    return endpoint


# -- login ---------------------------------------------------------------------------------


def _safe_next(value: object) -> str:
    """Where to go after login: a settings page of this site, never another site."""
    if isinstance(value, str) and _NEXT.fullmatch(value) and "//" not in value:
        return value
    return KEYS_PATH


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
        return redirect(KEYS_PATH)
    return _login_page(request, next_url=request.query_params.get("next"))


async def login(request: Request) -> Response:
    form = await read_form(request)
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


async def logout(request: Request) -> Response:
    form = await read_form(request)
    _require_csrf(request, form)
    await end_session(_database(request), request.session)
    _notice(request, "You have logged out.")
    return redirect("/login")


async def home(request: Request) -> Response:
    return redirect(KEYS_PATH)


# -- the keys page -------------------------------------------------------------------------


def _parse_expiry(text: str, now: datetime) -> datetime | None:
    """Empty: never. `30d`, `12h`…: from now. `2026-12-31`: the end of that day, UTC."""
    text = text.strip()
    if not text:
        return None
    if _DATE.fullmatch(text):
        try:
            day = date.fromisoformat(text)
            moment = datetime.combine(day, time(0), tzinfo=UTC) + timedelta(days=1)
        except (ValueError, OverflowError):
            raise ValueError(f"{text} is not a date: write it as YYYY-MM-DD.") from None
    elif text[:1].isdigit() and "T" in text:
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"{text} is not a date and time.") from None
        if moment.tzinfo is None:
            raise ValueError("Give the time zone, e.g. 2026-12-31T18:00:00Z.")
    else:
        try:
            return now + parse_duration(text)
        except ValueError:
            raise ValueError(
                "Write the expiry as a duration, like 30d, 12h or 2w, or as a date, "
                "like 2026-12-31."
            ) from None
    if moment <= now:
        raise ValueError("The expiry must be in the future.")
    if moment - now > MAX_DURATION:
        raise ValueError(f"The expiry must be within {MAX_DURATION.days} days.")
    return moment


@dataclass(frozen=True, slots=True)
class CreateForm:
    name: str = ""
    access: str = "restricted"
    scopes: tuple[str, ...] = ()
    rate_limit: str = ""
    expires: str = ""


def _read_create_form(form: Form) -> tuple[CreateForm, dict[str, str], datetime | None]:
    values = CreateForm(
        name=form.get("name", "").strip(),
        access=form.get("access", ""),
        scopes=tuple(form.getlist("scopes")),
        rate_limit=form.get("rate_limit", "").strip(),
        expires=form.get("expires", "").strip(),
    )
    errors: dict[str, str] = {}
    if not values.name:
        errors["name"] = "Give the key a label, such as the name of the integration."
    elif len(values.name) > MAX_LABEL:
        errors["name"] = f"The label must be at most {MAX_LABEL} characters."
    elif _CONTROL.search(values.name):
        errors["name"] = "The label must not contain control characters."
    if values.access not in ("full", "restricted"):
        errors["access"] = "Choose full access or restricted access."
    elif values.access == "restricted":
        unknown = [scope for scope in values.scopes if scope not in SCOPES]
        if unknown:
            errors["scopes"] = f"Unknown scope: {unknown[0][:50]}."
        elif not values.scopes:
            errors["scopes"] = "Pick at least one scope, or choose full access."
    if values.rate_limit:
        try:
            parse_rate_limit(values.rate_limit)
        except InvalidKeyParameters:
            errors["rate_limit"] = (
                "Write the rate limit as a number per period, like 100/minute, 10/second "
                "or 3 per 2 seconds."
            )
    expires_at = None
    try:
        expires_at = _parse_expiry(values.expires, utcnow())
    except ValueError as exc:
        errors["expires"] = str(exc)
    return values, errors, expires_at


@dataclass(frozen=True, slots=True)
class KeyRow:
    record: KeyRecord
    status: str
    can_disable: bool
    can_enable: bool
    can_roll: bool
    can_revoke: bool

    @property
    def has_actions(self) -> bool:
        return self.can_disable or self.can_enable or self.can_roll or self.can_revoke


# `?status=` of the keys page: the filter's value, and its label ("" is every key in use).
STATUS_FILTERS: tuple[tuple[str, str], ...] = (
    ("", "In use"),
    ("active", "Active"),
    ("disabled", "Disabled"),
    ("expired", "Expired"),
    ("revoked", "Revoked"),
)


def _row(record: KeyRecord, now: datetime) -> KeyRow:
    status = record.status_at(now)
    return KeyRow(
        record=record,
        status=status,
        can_disable=status == ACTIVE,
        can_enable=status == DISABLED,
        can_roll=status != REVOKED,
        can_revoke=status != REVOKED,
    )


async def _keys_page(
    request: Request,
    user: User,
    *,
    form: CreateForm | None = None,
    errors: dict[str, str] | None = None,
    status: int = 200,
) -> Response:
    ui = _ui(request)
    reveal: Reveal | None = None
    reveal_lost = False
    if "reveal" in request.session:
        reveal = ui.reveals.pop(request.session.pop("reveal"), user.id)
        reveal_lost = reveal is None
    now = utcnow()
    records = await ui.manager.list(user.workspace)
    rows = [_row(record, now) for record in reversed(records)]  # newest first
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
    return render(
        request,
        "keys.html",
        status=status,
        user=user,
        title="API keys",
        rows=rows,
        now=now,
        reveal=reveal,
        reveal_lost=reveal_lost,
        notice=request.session.pop("notice", None),
        form=form or CreateForm(),
        errors=errors or {},
        scopes=SCOPES,
        default_rate_limit=ui.settings.rate_limit or DEFAULT_RATE_LIMIT,
        grace_choices=GRACE_CHOICES,
        status_filters=STATUS_FILTERS,
        status_filter=wanted,
        hidden_revoked=hidden_revoked,
    )


@view
async def keys_page(request: Request, user: User) -> Response:
    return await _keys_page(request, user)


@action
async def create_key(request: Request, user: User, form: Form) -> Response:
    values, errors, expires_at = _read_create_form(form)
    if not errors:
        try:
            created = await _ui(request).manager.create(
                name=values.name,
                workspace=user.workspace,
                scopes=values.scopes if values.access == "restricted" else (),
                full_access=values.access == "full",
                rate_limit=values.rate_limit or None,
                expires_at=expires_at,
            )
        except InvalidKeyParameters as exc:
            errors["form"] = str(exc)
    if errors:
        return await _keys_page(request, user, form=values, errors=errors, status=422)
    _show_once(request, Reveal(created.key, created.record, user.id))
    return redirect(f"{KEYS_PATH}#new-key")


def _show_once(request: Request, reveal: Reveal) -> None:
    request.session["reveal"] = _ui(request).reveals.put(reveal)


async def _own_key(request: Request, user: User) -> KeyRecord:
    """The key named in the path, if it is one of the user's workspace; else the 404 page."""
    key_id: str = request.path_params["key_id"]
    if not _KEY_ID.fullmatch(key_id):
        raise PageError.no_such_key()
    try:
        record = await _ui(request).manager.get(key_id)
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


async def _change_state(
    request: Request, user: User, method: str, target: str, verb: str, outcome: str
) -> Response:
    record = await _own_key(request, user)
    manager = _ui(request).manager
    try:
        await getattr(manager, method)(record.id)
    except InvalidTransition:
        current = await manager.get(record.id)
        if current.state != target:  # already done (a second click) is not an error
            raise _refused(current, verb) from None
    _notice(request, f"Key “{record.name}” ({record.prefix}) is {verb}. {outcome}")
    return redirect(KEYS_PATH)


@action
async def disable_key(request: Request, user: User, form: Form) -> Response:
    return await _change_state(
        request,
        user,
        "disable",
        DISABLED,
        "disabled",
        "Requests with it get 401 until you enable it again.",
    )


@action
async def enable_key(request: Request, user: User, form: Form) -> Response:
    return await _change_state(
        request, user, "enable", ACTIVE, "enabled", "It authenticates requests again."
    )


@view
async def revoke_confirm(request: Request, user: User) -> Response:
    record = await _own_key(request, user)
    if record.state == REVOKED:
        raise _refused(record, "revoked")
    return render(request, "revoke.html", user=user, title="Revoke key", record=record)


@action
async def revoke_key(request: Request, user: User, form: Form) -> Response:
    return await _change_state(
        request,
        user,
        "revoke",
        REVOKED,
        "revoked",
        "Every request with it now gets 401. It stays in the list for the record.",
    )


def _roll_page(
    request: Request, user: User, record: KeyRecord, *, grace: str, error: str | None, status: int
) -> Response:
    return render(
        request,
        "roll.html",
        status=status,
        user=user,
        title="Roll key",
        record=record,
        grace=grace,
        grace_choices=GRACE_CHOICES,
        error=error,
        lifetime=_lifetime(record),
    )


def _lifetime(record: KeyRecord) -> str | None:
    """How long the key was made to last, to the minute ("30d", not "29d23h59m59s")."""
    if record.expires_at is None:
        return None
    seconds = (record.expires_at - record.created_at).total_seconds()
    if seconds >= 3600:
        seconds = round(seconds / 60) * 60
    return format_duration(timedelta(seconds=max(1, round(seconds))))


@view
async def roll_confirm(request: Request, user: User) -> Response:
    record = await _own_key(request, user)
    if record.state == REVOKED:
        raise _refused(record, "rolled")
    return _roll_page(request, user, record, grace=DEFAULT_GRACE, error=None, status=200)


@action
async def roll_key(request: Request, user: User, form: Form) -> Response:
    record = await _own_key(request, user)
    grace = form.get("grace", "")
    if grace not in GRACE_CHOICES:
        return _roll_page(
            request,
            user,
            record,
            grace=DEFAULT_GRACE,
            error="Choose how long the old key keeps working.",
            status=422,
        )
    manager = _ui(request).manager
    try:
        created = await manager.roll(record.id, grace=GRACE_CHOICES[grace][1])
    except InvalidTransition:
        raise _refused(await manager.get(record.id), "rolled") from None
    old = await manager.get(record.id)
    reveal = Reveal(
        created.key, created.record, user.id, rolled_from=old, old_expires_at=old.expires_at
    )
    _show_once(request, reveal)
    return redirect(f"{KEYS_PATH}#new-key")


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


def routes() -> list[BaseRoute]:
    key = KEYS_PATH + "/{key_id}"
    return [
        Route("/", home, methods=["GET"]),
        Route("/login", by_method(get=login_form, post=login), methods=["GET", "POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route(KEYS_PATH, by_method(get=keys_page, post=create_key), methods=["GET", "POST"]),
        Route(f"{key}/disable", disable_key, methods=["POST"]),
        Route(f"{key}/enable", enable_key, methods=["POST"]),
        Route(f"{key}/roll", by_method(get=roll_confirm, post=roll_key), methods=["GET", "POST"]),
        Route(
            f"{key}/revoke", by_method(get=revoke_confirm, post=revoke_key), methods=["GET", "POST"]
        ),
        Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static"),
    ]
