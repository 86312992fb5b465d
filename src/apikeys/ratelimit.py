"""Per-key rate limiting on `limits`' asyncio API.

The strategy is a fixed window, counted with one atomic `incr` on the limits storage per
request (one Lua call on Redis), so a shared storage never admits more than the limit
across processes. The window's end is remembered in-process once seen, which spares a
second round trip for the `RateLimit` and `Retry-After` headers on nearly every request.
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Any, NamedTuple

from limits import RateLimitItem, parse
from limits.aio.storage import Storage
from limits.errors import StorageError
from limits.storage import storage_from_string

from apikeys.errors import ConfigurationError, InvalidKeyParameters, LimiterUnavailable

__all__ = [
    "DEFAULT_RATE_LIMIT",
    "RATE_LIMIT_ENV",
    "RateDecision",
    "RateLimiter",
    "parse_rate_limit",
]

RATE_LIMIT_ENV = "APIKEYS_RATE_LIMIT"
DEFAULT_RATE_LIMIT = "100/minute"


@functools.lru_cache(maxsize=1024)
def parse_rate_limit(limit: str) -> RateLimitItem:
    """Parse one limit in `limits` notation (`100/minute`, `3 per 2 seconds`), or raise."""
    try:
        item = parse(limit) if isinstance(limit, str) and limit.strip() else None
    except ValueError:
        item = None
    if item is None or item.amount < 1:
        raise InvalidKeyParameters(
            f"invalid rate limit {limit!r}: write it as '100/minute' or '3 per 2 seconds'"
        )
    return item


class RateDecision(NamedTuple):
    """The limiter's answer for one request."""

    allowed: bool
    limit: int
    window: int
    remaining: int
    reset_after: int
    """Whole seconds until the window resets (at least 1)."""


def _storage_uri(url: str) -> tuple[str, dict[str, Any]]:
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("memory", "async+memory"):
        return "async+memory://", {}
    if scheme in ("redis", "rediss", "redis+unix"):
        # redis-py's asyncio client, the one the key store uses: no second Redis library.
        return f"async+{url}", {
            "implementation": "redispy",
            "socket_connect_timeout": 2,
            "socket_timeout": 2,
        }
    if scheme.startswith("async+"):
        return url, {}
    raise ConfigurationError(
        f"unknown limiter storage scheme {scheme + '://'!r}; use memory:// or redis://host:port/db"
    )


class RateLimiter:
    """Counts requests per key in a `limits` storage and decides admission.

    `storage_url` is `memory://` (one process) or `redis://host:port/db` (shared by every
    process, so a key's limit holds across all of them). `default` is the limit of keys
    without their own `rate_limit`: `APIKEYS_RATE_LIMIT`, or `100/minute`.
    """

    def __init__(
        self,
        default: str | None = None,
        storage_url: str = "memory://",
        *,
        key_prefix: str = "apikeys",
        storage: Storage | None = None,
    ) -> None:
        self.default = default or os.environ.get(RATE_LIMIT_ENV) or DEFAULT_RATE_LIMIT
        parse_rate_limit(self.default)
        if storage is None:
            uri, options = _storage_uri(storage_url)
            built = storage_from_string(uri, wrap_exceptions=True, **options)
            if not isinstance(built, Storage):
                raise ConfigurationError(f"{storage_url!r} is not an asyncio limits storage")
            storage = built
        self.storage = storage
        self._exact_expiry = "memory" in type(storage).__name__.lower()
        self._key_prefix = key_prefix
        # counter key -> monotonic time its window ends, as far as this process knows
        self._window_ends: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"RateLimiter(default={self.default!r}, storage={type(self.storage).__name__})"

    async def hit(self, key_id: str, limit: str | None = None) -> RateDecision:
        """Count one request of `key_id` against `limit` (or the default) and decide."""
        item = parse_rate_limit(limit or self.default)
        window = item.get_expiry()
        counter = f"{self._key_prefix}/{key_id}/{item.amount}/{window}"
        try:
            count = await self.storage.incr(counter, window)
        except (StorageError, OSError) as exc:
            raise LimiterUnavailable(exc) from exc
        now = time.monotonic()
        if count == 1:
            end = now + window
            self._remember(counter, end)
        else:
            end = self._window_ends.get(counter, 0.0)
            if end <= now:
                end = await self._fetch_window_end(counter, now)
        remaining = item.amount - count
        return RateDecision(
            remaining >= 0,
            item.amount,
            window,
            max(remaining, 0),
            max(1, math.ceil(end - now)),
        )

    async def _fetch_window_end(self, counter: str, now: float) -> float:
        try:
            expiry = await self.storage.get_expiry(counter)
        except (StorageError, OSError) as exc:
            raise LimiterUnavailable(exc) from exc
        seconds_left = max(0.0, expiry - time.time())
        # Redis reports whole seconds, rounded down: add one so Retry-After never undershoots.
        end = now + seconds_left + (0.0 if self._exact_expiry else 1.0)
        self._remember(counter, end)
        return end

    def _remember(self, counter: str, end: float) -> None:
        if len(self._window_ends) >= 100_000:
            # Forgetting only costs one more round trip per key, so a crude bound will do.
            self._window_ends.clear()
        self._window_ends[counter] = end

    async def reset(self) -> None:
        """Forget every counter (tests and admin tools)."""
        self._window_ends.clear()
        await self.storage.reset()

    async def aclose(self) -> None:
        """Release the storage's connections, where it has any."""
        client = getattr(getattr(self.storage, "bridge", None), "storage", None)
        close = getattr(client, "aclose", None)
        if close is not None:
            await close()
