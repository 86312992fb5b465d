"""The service's configuration, read from the environment once, at startup."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Settings"]


@dataclass(frozen=True, slots=True)
class Settings:
    """Where keys, rate-limit counters and the service's data live.

    `APIKEYS_PEPPER` is not here: `apikeys.Hasher` reads it from the environment itself.
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
    """`EXAMPLE_WORKSPACE`: the workspace prepared at startup (and, later, the UI's)."""

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
        )
