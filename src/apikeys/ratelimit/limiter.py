"""`RateLimiter`: per-key rate limits on `limits`' asyncio storages, charged by one operation.

The strategy is a fixed window. In one process (`memory://`) each request is one atomic count
in this process's windows (`apikeys.ratelimit.counting`). On Redis, shared by every process, a
process leases slices of a key's windows and spends them locally
(`apikeys.ratelimit.leases`): across processes never more is admitted than the limit. Leased
units count as used in Redis, so another process's `RateLimit` remaining may be lower than
what is really left (never higher).

A key may have several named limits (*policies*), `burst=10/second, daily=10000/day`: a
request is admitted only if every policy admits it, and a refused request is charged to
none. A key that belongs to an identity is also charged to the identity's policies, which
every key of the identity shares, in the same all-or-nothing charge (`RateLimiter.plan`).
`RateLimiter.charge` is the one way a request is charged: it answers at once when this
process can decide (the in-process windows, or units it holds of Redis' windows), and
otherwise hands back what asks the server.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

from limits.aio.storage import MemoryStorage, RedisClusterStorage, Storage
from limits.errors import ConfigurationError as LimitsConfigurationError
from limits.errors import StorageError
from limits.storage import storage_from_string

from apikeys.bounded import remember
from apikeys.errors import ConfigurationError, InvalidKeyParameters, LimiterUnavailable
from apikeys.ratelimit.counting import FixedWindowMemoryStorage, count_many, refund_here
from apikeys.ratelimit.decisions import (
    Charge,
    Observer,
    Plan,
    PolicyDecision,
    PolicyPlan,
    RateDecision,
    ThresholdCrossing,
    decision,
    seconds,
)
from apikeys.ratelimit.leases import LEASE_SCRIPT, LeasedWindows
from apikeys.ratelimit.notation import (
    DEFAULT_POLICY,
    DEFAULT_RATE_LIMIT,
    RATE_LIMIT_ENV,
    THRESHOLDS,
    Policy,
    format_policies,
    parse_policies,
)

__all__ = ["IDENTITY_POLICY_PREFIX", "RateLimiter"]

IDENTITY_POLICY_PREFIX = "identity."
"""What the name of an identity's policy starts with in a decision and its headers
(`identity.daily`; `identity.default` for its one unnamed limit): a key's policy names
(`[a-z][a-z0-9_-]*`) never hold a dot, so the two never mix."""

logger = logging.getLogger("apikeys")


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


def _check_key_id(key_id: str) -> None:
    """Refuse a key id whose counters could be an identity's: identities' counters are
    named `i:<identity>` where a key's are named by its id, and on a Cluster follow the
    identity's `{i:<identity>}` tag with `/` (apikeys' own ids are 12 base62 characters)."""
    if not isinstance(key_id, str) or not key_id or key_id.startswith(("i:", "/")):
        raise InvalidKeyParameters(
            "a key id must be a non-empty text not starting with 'i:' or '/' "
            "(the names of identities' counters)"
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

    `charge(plan(key_id, limit), cost)` is the one way a request is charged (the request
    path calls it); `hit` (a key with one policy) and `hit_policies` (every policy of a key)
    await it for one request, and `refund` gives back what an admitted request was charged.
    Several policies are atomic on `memory://` and `redis://`; on other `limits` storages
    they are checked, then charged, and a charge that overshot is taken back.

    `on_threshold`, None by default, is called with a `ThresholdCrossing` when a key's
    (or an identity's) window of a policy reaches a percentage of `THRESHOLDS` of its limit,
    once per key (or identity), policy, threshold and window. It runs on the request path:
    it must return at once and never raise (what it raises is logged and ignored). The
    `KeyManager` sets it while an endpoint wants `key.usage_threshold` webhooks.
    """

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
        # On Redis: leased slices of windows, spent in process (apikeys.ratelimit.leases).
        bridge = getattr(storage, "bridge", None)
        client = getattr(bridge, "storage", None)
        # On a Redis Cluster a key's counters carry its id as a hash tag, so that every
        # policy of a key is in one slot and one script can lease them all. Elsewhere the
        # names stay as they were (a rolling upgrade keeps counting in the same counters).
        self._tag = isinstance(storage, RedisClusterStorage)
        self._leases: LeasedWindows | None = None
        if self._local is None and client is not None and hasattr(client, "register_script"):
            prefixed = getattr(bridge, "prefixed_key", lambda key: key)
            # A cluster client routes a script as keyless until it has learnt the slot map
            # (redis-py 8.1): concurrent first leases would go to random masters, and their
            # MOVED replies make it close itself under the others. Learnt before each lease.
            ready = client.initialize if self._tag and hasattr(client, "initialize") else None
            self._leases = LeasedWindows(client.register_script(LEASE_SCRIPT), prefixed, ready)
        self._key_prefix = key_prefix
        # counter key -> monotonic time its window ends, as far as this process knows
        self._window_ends: dict[str, float] = {}
        # (key id, limit or policies[, identity, its limit or policies]) -> one plan per policy
        self._plans: dict[tuple[object, ...], Plan] = {}
        self.on_threshold: Observer | None = None

    def __repr__(self) -> str:
        return f"RateLimiter(default={self.default!r}, storage={type(self.storage).__name__})"

    def policies(self, limit: str | None = None) -> tuple[Policy, ...]:
        """The policies of a key whose `rate_limit` is `limit` (None: the default)."""
        return parse_policies(limit or self.default)

    def plan(
        self,
        key_id: str,
        policies: str | Sequence[Policy] | None = None,
        *,
        identity: str | None = None,
        identity_policies: str | Sequence[Policy] | None = None,
    ) -> Plan:
        """`key_id`'s policies as this limiter counts them, what `charge` takes: `policies`
        is a key's `rate_limit` text (None: the default) or `Policy` items. Made once per
        key and limit.

        For a key that belongs to an `identity` (a text without `/`, `{` or `}`), the plan
        also holds `identity_policies` (the identity's limits, same forms; None: it has
        none), named `IDENTITY_POLICY_PREFIX` + name in decisions. Their counters are named
        by the identity, so every key of the identity charges the same ones, and `charge`
        admits a request only if the key's policies and the identity's all admit it.

        On a Redis Cluster one script must see all of them, so they are all in the
        identity's slot: the key's own counters carry the identity's hash tag
        (`{i:<identity>}`) instead of the key's. So on a Cluster, a key moved to another
        identity (or into or out of one) starts its own windows afresh; elsewhere its
        counters keep their names.
        """
        if policies.__class__ is list:
            policies = tuple(policies)  # hashable, as the plans are cached by it
        if identity is None:
            return self._plans.get((key_id, policies)) or self._plan_set(key_id, policies)
        if identity_policies.__class__ is list:
            identity_policies = tuple(identity_policies)
        return self._plans.get(
            (key_id, policies, identity, identity_policies)
        ) or self._identity_plan_set(key_id, policies, identity, identity_policies)

    def charge(self, plan: Plan, cost: int = 1) -> Charge | Awaitable[Charge]:
        """Charge one request of `cost` units to every policy of `plan` (`plan(key_id,
        limit)`), or to none: admitted only if every policy has `cost` units left.

        The `Charge` (each policy's remaining and reset, flat; see `Charge`) when this
        process decides alone: always with the in-process limiter, and on Redis while it
        holds enough units of the key's windows (or knows one is used up). Otherwise an
        awaitable that asks the server and answers the `Charge`; nothing is charged until
        it is awaited, and it must be. The request path calls this, without an await for
        most requests; `hit_policies` and `hit` answer the same as a `PolicyDecision`. A
        test double that fails or refuses overrides this one method.
        """
        local = self._local
        if local is None:
            leases = self._leases
            if leases is None:
                return self._charge_storage(plan, cost)
            charged = leases.spend(plan, cost)
            return charged if charged is not None else leases.charge(plan, cost, self._crossed)
        if len(plan) != 1:
            crossed = self._crossed if self.on_threshold is not None else None
            return count_many(local, plan, cost, crossed)
        # One policy in this process's windows: the request path of nearly every request,
        # written out (FixedWindowMemoryStorage.count's count, and the answer).
        counter, amount, window, _ = plan[0]
        now = time.time()
        counts, ends = local.storage, local.expirations
        end = ends.get(counter, 0.0)
        if end > now:
            count = counts[counter] + cost
        else:
            count = cost
            end = ends[counter] = now + window
            local.sweep_due(now)
        # In-process, the window's end is known exactly: no second look-up, no rounding.
        reset_after = math.ceil(end - now)
        if reset_after < 1:
            reset_after = 1
        if count <= amount:
            counts[counter] = count
            # Observed, only a charge from 80 % (the lowest of THRESHOLDS) of the window can
            # reach a mark: every other request pays this comparison alone.
            if self.on_threshold is not None and amount * 4 <= count * 5:
                self._crossed(counter, count - cost, count, amount, window, end, now)
            return amount - count, reset_after
        counts[counter] = count = count - cost  # a refused request is charged nothing
        return ~(amount - count if count < amount else 0), reset_after

    async def hit(self, key_id: str, limit: str | None = None) -> RateDecision:
        """Charge one request of `key_id` to `limit` (or the default) and decide.

        For a key with one policy; a key with several is checked with `hit_policies`
        (`hit` raises `InvalidKeyParameters` for it).
        """
        plan = self.plan(key_id, limit)
        if len(plan) != 1:
            raise InvalidKeyParameters(
                f"rate limit {limit or self.default!r} has {len(plan)} policies: "
                "check it with RateLimiter.hit_policies"
            )
        charged = self.charge(plan)
        if not isinstance(charged, tuple):
            charged = await charged
        _, allowed, amount, window, remaining, reset_after = decision(plan, charged).policies[0]
        return RateDecision(allowed, amount, window, remaining, reset_after)

    async def hit_policies(
        self,
        key_id: str,
        policies: str | Sequence[Policy] | None = None,
        *,
        identity: str | None = None,
        identity_policies: str | Sequence[Policy] | None = None,
        cost: int = 1,
    ) -> PolicyDecision:
        """Check and charge one request of `key_id` against every one of its policies.

        `policies` is a key's `rate_limit` text (None: the default) or `Policy` items, and
        `identity` and `identity_policies` those of the identity the key belongs to (see
        `plan`). The request is admitted only if every policy admits it, and then charged
        `cost` units of each; a refused request is charged to none.
        """
        plan = self.plan(key_id, policies, identity=identity, identity_policies=identity_policies)
        charged = self.charge(plan, cost)
        if not isinstance(charged, tuple):
            charged = await charged
        return decision(plan, charged)

    async def refund(
        self,
        key_id: str,
        policies: str | Sequence[Policy] | None = None,
        cost: int = 1,
        *,
        identity: str | None = None,
        identity_policies: str | Sequence[Policy] | None = None,
    ) -> None:
        """Give back the `cost` units of each policy that an admitted request of `key_id`
        was charged.

        For a request the limits admitted but that is refused for another reason (say, no
        credits left). Call it while handling that request, with the `rate_limit` it was
        checked with: the units go back to the current window of each policy, and nothing
        once that window has ended. With Redis, they return to this process's slice of the
        window (no round trip). A key of an identity gives back to the identity's policies
        too (`identity`, `identity_policies`: as the request was charged).
        """
        plan = self.plan(key_id, policies, identity=identity, identity_policies=identity_policies)
        if self._local is not None:
            refund_here(self._local, plan, cost)
            return
        if self._leases is not None:
            self._leases.refund(plan, cost)
            return
        for counter, _, window, _ in plan:
            try:
                if await self.storage.get(counter) > 0:
                    await self.storage.incr(counter, window, -cost)
            except (StorageError, OSError) as exc:
                raise LimiterUnavailable(exc) from exc

    async def _charge_storage(self, plan: Plan, cost: int) -> Charge:
        """`charge` on another `limits` storage: checked, then charged, and a charge that
        overshot (another request got in between) taken back."""
        used, admit = await self._take(plan, cost)
        now = time.monotonic()
        at = time.time()
        charged: list[int] = []
        for (counter, amount, window, _), count in zip(plan, used, strict=True):
            if count <= 0 or (admit and count == cost):
                end = now + window
                if admit:
                    self._remember(counter, end)
            else:
                end = self._window_ends.get(counter, 0.0)
                if end <= now:
                    end = await self._fetch_window_end(counter, now)
            if admit and self.on_threshold is not None:
                self._crossed(counter, count - cost, count, amount, window, at + end - now, at)
            left = amount - count if count < amount else 0
            allowed = count <= amount if admit else count + cost <= amount
            charged += (left if allowed else ~left, seconds(end - now))
        return tuple(charged)

    async def _take(self, plan: Plan, cost: int) -> tuple[list[int], bool]:
        """`cost` units of every policy of `plan` taken from the storage, or none: each
        window's count after, and whether they were taken."""
        storage = self.storage
        try:
            used = [await storage.get(counter) for counter, *_ in plan]
            admit = all(count + cost <= policy[1] for count, policy in zip(used, plan, strict=True))
            if admit:
                used = [await storage.incr(counter, window, cost) for counter, _, window, _ in plan]
                if not all(count <= policy[1] for count, policy in zip(used, plan, strict=True)):
                    for counter, _, window, _ in plan:
                        await storage.incr(counter, window, -cost)
                    used, admit = [count - cost for count in used], False
        except (StorageError, OSError) as exc:
            raise LimiterUnavailable(exc) from exc
        return used, admit

    def _policy_plan(self, owner: str, policy: Policy, tag: str | None) -> PolicyPlan:
        """The counter of `owner`'s (a key id, or `i:<identity>`) `policy`, with the Cluster
        hash tag `tag` (None: none; the owner's own: `{owner}`; else `{tag}owner`)."""
        amount, window = policy.item.amount, policy.item.get_expiry()
        # A counter is named by its window, not its amount: a limit changed to another
        # amount (10/minute to 5/minute) keeps counting what its window has already used.
        key = owner if tag is None else f"{{{tag}}}" if tag == owner else f"{{{tag}}}{owner}"
        counter = f"{self._key_prefix}/{key}/{window}"
        if policy.name != DEFAULT_POLICY:
            counter = f"{self._key_prefix}/{key}/{policy.name}/{window}"
        return counter, amount, window, policy.name

    def _counter_owner(self, counter: str) -> tuple[str, str, str | None] | None:
        """`(key id, policy name, None)` of a key's counter `_policy_plan` named, or `("",
        policy name, identity)` of an identity's, read back from the name (a policy name
        holds no `/`, nor does a key id apikeys makes, nor an identity): no map to fill on
        the request path, and none to lose when a cache of plans is cleared."""
        head = self._key_prefix + "/"
        if not counter.startswith(head):
            return None
        parts = counter[len(head) :].split("/")
        if len(parts) == 2:
            owner, name = parts[0], DEFAULT_POLICY
        elif len(parts) == 3:
            owner, name = parts[0], parts[1]
        else:
            return None
        if self._tag and owner.startswith("{"):
            tag, _, rest = owner[1:].partition("}")
            owner = rest or tag  # `{i:<identity>}key id` is a key's counter in its identity's slot
        if owner.startswith("i:"):
            return "", name, owner[2:]
        return owner, name, None

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
            key_id, name, identity = owner
            crossing = ThresholdCrossing(
                key_id, name, threshold, after, amount, window, window_end, at, identity
            )
            try:
                observer(crossing)
            except Exception as exc:
                # The request goes on whatever the observer does.
                logger.warning(
                    "apikeys: the rate limit threshold observer failed: %s", type(exc).__name__
                )

    def _parsed(self, policies: str | Sequence[Policy] | None) -> tuple[tuple[Policy, ...], object]:
        """The `Policy` items of `policies` (as `plan` takes them), and what caches them."""
        if policies is None or isinstance(policies, str):
            return self.policies(policies), policies
        parsed = tuple(policies)
        if not parsed or not all(isinstance(policy, Policy) for policy in parsed):
            raise InvalidKeyParameters("policies must be rate limit text or Policy items")
        if len({policy.name for policy in parsed}) != len(parsed):
            raise InvalidKeyParameters("policy names must be unique")
        return parsed, parsed

    def _plan_set(self, key_id: str, policies: str | Sequence[Policy] | None) -> Plan:
        _check_key_id(key_id)
        parsed, cache_key = self._parsed(policies)
        tag = key_id if self._tag else None
        plans = tuple(self._policy_plan(key_id, policy, tag) for policy in parsed)
        return remember(self._plans, (key_id, cache_key), plans, 100_000)

    def _identity_plan_set(
        self,
        key_id: str,
        policies: str | Sequence[Policy] | None,
        identity: str,
        identity_policies: str | Sequence[Policy] | None,
    ) -> Plan:
        if not isinstance(identity, str) or not identity or not identity.isprintable():
            raise InvalidKeyParameters("an identity must be a non-empty printable text")
        if "/" in identity or "{" in identity or "}" in identity:
            raise InvalidKeyParameters("an identity must not hold '/', '{' or '}'")
        _check_key_id(key_id)
        parsed, key_cache = self._parsed(policies)
        owner = "i:" + identity
        tag = owner if self._tag else None
        plans = [self._policy_plan(key_id, policy, tag) for policy in parsed]
        identity_cache: object = identity_policies  # None, "" or (): the identity has none
        if identity_policies:
            shared, identity_cache = self._parsed(identity_policies)
            for policy in shared:
                counter, amount, window, name = self._policy_plan(owner, policy, tag)
                plans.append((counter, amount, window, IDENTITY_POLICY_PREFIX + name))
        cache_key = (key_id, key_cache, identity, identity_cache)
        return remember(self._plans, cache_key, tuple(plans), 100_000)

    # -- several policies ------------------------------------------------------------------

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
        if self._leases is not None:
            self._leases.slices.clear()
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
