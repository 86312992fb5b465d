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

from limits import RateLimitItem, parse_many
from limits.aio.storage import MemoryStorage, Storage
from limits.errors import ConfigurationError as LimitsConfigurationError
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
# Bounds that every limits storage can hold (Redis refuses absurd expiry times).
MAX_WINDOW_SECONDS = 366 * 24 * 3600
MAX_AMOUNT = 10**12
DEFAULT_RATE_LIMIT = "100/minute"


@functools.lru_cache(maxsize=1024)
def parse_rate_limit(limit: str) -> RateLimitItem:
    """Parse one limit in `limits` notation (`100/minute`, `3 per 2 seconds`), or raise."""
    try:
        items = parse_many(limit) if isinstance(limit, str) and limit.strip() else []
    except ValueError:
        items = []
    # One limit per key: "1/second;100/minute" would silently keep only the first.
    item = items[0] if len(items) == 1 else None
    if item is None or not 1 <= item.amount <= MAX_AMOUNT or item.get_expiry() > MAX_WINDOW_SECONDS:
        raise InvalidKeyParameters(
            f"invalid rate limit {limit!r}: write it as '100/minute' or '3 per 2 seconds' "
            "(one limit, a window of at most a year)"
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


class FixedWindowMemoryStorage(MemoryStorage):
    """limits' in-process storage, counting fixed windows without a task per request.

    `limits.aio.storage.MemoryStorage.incr` schedules a task that walks every counter on
    nearly every call, which costs microseconds per request and grows with the number of
    keys. This `incr` is the same atomic count (nothing in it awaits, so it cannot
    interleave), and expired counters are swept at most once per `sweep_interval`.
    """

    def __init__(self, sweep_interval: float = 30.0) -> None:
        super().__init__()
        self._sweep_interval = sweep_interval
        self._next_sweep = time.time() + sweep_interval

    async def incr(self, key: str, expiry: float, amount: int = 1) -> int:
        return self.count(key, expiry, amount)

    def count(self, key: str, expiry: float, amount: int = 1) -> int:
        """`incr` without the coroutine: the limiter's hot path calls this directly."""
        now = time.time()
        counts = self.storage
        if self.expirations.get(key, 0.0) > now:
            value = counts[key] + amount
        else:
            value = amount
            self.expirations[key] = now + expiry
            if now >= self._next_sweep:
                self._sweep(now)
        counts[key] = value
        return value

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + self._sweep_interval
        expired = [key for key, end in self.expirations.items() if end <= now]
        for key in expired:
            self.storage.pop(key, None)
            self.expirations.pop(key, None)
            self.locks.pop(key, None)


def _decision(amount: int, window: int, count: int, seconds_left: float) -> RateDecision:
    remaining = amount - count
    reset_after = math.ceil(seconds_left)
    return RateDecision(
        remaining >= 0,
        amount,
        window,
        remaining if remaining > 0 else 0,
        reset_after if reset_after > 1 else 1,
    )


def _storage_uri(url: str) -> tuple[str, dict[str, Any]]:
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("memory", "async+memory"):
        return "async+memory://", {}
    if scheme in ("redis", "rediss", "redis+unix"):
        # redis-py's asyncio client, the one the key store uses: no second Redis library.
        return f"async+{url}", {
            "implementation": "redispy",
            "socket_connect_timeout": 2,
            "socket_timeout": 2,
            # RESP2, as RedisStore uses: with redis-py 8's RESP3 defaults the pool keeps
            # connections Redis has closed, and the first request on each after an outage fails.
            "protocol": 2,
        }
    if scheme.startswith("async+"):
        return url, {}
    raise ConfigurationError(
        f"unknown limiter storage {scheme + '://' if scheme else url!r}; "
        "use memory:// or redis://host:port/db"
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
        if storage is None and storage_url.split("://", 1)[0].lower() in ("memory", "async+memory"):
            storage = FixedWindowMemoryStorage()
        if storage is None:
            uri, options = _storage_uri(storage_url)
            try:
                built = storage_from_string(uri, wrap_exceptions=True, **options)
            except LimitsConfigurationError:
                # limits' message repeats the URL, password included: say it without.
                raise ConfigurationError(
                    f"limits has no asyncio storage for {uri.split('://')[0]!r}; "
                    "use memory:// or redis://host:port/db"
                ) from None
            if not isinstance(built, Storage):
                raise ConfigurationError("the limiter needs an asyncio limits storage")
            storage = built
        self.storage = storage
        self._exact_expiry = isinstance(storage, MemoryStorage)
        self._local = storage if isinstance(storage, FixedWindowMemoryStorage) else None
        self._key_prefix = key_prefix
        # counter key -> monotonic time its window ends, as far as this process knows
        self._window_ends: dict[str, float] = {}
        # (key id, limit) -> (counter key, amount, window seconds)
        self._plans: dict[tuple[str, str | None], tuple[str, int, int]] = {}

    def __repr__(self) -> str:
        return f"RateLimiter(default={self.default!r}, storage={type(self.storage).__name__})"

    async def hit(self, key_id: str, limit: str | None = None) -> RateDecision:
        """Count one request of `key_id` against `limit` (or the default) and decide."""
        counter, amount, window = self._plans.get((key_id, limit)) or self._plan(key_id, limit)
        local = self._local
        if local is not None:
            return self._decide_local(local, counter, amount, window)
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
        return _decision(amount, window, count, end - now)

    @staticmethod
    def _decide_local(
        local: FixedWindowMemoryStorage, counter: str, amount: int, window: int
    ) -> RateDecision:
        count = local.count(counter, window)
        # In-process, the window's end is known exactly: no second look-up, no rounding up.
        return _decision(amount, window, count, local.expirations[counter] - time.time())

    def _plan(self, key_id: str, limit: str | None) -> tuple[str, int, int]:
        item = parse_rate_limit(limit or self.default)
        window = item.get_expiry()
        plan = (f"{self._key_prefix}/{key_id}/{item.amount}/{window}", item.amount, window)
        if len(self._plans) >= 100_000:
            self._plans.clear()
        self._plans[key_id, limit] = plan
        return plan

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
