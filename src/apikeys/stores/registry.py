"""The URL registry: which store a URL's scheme builds (`store_from_url`, `register_store`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from apikeys.errors import ConfigurationError

if TYPE_CHECKING:
    from apikeys.stores.contract import KeyStore

__all__ = ["register_store", "store_from_url"]

# scheme -> "module:Class", imported on first use so optional extras stay optional.
_REGISTRY: dict[str, tuple[str, str]] = {
    "memory": ("apikeys.stores.memory:MemoryStore", ""),
    "sqlite": ("apikeys.stores.sql:SQLStore", "sql"),
    "sqlite+aiosqlite": ("apikeys.stores.sql:SQLStore", "sql"),
    "postgresql": ("apikeys.stores.sql:SQLStore", "postgres"),
    "postgres": ("apikeys.stores.sql:SQLStore", "postgres"),
    "postgresql+asyncpg": ("apikeys.stores.sql:SQLStore", "postgres"),
    "redis": ("apikeys.stores.redis:RedisStore", "redis"),
    "rediss": ("apikeys.stores.redis:RedisStore", "redis"),
    "redis+sentinel": ("apikeys.stores.redis:RedisStore", "redis"),
    "redis+cluster": ("apikeys.stores.redis:RedisStore", "redis"),
}


def register_store(scheme: str, target: str, extra: str = "") -> None:
    """Make `store_from_url` build `target` (`"package.module:Class"`) for `scheme`."""
    _REGISTRY[scheme] = (target, extra)


def store_from_url(url: str, **options: Any) -> KeyStore:
    """Build a store from a URL: `memory://`, `sqlite:///path`, `postgresql://…`, `redis://…`.

    Raises `ConfigurationError` for an unknown scheme, or when the extra the scheme needs is
    not installed (the message gives the exact `pip install` line).
    """
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    try:
        target, extra = _REGISTRY[scheme]
    except KeyError:
        known = ", ".join(sorted(f"{s}://" for s in _REGISTRY))
        raise ConfigurationError(
            f"unknown key store scheme {scheme + '://' if scheme else url!r}; known: {known}"
        ) from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f" Install it with: pip install 'apikeys[{extra}]'" if extra else ""
        raise ConfigurationError(
            f"the {scheme}:// key store needs a package that is not installed ({exc.name}).{hint}"
        ) from exc
    store_class: type[KeyStore] = getattr(module, class_name)
    return store_class.from_url(url, **options)
