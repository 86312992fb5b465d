"""Logging in to the settings UI: passwords, sessions, CSRF tokens and a login throttle.

- Passwords are hashed with passlib (argon2id; bcrypt hashes are still read and replaced
  by argon2 on the next login). Only the hash is stored, in the `users` table.
- A session is a random token. The browser holds it in a cookie signed by Starlette's
  `SessionMiddleware` (itsdangerous), `HttpOnly`, `SameSite=Lax`, and `Secure` on https;
  the database holds only its SHA-256, with the user and an expiry. Logging out deletes
  the row, so a copied cookie stops working at once, unlike a purely signed cookie, which
  stays valid until it expires. A new password ends every session of the user.
- The signed cookie also carries the CSRF token, and small non-secret notices. The client
  can read it (signed is not encrypted), so nothing secret ever goes into it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from passlib.context import CryptContext
from starlette.concurrency import run_in_threadpool
from starlette.middleware.sessions import SessionMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from apikeys.types import utcnow
from examples.contacts_service.db import Database
from examples.contacts_service.settings import Settings

__all__ = [
    "CSRF_FIELD",
    "SECRET_FILE",
    "SESSION_COOKIE",
    "SESSION_LIFETIME",
    "LoginThrottle",
    "SessionCookies",
    "User",
    "check_csrf",
    "csrf_token",
    "end_session",
    "ensure_user",
    "hash_password",
    "normalize_email",
    "prepare_passwords",
    "session_secret",
    "session_user",
    "start_session",
    "verify_password",
]

logger = logging.getLogger("examples.contacts_service")

SESSION_COOKIE = "contacts_session"
SESSION_LIFETIME = timedelta(hours=8)
SECRET_FILE = Path(".example-session-secret")
CSRF_FIELD = "csrf_token"
MAX_PASSWORD_LENGTH = 1024

PASSWORDS = CryptContext(schemes=["argon2", "bcrypt"], deprecated="auto")


@functools.cache
def _dummy_hash() -> str:
    """Verified when the e-mail address is unknown, so that answer takes as long as a wrong
    password: the time of a failed login does not tell whether the user exists."""
    return str(PASSWORDS.hash(secrets.token_urlsafe(16)))


@dataclass(frozen=True, slots=True)
class User:
    id: str
    email: str
    workspace: str


def normalize_email(email: str) -> str:
    return email.strip().lower()


# -- passwords -----------------------------------------------------------------------------


async def hash_password(password: str) -> str:
    """The password's argon2 hash, computed off the event loop."""
    return str(await run_in_threadpool(PASSWORDS.hash, password))


async def prepare_passwords() -> None:
    """Make the dummy hash now (at startup), not during the first unknown user's login."""
    await run_in_threadpool(_dummy_hash)


def _verify(password: str, password_hash: str | None) -> bool:
    return bool(PASSWORDS.verify(password, password_hash or _dummy_hash()))


async def verify_password(password: str, password_hash: str | None) -> bool:
    """Whether `password` matches; `None` checks against a dummy hash and is always False."""
    if len(password) > MAX_PASSWORD_LENGTH:
        return False
    try:
        ok = await run_in_threadpool(_verify, password, password_hash or None)
    except (ValueError, TypeError):  # a malformed stored hash, or bcrypt's 72-byte limit
        return False
    return ok and password_hash is not None


async def ensure_user(database: Database, workspace: str, email: str, password: str) -> str:
    """Create or update the user `email` in `workspace` with `password`; return its id.

    An unchanged password keeps its hash (and so the user's sessions); a changed one is
    hashed anew, which ends them.
    """
    email = normalize_email(email)
    existing = await database.get_user_by_email(email)
    if (
        existing is not None
        and await verify_password(password, existing["password_hash"])
        and not PASSWORDS.needs_update(existing["password_hash"])
    ):
        password_hash: str = existing["password_hash"]
    else:
        password_hash = await hash_password(password)
    return await database.save_user(workspace, email, password_hash)


# -- sessions ------------------------------------------------------------------------------


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


async def start_session(
    database: Database, session: MutableMapping[str, Any], user_id: str
) -> None:
    """Log `user_id` in: a fresh session and CSRF token (never the ones from before login)."""
    await end_session(database, session)
    token = secrets.token_urlsafe(32)
    await database.create_session(_token_hash(token), user_id, utcnow() + SESSION_LIFETIME)
    session["sid"] = token
    session["csrf"] = secrets.token_urlsafe(32)


async def end_session(database: Database, session: MutableMapping[str, Any]) -> None:
    """Log out: the server forgets the session, and the cookie is cleared."""
    token = session.get("sid")
    if isinstance(token, str):
        await database.delete_session(_token_hash(token))
    session.clear()


async def session_user(database: Database, session: MutableMapping[str, Any]) -> User | None:
    """The logged-in user, or None (an ended or expired session is dropped from the cookie)."""
    token = session.get("sid")
    if not isinstance(token, str):
        return None
    row = await database.session_user(_token_hash(token))
    if row is None:
        session.clear()
        return None
    return User(id=row["id"], email=row["email"], workspace=row["workspace"])


def session_secret(settings: Settings, path: Path = SECRET_FILE) -> str:
    """The key that signs session cookies.

    `EXAMPLE_SESSION_SECRET`, else the file `.example-session-secret` (created, readable by
    its owner only, when an admin user is configured), else a random key of this process:
    sessions then end when it stops, and cannot be shared between workers.
    """
    if settings.session_secret:
        return settings.session_secret
    with contextlib.suppress(FileNotFoundError):
        if secret := path.read_text().strip():
            return secret
    if settings.admin_email is None:
        return secrets.token_urlsafe(32)
    secret = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another worker made it first
        return path.read_text().strip() or secret
    with os.fdopen(fd, "w") as file:
        file.write(secret + "\n")
    logger.info("session secret created in %s", path)
    return secret


class SessionCookies:
    """`SessionMiddleware` for the web pages: `Secure` when the request came over https.

    The API (`/api/`) and static files never read or set the cookie.
    """

    def __init__(self, app: ASGIApp, *, secret_key: str, always_secure: bool = False) -> None:
        options: dict[str, Any] = {
            "secret_key": secret_key,
            "session_cookie": SESSION_COOKIE,
            "max_age": int(SESSION_LIFETIME.total_seconds()),
            "same_site": "lax",
        }
        self.app = app
        self.plain = SessionMiddleware(app, https_only=always_secure, **options)
        self.secure = SessionMiddleware(app, https_only=True, **options)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/api/"):
            await self.app(scope, receive, send)
            return
        middleware = self.secure if scope.get("scheme") == "https" else self.plain
        await middleware(scope, receive, send)


# -- CSRF ----------------------------------------------------------------------------------


def csrf_token(session: MutableMapping[str, Any]) -> str:
    """The session's CSRF token, made on first use; every form sends it back."""
    token = session.get("csrf")
    if not isinstance(token, str) or not token:
        token = secrets.token_urlsafe(32)
        session["csrf"] = token
    return token


def check_csrf(session: MutableMapping[str, Any], submitted: object) -> bool:
    """Whether a form's token is the session's, compared in constant time."""
    expected = session.get("csrf")
    if not (isinstance(expected, str) and expected and isinstance(submitted, str)):
        return False
    return hmac.compare_digest(expected.encode(), submitted.encode())


# -- throttling ----------------------------------------------------------------------------


class LoginThrottle:
    """Failed logins per client address and e-mail, and per address: a few, then a pause.

    In this process's memory: with several workers each counts its own. Unknown addresses
    are throttled exactly like known ones, so it tells nothing about who exists.
    """

    def __init__(
        self,
        per_email: int = 5,
        per_client: int = 30,
        window: float = 900.0,
        max_entries: int = 10_000,
    ) -> None:
        self.limits = {"email": per_email, "client": per_client}
        self.window = window
        self.max_entries = max_entries
        self._failures: dict[tuple[str, str], deque[float]] = {}

    def _keys(self, client: str, email: str) -> list[tuple[tuple[str, str], int]]:
        return [
            ((client, email), self.limits["email"]),
            ((client, ""), self.limits["client"]),
        ]

    def _recent(self, key: tuple[str, str], now: float) -> deque[float]:
        failures = self._failures.get(key, deque())
        while failures and failures[0] <= now - self.window:
            failures.popleft()
        return failures

    def retry_after(self, client: str, email: str) -> int:
        """Seconds until another attempt is allowed; 0 when it is allowed now."""
        now = time.monotonic()
        wait = 0.0
        for key, limit in self._keys(client, email):
            failures = self._recent(key, now)
            if len(failures) >= limit:
                wait = max(wait, failures[-limit] + self.window - now)
        return max(1, int(wait + 0.999)) if wait > 0 else 0

    def attempt(self, client: str, email: str) -> tuple[int, float]:
        """Reserve one attempt: `(0, stamp)` when allowed, `(seconds to wait, 0.0)` when not.

        The attempt counts as a failure from now on, before the password is even checked,
        so concurrent attempts cannot all pass the check; `succeeded(…, stamp)` takes it back.
        Nothing awaits in here, so a check and its reservation are one step on the loop.
        """
        wait = self.retry_after(client, email)
        if wait:
            return wait, 0.0
        now = time.monotonic()
        if len(self._failures) >= self.max_entries:  # bounded memory: forget old failures
            self._failures = {k: v for k, v in self._failures.items() if self._recent(k, now)}
            if len(self._failures) >= self.max_entries:
                self._failures.clear()
        for key, _ in self._keys(client, email):
            self._failures.setdefault(key, deque()).append(now)
        return 0, now

    def succeeded(self, client: str, email: str, stamp: float) -> None:
        """The attempt reserved at `stamp` logged in: it was no failure after all."""
        self._failures.pop((client, email), None)
        failures = self._failures.get((client, ""))
        if failures is not None:
            with contextlib.suppress(ValueError):
                failures.remove(stamp)
