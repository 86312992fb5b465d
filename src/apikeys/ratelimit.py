"""Per-key rate limiting on `limits`' asyncio API.

The strategy is a fixed window. In one process (`memory://`) each request is one atomic count
in limits' storage. On Redis, shared by every process, a process *leases* a slice of a key's
window with one atomic script (grant at most what is left, return the window's end in
milliseconds) and spends it locally: across processes never more is admitted than the
limit, and a busy key costs a Redis round trip per slice, not per request. Slices shrink as
the window fills and are a single unit when little is left, so small limits are exactly as
strict as one increment per request. Leased units count as used in Redis, so another
process's `RateLimit` remaining may be lower than what is really left (never higher).

A key may have several named limits (*policies*), `burst=10/second, daily=10000/day`: a
request is admitted only if every policy admits it, and a refused request is charged to
none. In memory that is one check-then-charge with nothing awaited in between; on Redis it
is an all-or-nothing admission over this process's slices of every policy, and a call that
leases more for one or several policies is one script that grants nothing unless each of
them has a unit left.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Final, NamedTuple

from limits import RateLimitItem, parse_many
from limits.aio.storage import MemoryStorage, RedisClusterStorage, Storage
from limits.errors import ConfigurationError as LimitsConfigurationError
from limits.errors import StorageError
from limits.storage import storage_from_string

from apikeys.bounded import remember
from apikeys.errors import ConfigurationError, InvalidKeyParameters, LimiterUnavailable

__all__ = [
    "DEFAULT_POLICY",
    "DEFAULT_RATE_LIMIT",
    "MAX_LIMIT_LENGTH",
    "MAX_POLICIES",
    "MAX_POLICIES_LENGTH",
    "RATE_LIMIT_ENV",
    "THRESHOLDS",
    "Policy",
    "PolicyDecision",
    "PolicyStatus",
    "RateDecision",
    "RateLimiter",
    "ThresholdCrossing",
    "format_policies",
    "parse_policies",
    "parse_rate_limit",
]

logger = logging.getLogger("apikeys")

RATE_LIMIT_ENV = "APIKEYS_RATE_LIMIT"
# Bounds that every limits storage can hold (Redis refuses absurd expiry times).
MAX_WINDOW_SECONDS = 366 * 24 * 3600
MAX_AMOUNT = 10**12
DEFAULT_RATE_LIMIT = "100/minute"
DEFAULT_POLICY = "default"
"""The name of a key's limit when it is written without one (`100/minute`)."""
MAX_POLICIES = 8
THRESHOLDS: Final = (80, 90, 100)
"""The percentages of a limit at which `RateLimiter.on_threshold` is told of a window (and
of the credits granted at which `key.usage_threshold` is sent)."""
MAX_LIMIT_LENGTH: Final = 64
"""The longest text of one limit read (`10000 per 365 days` and spaces to spare)."""
MAX_POLICIES_LENGTH: Final = 1024
"""The longest text of a key's limits read (`MAX_POLICIES` named limits and spaces)."""
_POLICY_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# One limit as limits' notation writes it (`100/minute`, `3 per 2 seconds`), possessive
# throughout: linear, where limits' own regex backtracks cubically on runs of spaces. Only
# what matches (and is short) is handed to limits' parse_many.
_LIMIT = re.compile(r"[0-9]++\s*+(?:/|per)\s*+(?:[0-9]++\s*+)?[a-z]++", re.IGNORECASE)
_SEPARATORS = re.compile(r"[,;]")
_SHOWN_LENGTH = 200
_NOTATION = "write one limit as '100/minute' or named ones as 'burst=10/second, daily=10000/day'"


def parse_rate_limit(limit: str) -> RateLimitItem:
    """Parse one limit in `limits` notation (`100/minute`, `3 per 2 seconds`), or raise.

    Text over `MAX_LIMIT_LENGTH` characters is refused unread (`InvalidKeyParameters`).
    """
    if isinstance(limit, str) and len(limit) <= MAX_LIMIT_LENGTH:
        return _parse_rate_limit(limit)
    raise _invalid_limit(limit)


def _invalid_limit(limit: object) -> InvalidKeyParameters:
    return InvalidKeyParameters(
        f"invalid rate limit {_shown(limit)}: write it as '100/minute' or '3 per 2 seconds' "
        f"(one limit of at most {MAX_LIMIT_LENGTH} characters, a window of at most a year)"
    )


def _shown(text: object) -> str:
    """`text` quoted for a message, cut to `_SHOWN_LENGTH` characters."""
    shown = repr(text)
    return shown if len(shown) <= _SHOWN_LENGTH else shown[:_SHOWN_LENGTH] + "…"


@functools.lru_cache(maxsize=1024)
def _parse_rate_limit(limit: str) -> RateLimitItem:
    text = limit.strip()
    items: list[RateLimitItem] = []
    if _LIMIT.fullmatch(text):
        with contextlib.suppress(ValueError):
            items = parse_many(text)
    # One limit per key: "1/second;100/minute" would silently keep only the first.
    item = items[0] if len(items) == 1 else None
    if item is None or not 1 <= item.amount <= MAX_AMOUNT or item.get_expiry() > MAX_WINDOW_SECONDS:
        raise _invalid_limit(limit)
    return item


class Policy(NamedTuple):
    """One named limit of a key: `burst` at `10/second`."""

    name: str
    item: RateLimitItem
    text: str
    """The limit as written, without its name (`10/second`)."""


def _invalid(text: object, reason: str) -> InvalidKeyParameters:
    return InvalidKeyParameters(f"invalid rate limit {_shown(text)}: {reason}; {_NOTATION}")


def parse_policies(text: str) -> tuple[Policy, ...]:
    """Parse a key's limits: `100/minute` (one policy, `default`) or named policies.

    Named policies are `name=limit` items separated by commas or semicolons
    (`burst=10/second, daily=10000/day`): names match `[a-z][a-z0-9_-]{0,31}` and are
    unique, at most `MAX_POLICIES` items, each limit in `limits` notation with a window of
    at most a year. Raises `InvalidKeyParameters` with a one-line message; text over
    `MAX_POLICIES_LENGTH` characters is refused unread.
    """
    if not isinstance(text, str) or not text.strip():
        raise _invalid(text, "no limit given")
    if len(text) > MAX_POLICIES_LENGTH:
        raise _invalid(text, f"{len(text)} characters, at most {MAX_POLICIES_LENGTH} are allowed")
    return _parse_policies(text)


@functools.lru_cache(maxsize=1024)
def _parse_policies(text: str) -> tuple[Policy, ...]:
    parts = [part.strip() for part in _SEPARATORS.split(text)]
    if len(parts) > MAX_POLICIES:
        raise _invalid(text, f"{len(parts)} limits, at most {MAX_POLICIES} are allowed")
    policies: list[Policy] = []
    for part in parts:
        name, equals, limit = part.partition("=")
        if not equals:
            if len(parts) > 1:
                reason = f"{_shown(part)} has no name (name every limit when there are several)"
                raise _invalid(text, reason if part else "an empty item")
            name, limit = DEFAULT_POLICY, part
        name, limit = name.strip(), limit.strip()
        if _POLICY_NAME.fullmatch(name) is None:
            reason = f"{_shown(name)} is not a policy name (a-z, 0-9, _ and -, 32 at most)"
            raise _invalid(text, reason)
        if any(policy.name == name for policy in policies):
            raise _invalid(text, f"the name {name!r} is used twice")
        try:
            item = parse_rate_limit(limit)
        except InvalidKeyParameters:
            reason = f"{_shown(limit)} is not one limit with a window of at most a year"
            raise _invalid(text, reason) from None
        policies.append(Policy(name, item, limit))
    return tuple(policies)


def format_policies(policies: str | Mapping[str, str] | Iterable[Policy]) -> str:
    """The canonical text of a key's limits, as `KeyRecord.rate_limit` stores it.

    Takes `{name: limit}` (`{"burst": "10/second", "daily": "10000/day"}`), `Policy`
    items, or text. One policy named `default` is its bare limit (`100/minute`); otherwise
    `burst=10/second, daily=10000/day`, in the order given. Raises `InvalidKeyParameters`.
    """
    if isinstance(policies, str):
        parsed = parse_policies(policies)
    else:
        pairs: list[tuple[object, object]]
        if isinstance(policies, Mapping):
            pairs = list(policies.items())
        else:
            pairs = []
            for policy in policies:
                if not isinstance(policy, Policy):
                    raise InvalidKeyParameters(f"invalid rate limit {policy!r}: not a Policy")
                pairs.append((policy.name, policy.text))
        if not pairs:
            raise _invalid({}, "no limit given")
        for name, limit in pairs:
            # A limit holding a separator would smuggle in another policy.
            if not isinstance(name, str) or not isinstance(limit, str) or "=" in limit:
                raise _invalid({name: limit}, "names and limits must be text, one limit each")
            if _SEPARATORS.search(limit):
                raise _invalid({name: limit}, "one limit per name")
        parsed = parse_policies(", ".join(f"{name}={limit}" for name, limit in pairs))
    if len(parsed) == 1 and parsed[0].name == DEFAULT_POLICY:
        return parsed[0].text
    return ", ".join(f"{policy.name}={policy.text}" for policy in parsed)


class RateDecision(NamedTuple):
    """The limiter's answer for one request."""

    allowed: bool
    limit: int
    window: int
    remaining: int
    reset_after: int
    """Whole seconds until the window resets (at least 1)."""


class PolicyStatus(NamedTuple):
    """One policy's part of a `PolicyDecision`."""

    name: str
    allowed: bool
    """False when this policy refused the request (it is among the violated ones)."""
    limit: int
    window: int
    remaining: int
    """Requests left in the window (after this one, when it was admitted)."""
    reset_after: int
    """Whole seconds until the window resets (at least 1)."""


class PolicyDecision(NamedTuple):
    """The limiter's answer for one request over all of a key's policies.

    `allowed` only if every policy admitted it; a refused request is charged to none.
    `violated` names the policies that refused it, and `retry_after` is the longest of
    their `reset_after` (0 when admitted).
    """

    allowed: bool
    policies: tuple[PolicyStatus, ...]
    violated: tuple[str, ...]
    retry_after: int


class ThresholdCrossing(NamedTuple):
    """A key's window of one policy reaching a percentage of its limit: what
    `RateLimiter.on_threshold` is told, once per key, policy, threshold and window."""

    key_id: str
    policy: str
    """The policy's name (`default` for a key's one unnamed limit)."""
    threshold: int
    """The percentage of `THRESHOLDS` reached."""
    used: int
    """The window's count when it was reached (on Redis, the units leased so far)."""
    limit: int
    window: int
    """The window's length in seconds."""
    window_end: float
    """When the window ends, in seconds since 1970 (UTC)."""
    at: float
    """When the threshold was reached, in seconds since 1970 (UTC)."""


_Observer = Callable[[ThresholdCrossing], None]


# Builds a named tuple from a tuple without its __new__'s argument parsing (the hot path).
_tuple_new = tuple.__new__


def _verdict(statuses: tuple[PolicyStatus, ...]) -> PolicyDecision:
    violated = tuple(status.name for status in statuses if not status.allowed)
    if not violated:
        return PolicyDecision(True, statuses, (), 0)
    retry_after = max(status.reset_after for status in statuses if not status.allowed)
    return PolicyDecision(False, statuses, violated, max(1, retry_after))


def _status(
    name: str, allowed: bool, amount: int, window: int, remaining: int, seconds_left: float
) -> PolicyStatus:
    reset_after = math.ceil(seconds_left)
    return PolicyStatus(
        name,
        allowed,
        amount,
        window,
        remaining if remaining > 0 else 0,
        reset_after if reset_after > 1 else 1,
    )


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

    def sweep_due(self, now: float) -> None:
        """Sweep expired counters if `sweep_interval` has passed (a window starts at `now`)."""
        if now >= self._next_sweep:
            self._sweep(now)

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

# KEYS = the windows' counters; ARGV = limit, window (ms), units asked, for each in turn.
# All or nothing: grants units only if every counter has one left. Asking 0 units reads.
# Returns {granted, count after, PTTL in ms} for each counter, flattened.
_LEASE_MANY = """
local counts, ttls = {}, {}
local open = true
for i = 1, #KEYS do
  local count = tonumber(redis.call('GET', KEYS[i]) or '0')
  local ttl = redis.call('PTTL', KEYS[i])
  if ttl < 0 then
    count = 0
    ttl = tonumber(ARGV[3 * i - 1])
  end
  counts[i] = count
  ttls[i] = ttl
  if count >= tonumber(ARGV[3 * i - 2]) then
    open = false
  end
end
local result = {}
for i = 1, #KEYS do
  local granted = 0
  if open then
    granted = math.min(tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i - 2]) - counts[i])
  end
  if granted > 0 then
    if counts[i] == 0 then
      redis.call('SET', KEYS[i], granted, 'PX', ttls[i])
    else
      redis.call('INCRBY', KEYS[i], granted)
    end
  end
  result[3 * i - 2] = granted
  result[3 * i - 1] = counts[i] + granted
  result[3 * i] = ttls[i]
end
return result
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


def _lease_size(amount: int, previous: _Slice | None, now: float) -> int:
    """The units to ask for: a slice of what is left of the window everywhere."""
    left_everywhere = amount
    if previous is not None and now < previous.spend_until:
        left_everywhere = amount - previous.seen
    if left_everywhere >= LEASE_THRESHOLD:
        return min(LEASE_MAX, left_everywhere // LEASE_FRACTION)
    return 1


def _spend(lease: _Slice | None, amount: int, now: float) -> tuple[int, int] | None:
    """One request charged to this process's `lease` of a window, without a round trip:
    `(remaining, reset_after)`, `remaining` below 0 when refused; None when only Redis can
    decide (no lease, one in flight, or past the time its window surely lasts)."""
    if lease is None or lease.pending is not None or now >= lease.spend_until:
        return None
    if lease.seen > amount:
        lease.left = 0  # leased under a wider limit: the narrowed one decides
    if lease.left > 0:
        # Spent without a round trip: nothing awaits between check and spend.
        lease.left -= 1
        remaining = max(0, amount - lease.seen) + lease.left
    elif lease.seen >= amount:
        # The window is used up everywhere as far as Redis said: refused locally until it
        # ends (its end came from the same call: Retry-After holds).
        remaining = -1
    else:
        return None
    reset_after = math.ceil(lease.reset_at - now)
    return remaining, reset_after if reset_after > 1 else 1


# One policy of a key as the limiter counts it: (counter key, amount, window seconds, name).
_Plan = tuple[str, int, int, str]


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


def _redis_options() -> dict[str, Any]:
    """The store's connection defaults (timeouts, no retries, RESP2), for limits' client."""
    from apikeys.stores.redis.client import connection_defaults

    return connection_defaults()


def _storage_uri(url: str) -> tuple[str, dict[str, Any]]:
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("memory", "async+memory"):
        return "async+memory://", {}
    if scheme in ("redis", "rediss", "redis+unix", "redis+cluster", "redis+sentinel"):
        try:
            import redis  # noqa: F401 - only to say which extra is missing
        except ImportError:
            raise ConfigurationError(
                f"the {scheme}:// limiter storage needs redis-py. "
                "Install it with: pip install 'apikeys[redis]'"
            ) from None
        # redis-py's asyncio client, the one the key store uses: no second Redis library,
        # and the store's connection defaults. limits' own storages for each deployment.
        options = {"implementation": "redispy", **_redis_options()}
        if scheme == "redis+sentinel":
            # Counters are read and leased on the master only: a replica may lag behind.
            options["use_replicas"] = False
        if scheme != "redis+cluster":
            options.pop("health_check_interval")
        return f"async+{url}", options
    if scheme.startswith("async+"):
        return url, {}
    raise ConfigurationError(
        f"unknown limiter storage {scheme + '://' if scheme else url!r}; "
        "use memory://, redis://host:port/db, redis+sentinel://host:port/service_name or "
        "redis+cluster://host:port"
    )


class RateLimiter:
    """Counts requests per key in a `limits` storage and decides admission.

    `storage_url` is `memory://` (one process) or Redis, shared by every process so that a
    key's limits hold across all of them: `redis://host:port/db`, `rediss://…`,
    `redis+sentinel://host:port[,host:port…]/service_name` or
    `redis+cluster://host:port[,host:port…]` (limits' URL forms and storages, on redis-py).
    `default` is the limit of keys without their own `rate_limit`: one limit (`100/minute`),
    named policies
    (`burst=10/second, daily=10000/day`, or a mapping `{name: limit}`), else
    `APIKEYS_RATE_LIMIT`, else `100/minute`.

    `hit` checks a key with one policy (the fast path); `hit_policies` checks and charges
    every policy of a key at once; `refund` gives back what an admitted request was charged.
    Several policies are atomic on `memory://` and `redis://`; on other `limits` storages
    they are checked, then charged, and a charge that overshot is taken back.

    `on_threshold`, None by default, is called with a `ThresholdCrossing` when a key's
    window of a policy reaches a percentage of `THRESHOLDS` of its limit, once per key,
    policy, threshold and window (see the module doc). It runs on the request path: it
    must return at once and never raise (what it raises is logged and ignored). The
    `KeyManager` sets it while an endpoint wants `key.usage_threshold` webhooks.
    """

    # False in a subclass that overrides `hit` but not `hit_now` (a test double that fails
    # or counts): `hit_now` then leaves every request to its `hit`.
    _decides_now: ClassVar[bool] = True
    # False in a subclass that overrides how a request is charged: Gate.admit_now, which
    # counts in this process's windows itself (count_here, policies_here), then steps aside.
    _counts_here: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._decides_now = cls.hit is RateLimiter.hit or cls.hit_now is not RateLimiter.hit_now
        cls._counts_here = (
            cls.hit is RateLimiter.hit
            and cls.hit_now is RateLimiter.hit_now
            and cls.hit_policies is RateLimiter.hit_policies
        )

    def __init__(
        self,
        default: str | Mapping[str, str] | None = None,
        storage_url: str = "memory://",
        *,
        key_prefix: str = "apikeys",
        storage: Storage | None = None,
    ) -> None:
        if isinstance(default, Mapping):
            default = format_policies(default)
        self.default = default or os.environ.get(RATE_LIMIT_ENV) or DEFAULT_RATE_LIMIT
        parse_policies(self.default)
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
                    "use memory://, redis://host:port/db, "
                    "redis+sentinel://host:port/service_name or redis+cluster://host:port"
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
        self._redis_many: Any = None
        self._slices: dict[str, _Slice] = {}
        if self._local is None and client is not None and hasattr(client, "register_script"):
            self._redis = client.register_script(_LEASE)
            self._redis_many = client.register_script(_LEASE_MANY)
            self._prefixed = getattr(bridge, "prefixed_key", lambda key: key)
        self._key_prefix = key_prefix
        # On a Redis Cluster a key's counters carry its id as a hash tag, so that every
        # policy of a key is in one slot and one script can lease them all. Elsewhere the
        # names stay as they were (a rolling upgrade keeps counting in the same counters).
        self._tag = isinstance(storage, RedisClusterStorage)
        # counter key -> monotonic time its window ends, as far as this process knows
        self._window_ends: dict[str, float] = {}
        # (key id, limit) -> (counter key, amount, window seconds)
        self._plans: dict[tuple[str, str | None], tuple[str, int, int]] = {}
        # (key id, limit or policies) -> one plan per policy
        self._plan_sets: dict[tuple[str, object], tuple[_Plan, ...]] = {}
        self.on_threshold: _Observer | None = None

    def __repr__(self) -> str:
        return f"RateLimiter(default={self.default!r}, storage={type(self.storage).__name__})"

    def policies(self, limit: str | None = None) -> tuple[Policy, ...]:
        """The policies of a key whose `rate_limit` is `limit` (None: the default)."""
        return parse_policies(limit or self.default)

    async def hit(self, key_id: str, limit: str | None = None) -> RateDecision:
        """Count one request of `key_id` against `limit` (or the default) and decide.

        For a key with one policy; a key with several is checked with `hit_policies`
        (`hit` raises `InvalidKeyParameters` for it).
        """
        counter, amount, window = self._plans.get((key_id, limit)) or self._plan(key_id, limit)
        decided = self._decide_now(counter, amount, window)
        if decided is not None:
            return decided
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
        if self.on_threshold is not None and count * 5 >= amount * 4:
            at = time.time()
            self._crossed(counter, count - 1, count, amount, window, at + end - now, at)
        return _decision(amount, window, count, end - now)

    @property
    def counts_here(self) -> bool:
        """True when this limiter counts in this process (the memory storage, and no
        subclass charging otherwise): `count_here` and `policies_here` then decide a
        request at once."""
        return self._local is not None and self._counts_here

    def plan(self, key_id: str, limit: str | None) -> tuple[str, int, int]:
        """`key_id`'s one policy of `limit` as `(counter, amount, window)`, made once."""
        return self._plans.get((key_id, limit)) or self._plan(key_id, limit)

    def hit_now(self, key_id: str, limit: str | None = None) -> RateDecision | None:
        """`hit` when it need not wait: the in-process limiter always decides at once, and
        Redis' while this process holds units of the window it leased. None when Redis
        must be asked (or the storage is another): then `await hit(key_id, limit)`.

        The request path calls this first, to spare an await per request.
        """
        if not self._decides_now:
            return None
        counter, amount, window = self._plans.get((key_id, limit)) or self._plan(key_id, limit)
        return self._decide_now(counter, amount, window)

    def _decide_now(self, counter: str, amount: int, window: int) -> RateDecision | None:
        """One policy's decision when this process can make it alone, else None."""
        if self._local is not None:
            remaining, reset_after = self.count_here(counter, amount, window)
            return RateDecision(
                remaining >= 0, amount, window, remaining if remaining > 0 else 0, reset_after
            )
        if self._redis is not None:
            lease = self._slices.get(counter)
            if lease is not None:
                return self._spend_lease(lease, amount, window, time.monotonic())
        return None

    def count_here(self, counter: str, amount: int, window: int) -> tuple[int, int]:
        """Charge one request to `counter` (a `plan`'s) in this process's windows, unless
        that would pass `amount`: `(remaining, reset_after)`, `remaining` below 0 when
        refused (and then nothing is charged). Only when `counts_here` is True."""
        local = self._local
        assert local is not None
        # The count of FixedWindowMemoryStorage.count, written out: it runs on every request.
        now = time.time()
        counts, ends = local.storage, local.expirations
        end = ends.get(counter, 0.0)
        if end > now:
            count = counts[counter] + 1
        else:
            count = 1
            end = ends[counter] = now + window
            local.sweep_due(now)
        # A refused request is charged nothing.
        counts[counter] = count if count <= amount else count - 1
        # Observed, only a charge from 80 % (the lowest of THRESHOLDS) to 100 % of the
        # window can reach a mark: every other request pays these comparisons alone.
        if self.on_threshold is not None and amount * 4 <= count * 5 <= amount * 5:
            self._crossed(counter, count - 1, count, amount, window, end, now)
        # In-process, the window's end is known exactly: no second look-up, no rounding.
        reset_after = math.ceil(end - now)
        return amount - count, reset_after if reset_after > 1 else 1

    def policies_here(
        self, key_id: str, policies: str | Sequence[Policy] | None = None
    ) -> PolicyDecision:
        """`hit_policies` in this process's windows, without the coroutine: only when
        `counts_here` is True."""
        if policies.__class__ is list:
            policies = tuple(policies)  # hashable, as the plans are cached by it
        plans = self._plan_sets.get((key_id, policies)) or self._plan_set(key_id, policies)
        local = self._local
        assert local is not None
        return self._decide_local_many(local, plans)

    async def hit_policies(
        self, key_id: str, policies: str | Sequence[Policy] | None = None
    ) -> PolicyDecision:
        """Check and charge one request of `key_id` against every one of its policies.

        `policies` is a key's `rate_limit` text (None: the default) or `Policy` items. The
        request is admitted only if every policy admits it, and then charged one unit of
        each; a refused request is charged to none.
        """
        if policies.__class__ is list:
            policies = tuple(policies)  # hashable, as the plans are cached by it
        plans = self._plan_sets.get((key_id, policies)) or self._plan_set(key_id, policies)
        local = self._local
        if local is not None:
            return self._decide_local_many(local, plans)
        if self._redis_many is not None:
            return await self._hit_leased_many(plans)
        return await self._hit_generic_many(plans)

    async def refund(self, key_id: str, policies: str | Sequence[Policy] | None = None) -> None:
        """Give back the unit of each policy that an admitted request of `key_id` was charged.

        For a request the limits admitted but that is refused for another reason (say, no
        credits left). Call it while handling that request, with the `rate_limit` it was
        checked with: a unit is given back to the current window of each policy, and
        nothing once that window has ended. With Redis, the unit returns to this process's
        slice of the window (no round trip).
        """
        if policies.__class__ is list:
            policies = tuple(policies)  # hashable, as the plans are cached by it
        plans = self._plan_sets.get((key_id, policies)) or self._plan_set(key_id, policies)
        local = self._local
        if local is not None:
            now = time.time()
            counts, ends = local.storage, local.expirations
            for counter, *_ in plans:
                if ends.get(counter, 0.0) > now and counts[counter] > 0:
                    counts[counter] -= 1
            return
        if self._redis is not None:
            now = time.monotonic()
            for counter, *_ in plans:
                lease = self._slices.get(counter)
                if lease is not None and now < lease.spend_until:
                    lease.left += 1
            return
        for counter, _, window, _ in plans:
            try:
                if await self.storage.get(counter) > 0:
                    await self.storage.incr(counter, window, -1)
            except (StorageError, OSError) as exc:
                raise LimiterUnavailable(exc) from exc

    # -- one policy ------------------------------------------------------------------------

    @staticmethod
    def _spend_lease(
        lease: _Slice | None, amount: int, window: int, now: float
    ) -> RateDecision | None:
        """The decision this process's lease of a window makes alone, or None (ask Redis)."""
        spent = _spend(lease, amount, now)
        if spent is None:
            return None
        remaining, reset_after = spent
        return RateDecision(
            remaining >= 0, amount, window, remaining if remaining > 0 else 0, reset_after
        )

    @property
    def leases_here(self) -> bool:
        """True when this limiter counts in Redis by leases (and no subclass charges
        otherwise): `spend_here` then decides most requests at once."""
        return self._redis is not None and self._counts_here

    def spend_here(self, counter: str, amount: int, window: int) -> tuple[int, int] | None:
        """`count_here` for a Redis limiter: charge one request to `counter` (a `plan`'s)
        from the units this process leased of its window, `(remaining, reset_after)` with
        `remaining` below 0 when refused; or None, having charged nothing, when Redis must
        be asked (no lease, or one used up, in flight or past its window): then `hit`.
        Only when `leases_here` is True."""
        return _spend(self._slices.get(counter), amount, time.monotonic())

    async def _hit_leased(self, counter: str, amount: int, window: int) -> RateDecision:
        slices = self._slices
        while True:
            lease = slices.get(counter)
            decided = self._spend_lease(lease, amount, window, time.monotonic())
            if decided is not None:
                return decided
            if lease is not None and lease.pending is not None:
                await asyncio.shield(lease.pending)  # one lease in flight per counter
                continue
            return await self._lease(counter, amount, window, lease)

    async def _lease(
        self, counter: str, amount: int, window: int, previous: _Slice | None
    ) -> RateDecision:
        now = time.monotonic()
        current = previous is not None and now < previous.spend_until
        ask = _lease_size(amount, previous, now)
        lease = previous if current and previous is not None else _Slice()
        remember(self._slices, counter, lease, 100_000)
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
        if granted and self.on_threshold is not None:
            # The script granted these units to this process alone: a mark they reach is
            # told here, and nowhere else.
            at = time.time()
            self._crossed(
                counter, lease.seen - granted, lease.seen, amount, window, at + seconds, at
            )
        if granted == 0:
            return _decision(amount, window, amount + 1, lease.reset_at - received)
        lease.left += granted - 1  # one unit is this request's
        remaining = max(0, amount - lease.seen) + lease.left
        return _decision(amount, window, amount - remaining, lease.reset_at - received)

    def _plan(self, key_id: str, limit: str | None) -> tuple[str, int, int]:
        policies = self.policies(limit)
        if len(policies) != 1:
            raise InvalidKeyParameters(
                f"rate limit {limit or self.default!r} has {len(policies)} policies: "
                "check it with RateLimiter.hit_policies"
            )
        counter, amount, window, _ = self._policy_plan(key_id, policies[0])
        return remember(self._plans, (key_id, limit), (counter, amount, window), 100_000)

    def _policy_plan(self, key_id: str, policy: Policy) -> _Plan:
        amount, window = policy.item.amount, policy.item.get_expiry()
        # A counter is named by its window, not its amount: a limit changed to another
        # amount (10/minute to 5/minute) keeps counting what its window has already used.
        key = f"{{{key_id}}}" if self._tag else key_id
        counter = f"{self._key_prefix}/{key}/{window}"
        if policy.name != DEFAULT_POLICY:
            counter = f"{self._key_prefix}/{key}/{policy.name}/{window}"
        return counter, amount, window, policy.name

    def _counter_owner(self, counter: str) -> tuple[str, str] | None:
        """`(key id, policy name)` of a counter `_policy_plan` named, read back from the
        name (a policy name holds no `/`, nor does a key id apikeys makes): no map to fill
        on the request path, and none to lose when a cache of plans is cleared."""
        head = self._key_prefix + "/"
        if not counter.startswith(head):
            return None
        parts = counter[len(head) :].split("/")
        if len(parts) == 2:
            key, name = parts[0], DEFAULT_POLICY
        elif len(parts) == 3:
            key, name = parts[0], parts[1]
        else:
            return None
        if self._tag:
            key = key[1:-1]
        return key, name

    def _crossed(
        self,
        counter: str,
        before: int,
        after: int,
        amount: int,
        window: int,
        window_end: float,
        at: float,
    ) -> None:
        """Tell `on_threshold` of each mark of `THRESHOLDS` (the least count at or above
        that share of `amount`) that `counter`'s window passed going from `before` units
        used to `after`."""
        observer = self.on_threshold
        for threshold in THRESHOLDS:
            mark = -(-amount * threshold // 100)
            if not before < mark <= after:
                continue
            owner = self._counter_owner(counter)
            if observer is None or owner is None:
                return
            crossing = ThresholdCrossing(
                owner[0], owner[1], threshold, after, amount, window, window_end, at
            )
            try:
                observer(crossing)
            except Exception as exc:
                # The request goes on whatever the observer does.
                logger.warning(
                    "apikeys: the rate limit threshold observer failed: %s", type(exc).__name__
                )

    def _plan_set(self, key_id: str, policies: str | Sequence[Policy] | None) -> tuple[_Plan, ...]:
        if policies is None or isinstance(policies, str):
            parsed = self.policies(policies)
            cache_key: object = policies
        else:
            parsed = tuple(policies)
            if not parsed or not all(isinstance(policy, Policy) for policy in parsed):
                raise InvalidKeyParameters("policies must be rate limit text or Policy items")
            if len({policy.name for policy in parsed}) != len(parsed):
                raise InvalidKeyParameters("policy names must be unique")
            cache_key = parsed
        plans = tuple(self._policy_plan(key_id, policy) for policy in parsed)
        return remember(self._plan_sets, (key_id, cache_key), plans, 100_000)

    # -- several policies ------------------------------------------------------------------

    def _decide_local_many(
        self, local: FixedWindowMemoryStorage, plans: tuple[_Plan, ...]
    ) -> PolicyDecision:
        # Check every policy, then charge every one or none: nothing awaits in between.
        now = time.time()
        counts, ends = local.storage, local.expirations
        for counter, amount, _, _ in plans:
            if counts[counter] >= amount and ends.get(counter, 0.0) > now:
                return self._refused_local(local, plans, now)
        statuses = []
        for counter, amount, window, name in plans:
            end = ends.get(counter, 0.0)
            if end > now:
                count = counts[counter] = counts[counter] + 1
            else:
                count = counts[counter] = 1
                end = ends[counter] = now + window
                local.sweep_due(now)
            reset_after = math.ceil(end - now) or 1
            statuses.append(
                _tuple_new(PolicyStatus, (name, True, amount, window, amount - count, reset_after))
            )
        if self.on_threshold is not None:
            for counter, amount, window, _ in plans:
                count = counts[counter]
                if count * 5 >= amount * 4:
                    self._crossed(counter, count - 1, count, amount, window, ends[counter], now)
        return _tuple_new(PolicyDecision, (True, tuple(statuses), (), 0))

    @staticmethod
    def _refused_local(
        local: FixedWindowMemoryStorage, plans: tuple[_Plan, ...], now: float
    ) -> PolicyDecision:
        counts, ends = local.storage, local.expirations
        statuses = []
        for counter, amount, window, name in plans:
            end = ends.get(counter, 0.0)
            count = counts[counter] if end > now else 0
            seconds = end - now if count else window
            statuses.append(_status(name, count < amount, amount, window, amount - count, seconds))
        return _verdict(tuple(statuses))

    async def _hit_leased_many(self, plans: tuple[_Plan, ...]) -> PolicyDecision:
        while True:
            slices = self._slices
            now = time.monotonic()
            leases = [slices.get(plan[0]) for plan in plans]
            pending = next((lease.pending for lease in leases if lease and lease.pending), None)
            if pending is not None:
                await asyncio.shield(pending)  # one lease in flight per counter
                continue
            unknown: list[int] = []  # policies whose window this process knows nothing of
            short: list[int] = []  # policies with units left in Redis, none in hand
            exhausted = False  # a policy is used up everywhere as far as Redis said
            for index, lease in enumerate(leases):
                if lease is not None and lease.seen > plans[index][1]:
                    lease.left = 0  # leased under a wider limit: the narrowed one decides
                if lease is None or now >= lease.spend_until:
                    unknown.append(index)
                elif lease.left <= 0:
                    if lease.seen >= plans[index][1]:
                        exhausted = True
                    else:
                        short.append(index)
            if exhausted:
                # Refused whatever the others say: only read the windows nobody knows here.
                if unknown:
                    await self._lease_many(plans, unknown, read_only=True)
                refused = self._refused_leased(plans)
                if refused is not None:
                    return refused
                continue  # a refund gave a unit back meanwhile: decide again
            if unknown or short:
                # One script leases every policy that lacks a unit, all or none; the
                # units are spent (or the refusal found) on the next turn.
                await self._lease_many(plans, unknown + short, read_only=False)
                continue
            # Every policy has a unit in hand: all spent at once, nothing awaited between.
            statuses = []
            for (_, amount, window, name), lease in zip(plans, leases, strict=True):
                assert lease is not None
                lease.left -= 1
                remaining = max(0, amount - lease.seen) + lease.left
                statuses.append(
                    _status(name, True, amount, window, remaining, lease.reset_at - now)
                )
            return PolicyDecision(True, tuple(statuses), (), 0)

    async def _lease_many(
        self, plans: tuple[_Plan, ...], indexes: list[int], read_only: bool
    ) -> bool:
        """Lease more of the policies at `indexes` in one script; True if each got a unit."""
        now = time.monotonic()
        loop_future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        leases: list[tuple[_Slice, bool]] = []
        keys: list[str] = []
        args: list[int] = []
        for index in indexes:
            counter, amount, window, _ = plans[index]
            previous = self._slices.get(counter)
            current = previous is not None and now < previous.spend_until
            lease = previous if current and previous is not None else _Slice()
            lease.pending = loop_future
            leases.append((lease, current))
            self._slices[counter] = lease
            keys.append(self._prefixed(counter))
            args += (amount, window * 1000, 0 if read_only else _lease_size(amount, previous, now))
        if len(self._slices) > 100_000:
            # Full: keep only this script's leases (clearing before one of them could drop
            # another already set, with the units it holds).
            self._slices = {
                plans[index][0]: lease for index, (lease, _) in zip(indexes, leases, strict=True)
            }
        sent = time.monotonic()
        try:
            answer = await self._redis_many(keys=keys, args=args)
        except Exception as exc:
            # Redis unreachable, timed out, or answering oddly: fail closed (503).
            raise LimiterUnavailable(exc) from exc
        finally:
            for lease, _ in leases:
                lease.pending = None
            loop_future.set_result(None)
        received = time.monotonic()
        at = time.time()
        every = True
        for position, (lease, current) in enumerate(leases):
            granted, seen, pttl = (int(value) for value in answer[3 * position : 3 * position + 3])
            seconds = pttl / 1000
            if not current or lease.spend_until <= sent:
                lease.left = 0
            lease.spend_until = sent + seconds
            lease.reset_at = received + seconds
            lease.seen = seen
            lease.left += granted
            every = every and granted > 0
            if granted and self.on_threshold is not None:
                counter, amount, window, _ = plans[indexes[position]]
                self._crossed(counter, seen - granted, seen, amount, window, at + seconds, at)
        return every

    def _refused_leased(self, plans: tuple[_Plan, ...]) -> PolicyDecision | None:
        """The refusal as this process's slices tell it; None if no policy refuses now."""
        now = time.monotonic()
        statuses = []
        for counter, amount, window, name in plans:
            lease = self._slices.get(counter)
            if lease is None:  # pragma: no cover - every policy was read just before
                statuses.append(_status(name, True, amount, window, amount, window))
                continue
            allowed = lease.left > 0 or lease.seen < amount
            remaining = max(0, amount - lease.seen) + lease.left
            statuses.append(_status(name, allowed, amount, window, remaining, lease.reset_at - now))
        decision = _verdict(tuple(statuses))
        return None if decision.allowed else decision

    async def _hit_generic_many(self, plans: tuple[_Plan, ...]) -> PolicyDecision:
        storage = self.storage
        try:
            used = [await storage.get(counter) for counter, *_ in plans]
            allowed = [count < plan[1] for count, plan in zip(used, plans, strict=True)]
            admit = all(allowed)
            if admit:
                used = [await storage.incr(counter, window) for counter, _, window, _ in plans]
                allowed = [count <= plan[1] for count, plan in zip(used, plans, strict=True)]
                if not all(allowed):
                    # Another request got in between: take this one's charges back.
                    for counter, _, window, _ in plans:
                        await storage.incr(counter, window, -1)
                    used, admit = [count - 1 for count in used], False
        except (StorageError, OSError) as exc:
            raise LimiterUnavailable(exc) from exc
        now = time.monotonic()
        at = time.time()
        observed = admit and self.on_threshold is not None
        statuses = []
        for (counter, amount, window, name), count, ok in zip(plans, used, allowed, strict=True):
            if count <= 0 or (admit and count == 1):
                end = now + window
                if count == 1:
                    self._remember(counter, end)
            else:
                end = self._window_ends.get(counter, 0.0)
                if end <= now:
                    end = await self._fetch_window_end(counter, now)
            if observed:
                self._crossed(counter, count - 1, count, amount, window, at + end - now, at)
            statuses.append(_status(name, ok, amount, window, amount - count, end - now))
        return _verdict(tuple(statuses))

    # -- windows ---------------------------------------------------------------------------

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
        # Forgetting only costs one more round trip per key, so clearing when full will do.
        remember(self._window_ends, counter, end, 100_000)

    async def reset(self) -> None:
        """Forget every counter (tests and admin tools)."""
        self._window_ends.clear()
        self._slices.clear()
        await self.storage.reset()

    async def aclose(self) -> None:
        """Release the storage's connections, where it has any."""
        bridge = getattr(self.storage, "bridge", None)
        clients = [getattr(bridge, "storage", None), getattr(bridge, "storage_replica", None)]
        # Through Sentinel: the clients that asked the sentinels where the master is, too.
        clients += getattr(getattr(bridge, "sentinel", None), "sentinels", [])
        for client in clients:
            close = getattr(client, "aclose", None)
            if close is not None:
                await close()
