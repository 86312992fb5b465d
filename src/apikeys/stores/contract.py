"""The contract every backend implements: `KeyStore`, `IdentityStore`, `WebhookStore` and
`Channel`.

A backend is one folder (`apikeys.stores.memory`, `.sql`, `.redis`) holding its key store,
its webhook store, its change channel and its scripts; this module is all they share with
the rest of apikeys.

A store keeps `StoredKey`s (a `KeyRecord` and the hash of its secret) and answers the one
question of the hot path, `get(key_id)` (asked as `get_for_verification`), in a single
round trip. Everything that decides validity lives in `KeyManager`; a store only keeps
state and changes it atomically.

Every method that talks to a server turns connection failures and timeouts into
`StoreUnavailable(original)`, so that the middleware can fail closed with 503.

A change channel carries *notices* (short strings naming a changed key) from the process
that changed a key to every process that may hold it in its cache, and carries
acknowledgements back. The protocol that makes this safe (leases, proofs of freshness,
waiting for acknowledgements) lives in `apikeys.cache`; docs/consistency.md explains it. A
channel promises:

- *Probes read the store.* `probe()` returns only after every change committed to the store
  before `probe()` was called, by any writer, has reached `on_notice`: it reads a log the
  store keeps itself (the SQL store's triggers) or the server's own invalidations (Redis
  client-side caching), not merely the notices apikeys writers published. That is what
  turns a probe into a proof of freshness; notices only make a change known sooner.
- *A registry of readers.* `register(ttl)` keeps this process in the list of readers for
  `ttl` seconds of the server's clock; `delivered()` asks for the acknowledgement of every
  reader registered at the time it is called, after the notice was published.
- *Failures are loud.* Any broken connection or timeout raises; the cache then stops
  trusting itself and reads the store.
"""

from __future__ import annotations

import abc
import asyncio
import builtins
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import date, datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, NamedTuple

from apikeys.listing import DeliveryPosition, KeyFilter, Position, after
from apikeys.types import AuditEvent, DailyUsage, KeyRecord, StoredKey, StoredState, UsageDelta

if TYPE_CHECKING:
    from apikeys.identities import IdentityRecord
    from apikeys.webhooks.model import Claimed, Delivery, DeliveryStatus, Endpoint, Timed

__all__ = [
    "ALL_KEYS_NOTICE",
    "MAX_ROLL_HOPS",
    "STORE_WRITER",
    "USAGE_BATCH_RETENTION",
    "Channel",
    "ChannelError",
    "CreditSpend",
    "IdentityStore",
    "KeyStore",
    "WebhookStore",
    "parse_notice",
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
    - *Atomic changes.* `insert`, `set_state`, `shorten_expiry`, `update`, `spend_credits`,
      `replace_hash` and `add_usage` are each atomic: concurrent callers, in any process,
      never lose or interleave updates.
    - *Idempotent usage batches.* `add_usage` applies each `batch_id` at most once (for
      `USAGE_BATCH_RETENTION`), so a batch whose outcome is unknown can be retried safely.
    - *Fail closed.* Connection errors and timeouts raise `StoreUnavailable`. A change
      committed whose replication was not confirmed in time raises `ChangeNotConfirmed`
      (a `StoreUnavailable`; the Redis store's `WAIT`): the change holds on the primary,
      and a failover before the replicas catch up could lose it.
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

    def identities(self) -> IdentityStore | None:
        """Where this store keeps identities (`apikeys.identities`), beside its keys and in
        the same transactions' reach; None when it keeps none (the default, so a store of
        your own works unchanged; `KeyManager`'s identity calls then raise
        `ConfigurationError`)."""
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
        must be shown once in whichever process serves the page, and the management API's
        `Idempotency-Key` answers. `token` is at most 64 ASCII characters: a fresh random
        string, or a name drawn from what a value is for; a value put again under a token
        replaces the one kept there. `value` is ASCII text of at most a few kilobytes. A
        store keeps values no longer than needed: an expired value may be dropped at any
        time, and is never returned.

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

    async def peek_once(self, token: str) -> str | None:
        """The value kept under `token`, left there; None if there is none (never put,
        taken, or its `ttl` has passed). It is a value some put or replace kept whole."""
        raise NotImplementedError(f"{type(self).__name__} keeps no one-time values")

    async def put_once_if_absent(self, token: str, value: str, ttl: timedelta) -> bool:
        """Keep `value` under `token` for `ttl` (positive) if no value is kept there (an
        expired one counts as none), in one atomic step; whether it was kept.

        One winner, everywhere: of any number of concurrent calls with one token, in any
        process sharing the store, at most one returns True (exactly one if no value lived
        there); the others return False and change nothing. The management API marks a
        request with an `Idempotency-Key` as running this way, so that only one runs.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no one-time values")

    async def replace_once(self, token: str, old: str, new: str | None, ttl: timedelta) -> bool:
        """Replace the value under `token` by `new`, kept for `ttl` (positive; with `new`
        None, remove it), if it is `old` and has not expired, in one atomic step (compare
        and set); whether it was replaced. Of concurrent calls that find `old`, at most one
        replaces it; a value put since is never replaced nor removed.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no one-time values")

    def keeps_one_time_values(self) -> bool:
        """Whether this store implements `put_once` and `take_once`."""
        cls = type(self)
        return cls.put_once is not KeyStore.put_once and cls.take_once is not KeyStore.take_once

    def compares_one_time_values(self) -> bool:
        """Whether this store implements `peek_once`, `put_once_if_absent` and
        `replace_once` too, as the management API's `Idempotency-Key` needs."""
        cls, names = type(self), ("peek_once", "put_once_if_absent", "replace_once")
        own = all(getattr(cls, name) is not getattr(KeyStore, name) for name in names)
        return own and self.keeps_one_time_values()

    @abc.abstractmethod
    async def insert(self, stored: StoredKey, *, event: AuditEvent | None = None) -> None:
        """Add a new key, its record as given. Raise `DuplicateKeyId` if the id exists.

        `KeyManager` inserts the active keys `create` and `roll` make, under a random id (on
        `DuplicateKeyId` it draws another); `apikeys.importing` inserts imported keys, under
        an id derived from the old key (on `DuplicateKeyId` it counts the key as imported by
        a concurrent run), with their source's `created_at` and `expires_at`, revoked when
        the source revoked them, and their source's hash behind `IMPORTED`.

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

        `KeyManager` sends `disabled` from `active` (disable), `active` from `disabled`
        (enable), and `revoked` from `active` or `disabled` (revoke, and a roll's new key
        when the roll lost a race), with `at` the time of the change's event.

        A key already in `state` is left as it is (and its `event` not recorded). Moving to
        `revoked` sets `revoked_at` to `at`. Returns the record as it is afterwards: the
        caller compares its `state` with the one it asked for to learn whether the change
        was allowed. Raises `KeyNotFound`. A `notice` is published with the change (also
        when nothing changed).
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

        `changes` maps some of these fields to their new values, as `KeyRecord` holds them:
        `name`; `access` with `scopes` (always together; a full-access key's scopes are
        `()`); `rate_limit` (None: the middleware's default); `expires_at` (None: never);
        `owner` (None clears it); `metadata` (`{}` clears it); `allowed_ips` (`()`: any
        address); `credits` (None: unlimited); `credit_refill` (None clears it); and
        `credits_refilled_at`. `KeyManager.update` sends any of the eleven (with
        `credit_refill`, also `credits` and `credits_refilled_at`: the new refill starts
        now); a roll sends the new key `credits` and `credits_refilled_at`, and a rolled
        key's predecessors `credits` and `credit_refill` (they spend the same balance).

        `credits` is the balance `spend_credits` counts down from then on. A revoked key is
        left as it is. Returns the record afterwards (the caller checks its state); raises
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
        """Swap the stored hash for `new_hash` if it still equals `old_hash` (compare and
        set); True when swapped, False when the key is gone or its hash changed meanwhile.

        `KeyManager` calls it after a request verified a secret against a hash it replaces
        (made with a retired pepper, without a pepper, with a deprecated scheme, or an
        imported key's foreign hash): `new_hash` is the hash of the same secret as the
        `Hasher` makes it now. The `event` (`rehashed`) is recorded, and the `notice`
        published, with the swap.
        """

    @abc.abstractmethod
    async def add_usage(self, usage: Mapping[str, UsageDelta], *, batch_id: str) -> None:
        """Add each key's counts, atomically for the whole batch (for each key's share
        where `usage_per_key`).

        `usage` maps key ids to what `UsageBuffer` counted since its last flush: `count` is
        added to `request_count`, `last_used_at` raises the record's (it only moves
        forward), and `daily` (`{(UTC day, outcome): requests}`) is added to the per-day
        history that `usage_history` reads. Counts are added with atomic increments (never
        read-modify-write), and unknown ids are ignored.

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


class IdentityStore(abc.ABC):
    """The identity side of a store: `IdentityRecord`s by id, and their changes.

    The guarantees of `KeyStore` hold here as well: a write is seen by every later `get` in
    every process; each change is atomic, with its audit event (an `identity.*` action,
    `key_id` `i:<id>`, kept in the store's one audit trail, so `KeyStore.audit` returns it)
    written in the same transaction or script, and only when the change happened; and a
    store with a channel publishes the change's `notice` with it. Whoever writes: a plain
    SQL `UPDATE` of an identity's row, or any client's write to its Redis hash, reaches the
    channel too, as the notice `…:i:<id>`, as for keys. Failures raise `StoreUnavailable`.
    """

    @abc.abstractmethod
    async def insert(self, record: IdentityRecord, *, event: AuditEvent | None = None) -> None:
        """Add a new identity, its record as given; `DuplicateIdentity` if the id exists
        (in any workspace: ids are the store's, not a workspace's)."""

    @abc.abstractmethod
    async def get(self, identity_id: str) -> IdentityRecord | None:
        """The identity with this id, or None, in one round trip."""

    def get_now(self, identity_id: str) -> IdentityRecord | Literal[False] | None:
        """`get` without awaiting, for a store that keeps its identities in the process;
        False from a store that must be awaited (every store but the memory one), as
        `KeyStore.get_for_verification_now`."""
        return False

    async def get_to_cache(self, identity_id: str) -> tuple[IdentityRecord | None, bool]:
        """`get`, for a process's cache (under the name `i:<id>`): the identity (or None),
        and whether the cache may keep it (as `KeyStore.get_to_cache`)."""
        return await self.get(identity_id), True

    @abc.abstractmethod
    async def list(self, workspace: str | None = None) -> builtins.list[IdentityRecord]:
        """The identities of one workspace (or all), oldest first (by `created_at`, then id)."""

    async def list_page(
        self, workspace: str | None, *, start: Position | None, limit: int
    ) -> builtins.list[IdentityRecord]:
        """Up to `limit` identities of `workspace` (or all) that sort after `start`, in the
        order of `list` (a cursor's `Position`, as for keys). The default reads `list`."""
        records = await self.list(workspace)
        return [r for r in records if after(r, start)][:limit]

    @abc.abstractmethod
    async def update(
        self,
        identity_id: str,
        changes: Mapping[str, Any],
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> IdentityRecord:
        """Atomically set the fields in `changes` (values as `IdentityRecord` holds them:
        `name`, `metadata`, `rate_limit`, `credits`, `credit_refill`, `credits_refilled_at`),
        unless the identity is revoked: then it is left as it is. Returns the record
        afterwards (the caller checks its state); raises `IdentityNotFound`. The `notice`
        is published with the change (also when nothing changed)."""

    @abc.abstractmethod
    async def set_state(
        self,
        identity_id: str,
        state: StoredState,
        *,
        allowed_from: Collection[StoredState],
        at: datetime,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> IdentityRecord:
        """Atomically move an identity to `state` if its current state is in
        `allowed_from`, as `KeyStore.set_state` does for a key (`TRANSITIONS`' `disable`,
        `enable`, `revoke`): `revoked` is final and sets `revoked_at` to `at`; an identity
        already in `state` is left as it is, without its event. Returns the record
        afterwards; raises `IdentityNotFound`. The `notice` is published with the change."""

    async def spend_credits_with_key(
        self,
        identity_id: str,
        key_id: str | None,
        cost: int,
        *,
        refill: tuple[int, datetime] | None = None,
        key_refill: tuple[int, datetime] | None = None,
    ) -> CreditSpend:
        """Take `cost` of the identity's credits and of the key `key_id`'s (None: the key
        has unlimited credits) in one decision: both, or neither.

        The identity's side is its `credits` (refilled first per `refill`, as a key's);
        an identity without credits (unlimited) is not charged. The key's side is
        `KeyStore.spend_credits` (`key_refill`, rolled pairs, a revoked key refused). The
        answer says what is left of each (None: unlimited or not charged), or which side
        refused (`refused`), and then nothing was taken from either; a refill that came
        due is kept all the same (a new period began).

        Memory: under one step of its event loop. SQL: one transaction over both rows.
        Redis: one script when the key's hash and the identity's share a node (a single
        server, Sentinel); on a Cluster they are in two slots, so the identity is charged
        first, then the key, and the identity refunded when the key refuses: a request
        sent meanwhile may see the identity's balance `cost` lower for that round trip
        (and be refused for it), never higher, so nothing is over-admitted.
        """
        raise NotImplementedError(f"{type(self).__name__} does not spend identity credits")


class CreditSpend(NamedTuple):
    """What `IdentityStore.spend_credits_with_key` did: the credits left of the identity
    and of the key (None: unlimited, not charged), or the side that refused (`identity`
    or `key`; nothing was taken)."""

    identity_left: int | None
    key_left: int | None
    refused: Literal["identity", "key"] | None = None


class WebhookStore(abc.ABC):
    """The webhook side of a store: endpoints, the outbox's hand-over, and leases."""

    @abc.abstractmethod
    async def add_endpoint(self, endpoint: Endpoint) -> None:
        """Store `endpoint`; it is sent the events of changes committed after this. Its
        `secret` arrives sealed (`apikeys.webhooks.admin`) and is kept as given."""

    @abc.abstractmethod
    async def endpoints(self) -> list[Endpoint]:
        """Every endpoint, oldest first."""

    @abc.abstractmethod
    async def remove_endpoint(self, endpoint_id: str) -> bool:
        """Remove the endpoint and its deliveries; False when there was none."""

    @abc.abstractmethod
    async def roll_secret(self, endpoint_id: str, secret: str, overlap_until: datetime) -> bool:
        """Sign with `secret` (sealed, as `add_endpoint`'s) from now on, and with the
        current one too until `overlap_until`; False when there is no such endpoint."""

    async def forget_previous_secrets(self, now: datetime) -> int:
        """Erase the previous secret of each endpoint whose overlap has ended by `now`
        (`previous_until` at or before it): it signs nothing any more, and one stored in
        clear by an earlier version must not stay in the store. Atomic per endpoint, so a
        roll made meanwhile (a new overlap) keeps its previous secret. The number erased.
        None by default (a store of your own works unchanged, keeping them)."""
        return 0

    @abc.abstractmethod
    async def take(self, now: datetime, limit: int = 500) -> int:
        """Hand the events logged since each endpoint's mark to its deliveries, in one
        transaction with moving the mark; the number of deliveries made."""

    @abc.abstractmethod
    async def expiring(self, now: datetime) -> int:
        """Make a `key.expiring` delivery for each key that expires within a notice of
        `EXPIRING_NOTICES`, once per endpoint, key, notice and expiry; the number made.
        `expiring_deliveries` gives a key's."""

    async def usage_thresholds(self, now: datetime) -> int:
        """Make a `key.usage_threshold` delivery for each threshold of `USAGE_THRESHOLDS`
        a key with a credit refill has reached in its current period (`crossed_thresholds`),
        once per endpoint, key, threshold and period; the number made
        (`usage_threshold_deliveries` gives a key's). None by default (a store of your own
        works unchanged)."""
        return 0

    async def make_deliveries(self, deliveries: Sequence[Timed], now: datetime) -> int:
        """Store each of `deliveries` as pending from `now`, in line after what its endpoint
        has been handed, unless a delivery of its `id` is stored already (made again by any
        process, in any round, a delivery is stored once); the number made. Rate limit
        thresholds reach the store this way. None by default (a store of your own works
        unchanged, without them)."""
        return 0

    @abc.abstractmethod
    async def claim(
        self,
        holder: str,
        now: datetime,
        lease_until: datetime,
        limit: int,
        *,
        room: Mapping[str, int] | None = None,
    ) -> list[Claimed]:
        """Lease at most `limit` of the due deliveries that are first in line for their
        endpoint and key, round robin across endpoints (`fair_share`), in that order. With
        `room` (endpoint id to how many more deliveries this caller will send to it now),
        at most that many of each endpoint, and none of an endpoint it does not name: one
        endpoint's backlog or slow receiver never takes another endpoint's turn."""

    @abc.abstractmethod
    async def finish(
        self,
        delivery_id: str,
        holder: str,
        *,
        now: datetime,
        status: DeliveryStatus,
        next_attempt_at: datetime,
        response: int | None,
        error: str | None,
    ) -> None:
        """Record an attempt of a delivery whose lease `holder` holds, and release the lease.

        `status` is `delivered` (a 2xx `response`), `pending` (to be tried again at
        `next_attempt_at`) or `failed` (given up); `error` says why an attempt failed (kept
        to its first 200 characters). Nothing is recorded when `holder` no longer holds the
        lease: it ran out, and another process may be sending the delivery.
        """

    @abc.abstractmethod
    async def deliveries(
        self,
        *,
        status: DeliveryStatus | None = None,
        workspace: str | None = None,
        limit: int = 100,
    ) -> list[Delivery]:
        """The newest deliveries (of `status`, about keys of `workspace`), newest first by
        `Delivery.order`, then id. The work is about `limit` deliveries of that workspace,
        however many others there are (more with `status`: others are read past)."""

    async def deliveries_page(
        self,
        start: DeliveryPosition | None,
        *,
        status: DeliveryStatus | None = None,
        workspace: str | None = None,
        limit: int = 100,
    ) -> builtins.list[Delivery]:
        """Up to `limit` deliveries, in the order of `deliveries`, after `start` (an `(order,
        id)`; None: from the newest): a walk through the pages gets each delivery that stays
        listed once, in order. The default lists the first page with `deliveries` and none
        after it: a store of your own works unchanged, listed one page deep."""
        found = await self.deliveries(status=status, workspace=workspace, limit=limit)
        return found if start is None else []

    @abc.abstractmethod
    async def delivery(self, delivery_id: str) -> Delivery | None:
        """The delivery of that id, or None."""

    async def prune(self, before: datetime, limit: int = 1000) -> int:
        """Delete at most `limit` deliveries that were delivered or failed before `before`
        (their last attempt); never a pending one. The number deleted. Run by every
        deliverer: deleting what another process deleted already is harmless. None by
        default (a store of your own keeps its deliveries)."""
        return 0

    @abc.abstractmethod
    async def replay(self, delivery_id: str, now: datetime) -> bool:
        """Send a delivery again (same id and body): pending from `now`, with `give_up_after`
        of retries anew; False when there is no such delivery.

        Never while a process holds its lease (it is being sent): that raises
        `DeliveryInProgress` and changes nothing, so the holder records its attempt and no
        second process sends the delivery at the same time. A lease that ran out (its
        holder is gone) is cleared."""


STORE_WRITER = "store"
"""The writer named by notices the store makes itself (a trigger, a server invalidation):
they come from no apikeys process, so nobody waits for their acknowledgement."""
ALL_KEYS_NOTICE = f"{STORE_WRITER}:0:*"
"""The notice that every key may have changed (a flushed database, a truncated table)."""


class ChannelError(Exception):
    """The channel cannot be used right now (the cache falls back to the store)."""


def parse_notice(notice: str) -> tuple[str, str]:
    """`(writer id, key id)` of a notice `"<writer>:<sequence>:<key id>"`.

    The key id `*` stands for every key.
    """
    writer, _, rest = notice.partition(":")
    _, _, key_id = rest.partition(":")
    return writer, key_id


class Channel(abc.ABC):
    """The transport of invalidation notices between processes that share a store.

    `native` channels are the store's own (the SQL store's change log with NOTIFY, Redis
    tracking and PUBLISH inside the store's scripts): the store publishes a notice in the same
    transaction as the change, so a change can never be committed without its notice. A
    channel that is not native publishes with `publish()` once the change is committed, which
    can lose a notice: `KeyManager` refuses such a channel (`ConfigurationError`).
    """

    native: bool = True
    poll_interval: float | None = None
    """Seconds between probes when notices only arrive by polling (SQLite); None: lease/4."""

    def __init__(self) -> None:
        self.ident = ""
        # notice -> readers that acknowledged it; made by `expect` before the notice is
        # published, so that an early acknowledgement is not lost.
        self._acks: dict[str, set[str]] = {}
        self._ack_event = asyncio.Event()

    @abc.abstractmethod
    async def connect(self, ident: str, on_notice: Callable[[str], None]) -> None:
        """Open the subscription for the process `ident` (notices and its acknowledgements)."""

    @abc.abstractmethod
    async def probe(self) -> None:
        """Return once every change committed to the store before this call, by any writer
        (not only the notices apikeys processes published), has reached `on_notice`."""

    @abc.abstractmethod
    async def register(self, ttl: float) -> None:
        """List this process as a reader for the next `ttl` seconds."""

    @abc.abstractmethod
    async def readers(self) -> set[str]:
        """The ids of the readers registered now (their registration has not run out)."""

    @abc.abstractmethod
    async def ack(self, notice: str) -> None:
        """Tell the writer of `notice` that this process has dropped the key it names."""

    async def publish(self, notice: str) -> None:
        """Publish `notice` (only for channels that are not `native`)."""
        raise NotImplementedError

    async def disconnect(self) -> None:  # noqa: B027 - nothing to release by default
        """Close the subscription and leave the registry. The channel may connect again."""

    def bind(self) -> None:
        """Make the channel's asyncio primitives on the running loop (before `connect`)."""
        self._ack_event = asyncio.Event()

    # -- acknowledgements, shared by every channel -------------------------------------------

    def expect(self, notice: str) -> None:
        """Start collecting acknowledgements of `notice` (call before publishing it)."""
        self._acks[notice] = set()

    def forget(self, notice: str) -> None:
        self._acks.pop(notice, None)

    def acknowledged(self, notice: str, reader: str) -> None:
        """Record that `reader` acknowledged `notice` (called by the channel's receiver)."""
        seen = self._acks.get(notice)
        if seen is not None:
            seen.add(reader)
            self._ack_event.set()

    async def delivered(self, notice: str) -> None:
        """Return once every registered reader but this process has acknowledged `notice`.

        The caller bounds the wait; a channel that cannot tell raises `ChannelError`.
        """
        waiting = await self.readers()
        waiting.discard(self.ident)
        seen = self._acks.get(notice)
        if seen is None:
            raise ChannelError("acknowledgements of this notice were not expected")
        while True:
            # Cleared before the check, so an acknowledgement between the two still wakes us.
            self._ack_event.clear()
            if waiting <= seen:
                return
            await self._ack_event.wait()
