"""The service's configuration, read from the environment once, at startup."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from apikeys.leaks import LEAK_ACTIONS, LeakAction
from apikeys.leaks.github import GITHUB_KEYS_URL

__all__ = ["GITHUB_KEYS_URL", "LEAK_ACTIONS", "MIN_PASSWORD_LENGTH", "Settings"]

MIN_PASSWORD_LENGTH = 8
_TRUE = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True, slots=True)
class Settings:
    """Where keys, rate-limit counters and the service's data live, and who may log in.

    `APIKEYS_PEPPER` is not here: `apikeys.Hasher` reads it from the environment itself.
    The admin password and the session secret are left out of `repr`, so a logged
    `Settings` never shows them.
    """

    store_url: str = "sqlite:///apikeys.db"
    """`APIKEYS_STORE_URL`: the key store, shared with the `apikeys` command line."""
    limiter_url: str = "memory://"
    """`APIKEYS_LIMITER_URL`: `memory://`, or `redis://…` shared by every worker."""
    rate_limit: str | None = None
    """`APIKEYS_RATE_LIMIT`: the default per-key limit (the library's `100/minute` if unset)."""
    database_url: str = "sqlite:///example.db"
    """`EXAMPLE_DATABASE_URL`: contacts and campaigns, `sqlite:///…` or `postgresql://…`."""
    workspace: str = "acme"
    """`EXAMPLE_WORKSPACE`: the workspace prepared at startup, and the admin user's."""
    admin_email: str | None = None
    """`EXAMPLE_ADMIN_EMAIL`: the settings UI's user, created or updated at startup."""
    admin_password: str | None = field(default=None, repr=False)
    """`EXAMPLE_ADMIN_PASSWORD`: that user's password; only its hash is stored."""
    session_secret: str | None = field(default=None, repr=False)
    """`EXAMPLE_SESSION_SECRET`: signs the session cookie (else `.example-session-secret`)."""
    secure_cookies: bool = False
    """`EXAMPLE_SECURE_COOKIES=1`: always mark the session cookie `Secure` (it is marked
    so anyway on requests that arrive over https, e.g. through a proxy that uvicorn's
    `--forwarded-allow-ips` names)."""
    github_keys_url: str = GITHUB_KEYS_URL
    """`EXAMPLE_GITHUB_KEYS_URL`: the list of GitHub's secret scanning public keys, which
    `/api/v1/secret-scanning` checks alerts against."""
    leak_action: LeakAction = "revoke"
    """`EXAMPLE_LEAK_ACTION`: what a key GitHub found in public gets, `revoke` or `disable`."""

    def __post_init__(self) -> None:
        if (self.admin_email is None) != (self.admin_password is None):
            raise ValueError("set both EXAMPLE_ADMIN_EMAIL and EXAMPLE_ADMIN_PASSWORD, or neither")
        if self.admin_email is not None and "@" not in self.admin_email:
            raise ValueError("EXAMPLE_ADMIN_EMAIL must be an e-mail address")
        if self.admin_password is not None and len(self.admin_password) < MIN_PASSWORD_LENGTH:
            raise ValueError(
                f"EXAMPLE_ADMIN_PASSWORD must be at least {MIN_PASSWORD_LENGTH} characters"
            )
        if not self.github_keys_url.startswith(("https://", "http://")):
            raise ValueError("EXAMPLE_GITHUB_KEYS_URL must be an https:// (or http://) URL")
        if self.leak_action not in LEAK_ACTIONS:
            raise ValueError("EXAMPLE_LEAK_ACTION must be 'revoke' or 'disable'")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        defaults = cls()
        return cls(
            store_url=env.get("APIKEYS_STORE_URL") or defaults.store_url,
            limiter_url=env.get("APIKEYS_LIMITER_URL") or defaults.limiter_url,
            rate_limit=env.get("APIKEYS_RATE_LIMIT") or None,
            database_url=env.get("EXAMPLE_DATABASE_URL") or defaults.database_url,
            workspace=env.get("EXAMPLE_WORKSPACE") or defaults.workspace,
            admin_email=(env.get("EXAMPLE_ADMIN_EMAIL") or "").strip() or None,
            admin_password=env.get("EXAMPLE_ADMIN_PASSWORD") or None,
            session_secret=env.get("EXAMPLE_SESSION_SECRET") or None,
            secure_cookies=env.get("EXAMPLE_SECURE_COOKIES", "").strip().lower() in _TRUE,
            github_keys_url=(env.get("EXAMPLE_GITHUB_KEYS_URL") or "").strip()
            or defaults.github_keys_url,
            leak_action=(env.get("EXAMPLE_LEAK_ACTION") or "").strip().lower()
            or defaults.leak_action,
        )
