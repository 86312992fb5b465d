"""Per-key rate limiting on `limits`' asyncio API.

The strategy is a fixed window. In one process (`memory://`) each request is one atomic count
in limits' storage. On Redis, shared by every process, a process *leases* a slice of a key's
window with one atomic script (grant at most what is left, return the window's end in
milliseconds) and spends it locally: across processes never more is admitted than the
limit, and a busy key costs a Redis round trip per slice, not per request. Slices shrink as
the window fills and are a single unit when little is left, so small limits are exactly as
strict as one increment per request. Leased units count as used in Redis, so another
process's `RateLimit` remaining may be lower than what is really left (never higher).
"""

from __future__ import annotations

import asyncio
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


# Leasing on Redis: a slice is 1/LEASE_FRACTION of what is left of the window, at most
# LEASE_MAX units, and a single unit once fewer than LEASE_THRESHOLD are left.
LEASE_FRACTION = 16
LEASE_MAX = 1000
LEASE_THRESHOLD = 64

# KEYS[1] = the window's counter; ARGV = limit, window (ms), units asked.
# Grants what is left, at most the units asked; returns {granted, count after, PTTL in ms}.
_LEASE = """
local limit = tonumber(ARGV[1])
local count = tonumber(redis.call('GET', KEYS[1]) or '0')
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then
  count = 0
  ttl = tonumber(ARGV[2])
end
local granted = math.min(tonumber(ARGV[3]), limit - count)
if granted < 0 then
  granted = 0
end
if count == 0 then
  redis.call('SET', KEYS[1], granted, 'PX', ttl)
elseif granted > 0 then
  redis.call('INCRBY', KEYS[1], granted)
end
return {granted, count + granted, ttl}
"""


class _Slice:
    """The units of one window this process has leased and not spent yet."""

    __slots__ = ("left", "pending", "reset_at", "seen", "spend_until")

    def __init__(self) -> None:
        self.left = 0
        self.seen = 0  # the window's count in Redis after this process's last lease
        self.spend_until = 0.0  # monotonic: the window surely lasts until then
        self.reset_at = 0.0  # monotonic: the window has surely ended by then
        self.pending: asyncio.Future[None] | None = None


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
        # On Redis: leased slices of windows, spent in process (see the module doc).
        bridge = getattr(storage, "bridge", None)
        client = getattr(bridge, "storage", None)
        self._redis: Any = None
        self._slices: dict[str, _Slice] = {}
        if self._local is None and client is not None and hasattr(client, "register_script"):
            self._redis = client.register_script(_LEASE)
            self._prefixed = getattr(bridge, "prefixed_key", lambda key: key)
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
        if self._redis is not None:
            return await self._hit_leased(counter, amount, window)
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

    async def _hit_leased(self, counter: str, amount: int, window: int) -> RateDecision:
        slices = self._slices
        while True:
            now = time.monotonic()
            lease = slices.get(counter)
            if lease is not None and lease.pending is None and now < lease.spend_until:
                if lease.left > 0:
                    # Spent without a round trip: nothing awaits between check and spend.
                    lease.left -= 1
                    remaining = max(0, amount - lease.seen) + lease.left
                    return _decision(amount, window, amount - remaining, lease.reset_at - now)
                if lease.seen >= amount:
                    # The window is used up everywhere as far as Redis said: refused locally
                    # until it ends (its end came from the same call: Retry-After holds).
                    return _decision(amount, window, amount + 1, lease.reset_at - now)
            if lease is not None and lease.pending is not None:
                await asyncio.shield(lease.pending)  # one lease in flight per counter
                continue
            return await self._lease(counter, amount, window, lease)

    async def _lease(
        self, counter: str, amount: int, window: int, previous: _Slice | None
    ) -> RateDecision:
        now = time.monotonic()
        current = previous is not None and now < previous.spend_until
        left_everywhere = amount - previous.seen if current and previous else amount
        ask = 1
        if left_everywhere >= LEASE_THRESHOLD:
            ask = min(LEASE_MAX, left_everywhere // LEASE_FRACTION)
        lease = previous if current and previous is not None else _Slice()
        self._slices[counter] = lease
        if len(self._slices) > 100_000:
            self._slices = {counter: lease}
        pending: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lease.pending = pending
        sent = time.monotonic()
        try:
            granted, seen, pttl = await self._redis(
                keys=[self._prefixed(counter)], args=[amount, window * 1000, ask]
            )
        except Exception as exc:
            # Redis unreachable, timed out, or answering oddly: fail closed (503).
            raise LimiterUnavailable(exc) from exc
        finally:
            lease.pending = None
            pending.set_result(None)
        received = time.monotonic()
        seconds = int(pttl) / 1000
        if not current or lease.spend_until <= sent:
            lease.left = 0
        # Spent only while the window surely lasts; promised until it surely ended.
        lease.spend_until = sent + seconds
        lease.reset_at = received + seconds
        lease.seen = int(seen)
        granted = int(granted)
        if granted == 0:
            return _decision(amount, window, amount + 1, lease.reset_at - received)
        lease.left += granted - 1  # one unit is this request's
        remaining = max(0, amount - lease.seen) + lease.left
        return _decision(amount, window, amount - remaining, lease.reset_at - received)

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
        self._slices.clear()
        await self.storage.reset()

    async def aclose(self) -> None:
        """Release the storage's connections, where it has any."""
        client = getattr(getattr(self.storage, "bridge", None), "storage", None)
        close = getattr(client, "aclose", None)
        if close is not None:
            await close()
