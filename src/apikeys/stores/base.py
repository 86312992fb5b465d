"""The `KeyStore` interface every backend implements, and the URL registry.

A store keeps `StoredKey`s (a `KeyRecord` and the hash of its secret) and answers the one
question of the hot path, `get(key_id)` (asked as `get_for_verification`), in a single
round trip. Everything that decides
validity lives in `KeyManager`; a store only keeps state and changes it atomically.

Every method that talks to a server turns connection failures and timeouts into
`StoreUnavailable(original)`, so that the middleware can fail closed with 503.
"""

from __future__ import annotations

import abc
import builtins
import importlib
from collections.abc import Collection, Iterable, Mapping
from datetime import date, datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal
from urllib.parse import urlsplit

from apikeys.errors import ConfigurationError
from apikeys.listing import KeyFilter, Position, after
from apikeys.types import AuditEvent, DailyUsage, KeyRecord, StoredKey, StoredState, UsageDelta

if TYPE_CHECKING:
    from apikeys.channels.base import Channel
    from apikeys.webhooks.base import WebhookStore

__all__ = [
    "ADMITTED",
    "LEGACY_SCHEME",
    "MAX_ROLL_HOPS",
    "USAGE_BATCH_RETENTION",
    "KeyStore",
    "days_of",
    "register_store",
    "select_events",
    "store_from_url",
]

USAGE_BATCH_RETENTION: Final = timedelta(hours=24)
"""How long a store remembers the id of a usage batch it applied (see `KeyStore.add_usage`).

A batch sent again within this window is recognised and skipped; one sent again later would
be applied a second time. `UsageBuffer` retries a batch within seconds or minutes, so the
window only has to outlast the longest outage a process rides out without restarting.
"""

MAX_ROLL_HOPS: Final = 32
"""How many `replaced_by` links a spend follows to the key that holds a rolled pair's
balance; a longer chain is refused (nothing taken), never followed without end."""


class KeyStore(abc.ABC):
    """Where keys live. Implementations: memory, SQL (SQLite, PostgreSQL) and Redis.

    Guarantees every implementation gives:

    - *Read your writes, everywhere.* Once a write method returns, every later `get` in any
      process sharing the store sees it. A store may not serve `get` from a cache that a
      write elsewhere could leave stale.
    - *Atomic changes.* `set_state`, `shorten_expiry`, `replace_hash` and `add_usage` are
      each atomic: concurrent callers, in any process, never lose or interleave updates.
    - *Idempotent usage batches.* `add_usage` applies each `batch_id` at most once (for
      `USAGE_BATCH_RETENTION`), so a batch whose outcome is unknown can be retried safely.
    - *Fail closed.* Connection errors and timeouts raise `StoreUnavailable`.
    - *Notices with changes.* A store with an invalidation channel (`channel()`) publishes
      the `notice` its change methods are given in the same transaction as the change, so
      that processes caching keys hear of every change that commits (see `apikeys.cache`).
    """

    schemes: ClassVar[tuple[str, ...]] = ()
    """URL schemes this store serves, e.g. `("redis", "rediss")`."""

    @property
    def usage_per_key(self) -> bool:
        """True when `add_usage` applies each key's share of a batch on its own, and skips
        it again by batch id and key id, rather than the whole batch at once: a batch that
        failed may then be sent again split by key, under its id, so that one key that
        cannot be written holds no other key's counts (a Redis Cluster, one slot per key).
        False by default: a batch is sent again only whole."""
        return False

    @classmethod
    @abc.abstractmethod
    def from_url(cls, url: str, **options: Any) -> KeyStore:
        """Build the store from a URL with one of `schemes`."""

    def channel(self) -> Channel | None:
        """The store's own invalidation channel, for `KeyCache`; None when it has none.

        Stores shared between processes return one (the memory store, which lives in one
        process, needs none); `KeyManager` then caches records in process.
        """
        return None

    def webhooks(self) -> WebhookStore | None:
        """Where this store keeps webhook endpoints and deliveries; None when it keeps none
        (then no webhook is sent: the default, so a store of your own works unchanged)."""
        return None

    async def setup(self) -> None:  # noqa: B027 - optional hook with a sensible default
        """Prepare the backend (create tables, load scripts). Idempotent; may be skipped."""

    async def claim_setting(
        self, name: str, value: str, *, replacing: Collection[str] = ()
    ) -> str | None:
        """Record `value` under `name` unless another value is recorded (a recorded value in
        `replacing` is replaced); return the value recorded afterwards, atomically.

        `KeyManager` records the fingerprint of its pepper this way (never the pepper). None
        means the store keeps no settings, and the caller skips its check: the default, so
        a store of your own works unchanged.
        """
        return None

    async def put_once(self, token: str, value: str, ttl: timedelta) -> None:
        """Keep `value` under `token` for `ttl`, for `take_once` to take, once.

        A small shared place for short-lived single-use values that every process of the
        store can reach, such as the settings page's sealed new keys (`apikeys.ui`), which
        must be shown once in whichever process serves the page. `token` is a fresh random
        string of at most 64 ASCII characters, never reused; `value` is ASCII text of at most
        a few kilobytes. A store keeps values no longer than needed: an expired value may be
        dropped at any time, and is never returned.

        The default raises `NotImplementedError`: a store of your own works unchanged
        unless something asks it for one-time values.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no one-time values")

    async def take_once(self, token: str) -> str | None:
        """The value `put_once` kept under `token`, removed in the same atomic step; None if
        there is none (never put, already taken, or its `ttl` has passed).

        At most once, everywhere: of any number of calls with one token, concurrent or not,
        in any process sharing the store, at most one gets the value.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no one-time values")

    def keeps_one_time_values(self) -> bool:
        """Whether this store implements `put_once` and `take_once`."""
        cls = type(self)
        return cls.put_once is not KeyStore.put_once and cls.take_once is not KeyStore.take_once

    @abc.abstractmethod
    async def insert(self, stored: StoredKey, *, event: AuditEvent | None = None) -> None:
        """Add a new key. Raise `DuplicateKeyId` if the id exists (the caller retries).

        Every method that changes a key takes an `event`, appended to the audit trail in
        the same transaction (or script) as the change, and only if the change happened:
        a change without its event, or an event without its change, cannot exist.
        """

    @abc.abstractmethod
    async def get(self, key_id: str) -> StoredKey | None:
        """The key with this id, or None, in one round trip. Verification reads through
        `get_for_verification`, which is this unless a store says otherwise."""

    def get_for_verification_now(self, key_id: str) -> StoredKey | Literal[False] | None:
        """`get_for_verification` without awaiting, for a store that keeps its keys in the
        process; False from a store that must be awaited (every store but the memory one),
        and then `KeyManager.verify` awaits `get_for_verification`."""
        return False

    async def get_to_cache(self, key_id: str) -> tuple[StoredKey | None, bool]:
        """`get`, for a process's key cache (`apikeys.cache`): the key (or None), and whether
        the cache may keep it.

        False for a key the store will change by itself later, without a change that its
        channel announces (the Redis store: a hash given a TTL by hand). The default is
        `get`'s answer, to keep.
        """
        return await self.get(key_id), True

    async def get_for_verification(self, key_id: str) -> StoredKey | None:
        """`get`, for `KeyManager.verify`: the same key, except that its record's `credits`
        and `credits_refilled_at` may be older than the count `spend_credits` keeps.

        Verification only asks whether a key has credits; spending reads and takes the count
        in one atomic step of its own. A store that keeps the count apart from the record
        (the memory store) answers without folding it in; the default is `get`. Everything
        else, state, scopes, expiry, limits and hash, must be exactly what `get` returns.
        """
        return await self.get(key_id)

    @abc.abstractmethod
    async def list(self, workspace: str | None = None) -> list[KeyRecord]:
        """The records of one workspace (or all), oldest first (by `created_at`, then id)."""

    async def list_page(
        self, where: KeyFilter, *, start: Position | None, limit: int, now: datetime
    ) -> builtins.list[KeyRecord]:
        """Up to `limit` records that match `where` and sort after `start`, in the order of
        `list` (by `created_at`, then id); `expired` is decided at `now`.

        What a walk through the pages guarantees follows from that order (see
        `apikeys.listing`). The default reads `list` and keeps what matches: right for any
        store, and the memory store's way; the SQL and Redis stores read only about a page.
        """
        records = await self.list(where.workspace)
        return [r for r in records if after(r, start) and where.matches(r, now)][:limit]

    @abc.abstractmethod
    async def set_state(
        self,
        key_id: str,
        state: StoredState,
        *,
        allowed_from: Collection[StoredState],
        at: datetime,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        """Atomically move a key to `state` if its current state is in `allowed_from`.

        A key already in `state` is left as it is. Moving to `revoked` sets `revoked_at` to
        `at`. Returns the record as it is afterwards: the caller compares its `state` with
        the one it asked for to learn whether the change was allowed. Raises `KeyNotFound`.
        A `notice` is published with the change (also when nothing changed).
        """

    @abc.abstractmethod
    async def shorten_expiry(
        self,
        key_id: str,
        expires_at: datetime,
        *,
        replaced_by: str | None = None,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        """Atomically set `expires_at` to the earlier of its value and `expires_at`, and
        `replaced_by` when given (`roll` links the old key to the new one). With
        `replaced_by`, a key that another key replaces already is left unchanged: of two
        rolls at once, the first to link the key wins, and the other sees the winner's id in
        the record returned.

        From the moment `replaced_by` is set, `spend_credits` of this key takes from the
        successor's balance; the record returned holds the old key's last `credits`, which
        `roll` gives to the successor.

        A revoked key is left unchanged. Returns the record afterwards; raises `KeyNotFound`.
        A `notice` is published with the change.
        """

    @abc.abstractmethod
    async def update(
        self,
        key_id: str,
        changes: Mapping[str, Any],
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        """Atomically set the record's fields in `changes`, unless the key is revoked.

        `changes` maps some of `name`, `access`, `scopes`, `rate_limit` and `expires_at` to
        new values (None clears `rate_limit` or `expires_at`). A revoked key is left as it
        is. Returns the record afterwards (the caller checks its state); raises
        `KeyNotFound`. A `notice` is published with the change.
        """

    @abc.abstractmethod
    async def audit(
        self,
        *,
        workspace: str | None = None,
        key_id: str | None = None,
        since: datetime | None = None,
        limit: int = 1000,
    ) -> builtins.list[AuditEvent]:
        """The newest `limit` audit events that match, oldest first."""

    @abc.abstractmethod
    async def usage_history(self, key_id: str, since: date) -> builtins.list[DailyUsage]:
        """The key's requests per UTC day from `since` on, as the usage batches added them:
        only days with requests, oldest first."""

    @abc.abstractmethod
    async def spend_credits(
        self, key_id: str, cost: int, *, refill: tuple[int, datetime] | None = None
    ) -> int | None:
        """Atomically take `cost` of the key's credits; return how many are left, or None
        (nothing taken) when fewer than `cost` are left, the key has no credits (unlimited),
        is revoked, or does not exist.

        One balance per rolled pair: a key whose `replaced_by` is set spends from its
        successor's balance (following `replaced_by` to the newest key, at most
        `MAX_ROLL_HOPS` links), never from its own `credits`, which `roll` moved to the
        successor. Following a link and taking the credits are one atomic step with respect
        to `shorten_expiry` setting the link: a spend that races a roll is taken either from
        the old key before the roll read its balance, or from the successor. Only the state
        of `key_id` itself is checked: a revoked successor still lends its balance to the
        key it replaces.

        `refill` is `(amount, period_start)`: when the key's credits were last refilled
        before `period_start` (or never), they are first set back to `amount`, and the
        refill noted as of `period_start`, in the same atomic step.
        """

    @abc.abstractmethod
    async def replace_hash(
        self,
        key_id: str,
        old_hash: str,
        new_hash: str,
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> bool:
        """Swap the stored hash if it still equals `old_hash` (compare and set).

        A `notice` is published with the change.
        """

    @abc.abstractmethod
    async def add_usage(self, usage: Mapping[str, UsageDelta], *, batch_id: str) -> None:
        """Add request counts and raise `last_used_at`, atomically for the whole batch.

        Counts are added with atomic increments (never read-modify-write), `last_used_at`
        only moves forward, and unknown ids are ignored.

        Exactly once: `batch_id` (a random id the caller draws once per batch, e.g. a uuid4
        hex) names the batch. Applying a batch is idempotent: once a batch with this id has
        been applied, sending it again has no further effect, for at least
        `USAGE_BATCH_RETENTION` (24 hours) after it was applied, including when the two
        sends run at the same time. Recording the id is part of the same atomic change as
        the increments: the batch is applied whole, with its id, or not at all.

        So a caller that does not know whether a batch was applied (it raised, say a
        timeout or a connection lost before the answer, or the call was cancelled) sends
        the very same batch again, with the same id and the same counts, and the store
        applies it only if it had not. A batch with no non-zero count applies nothing and
        need not record its id.
        """

    async def aclose(self) -> None:  # noqa: B027 - optional hook with a sensible default
        """Release connections. The store is not used afterwards."""


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


def days_of(rows: Iterable[tuple[str, str, int]]) -> list[DailyUsage]:
    """`DailyUsage` per day from `(day "YYYY-MM-DD", outcome, count)` rows, oldest first."""
    by_day: dict[str, dict[str, int]] = {}
    for day, outcome, count in rows:
        outcomes = by_day.setdefault(day, {})
        outcomes[outcome] = outcomes.get(outcome, 0) + count
    return [
        DailyUsage(
            day=date.fromisoformat(day),
            admitted=outcomes.pop(ADMITTED, 0),
            legacy_scheme=outcomes.pop(LEGACY_SCHEME, 0),
            refused=dict(sorted(outcomes.items())),
        )
        for day, outcomes in sorted(by_day.items())
    ]


def select_events(
    events: Iterable[AuditEvent],
    *,
    workspace: str | None,
    key_id: str | None,
    since: datetime | None,
    limit: int,
) -> list[AuditEvent]:
    """The newest `limit` of `events` (oldest first) that match: `audit` of a store that
    keeps its events in order and filters them itself."""
    found = [
        event
        for event in events
        if (workspace is None or event.workspace == workspace)
        and (key_id is None or event.key_id == key_id)
        and (since is None or event.time >= since)
    ]
    return found[-limit:] if limit > 0 else []


ADMITTED = "admitted"
"""The outcome of a request that reached the application."""
LEGACY_SCHEME = "legacy_scheme"
"""Counted besides a request's outcome: the key was sent under a legacy scheme (`Api-Key`)."""


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
