"""`KeyManager`: create, verify, disable, enable, revoke and roll keys.

The manager is the one place that decides whether a key may be used (`check_usable`) and
the one place that turns a token into a record (`verify`). Stores only keep state.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import logging
import os
import secrets
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, ClassVar, Final, Self, TypeVar

from apikeys.bounded import remember
from apikeys.cache import DEFAULT_CACHE_SIZE, DEFAULT_LEASE, KeyCache
from apikeys.channels.base import Channel
from apikeys.errors import (
    AuthenticationError,
    ChangeNotConfirmed,
    ConfigurationError,
    DuplicateKeyId,
    InvalidAPIKey,
    InvalidKeyParameters,
    InvalidTransition,
    KeyDisabled,
    KeyExpired,
    KeyNotFound,
    KeyRevoked,
    MalformedAPIKey,
    StoreUnavailable,
)
from apikeys.hashing import UNPEPPERED, Hasher
from apikeys.importing.foreign import (
    LOOKUP_SETTING,
    foreign_handles,
    is_foreign_token,
    lookup_ids,
)
from apikeys.keys import (
    CHECKSUM_LENGTH,
    DEFAULT_PREFIX,
    ID_LENGTH,
    SECRET_LENGTH,
    generate_key,
    key_splitter,
    validate_prefix,
)
from apikeys.listing import (
    DEFAULT_PAGE_SIZE,
    KeyFilter,
    KeyPage,
    check_page_size,
    decode_cursor,
    encode_cursor,
    position,
)
from apikeys.policies import check_text, parse_refill, policy_fields
from apikeys.ratelimit import RateLimiter, format_policies, parse_policies
from apikeys.redaction import failure_reason, redact, safe_url
from apikeys.scopes import validate_scopes
from apikeys.stores.base import (
    ADMITTED,
    LEGACY_SCHEME,
    MAX_ROLL_HOPS,
    KeyStore,
    days_of,
    store_from_url,
)
from apikeys.telemetry import EventHook, Telemetry
from apikeys.types import (
    ACTIVE,
    DISABLED,
    REVOKED,
    AuditAction,
    AuditEvent,
    CreatedKey,
    DailyUsage,
    KeyRecord,
    Status,
    StoredKey,
    StoredState,
    jsonable,
    utcnow,
)
from apikeys.usage import UsageBuffer, write_at_exit
from apikeys.webhooks.delivery import Deliverer, DeliveryOptions

__all__ = ["LIMITER_URL_ENV", "STORE_URL_ENV", "KeyManager", "check_usable", "refusal"]

# Where a record's masked prefix ("{key_prefix}_{id}_…") ends its key prefix.
_PREFIX_END = -ID_LENGTH - 3

logger = logging.getLogger("apikeys")

STORE_URL_ENV: Final = "APIKEYS_STORE_URL"
LIMITER_URL_ENV: Final = "APIKEYS_LIMITER_URL"
"""The variable naming the key store, read by `KeyManager()` without a store and by the CLI."""

_INSERT_ATTEMPTS = 5
# Versions of keys whose plain check `verify_now` keeps (see `KeyManager._plain_version`).
_PLAIN_LIMIT: Final = 10_000
_LEGACY_DETAIL = (
    "Only keys imported from the old system are read under this Authorization scheme: "
    "send this key as 'Bearer <key>'."
)
_IMPORT_RECHECK = 1.0  # seconds between asking a store without imported keys again
_T = TypeVar("_T")

# How long interpreter exit may spend writing the counts of managers left unclosed.
_EXIT_TIMEOUT: Final = 5.0
# Managers that have done work and have not been closed (see `KeyManager._use`).
_unclosed: weakref.WeakSet[KeyManager] = weakref.WeakSet()
# The usage buffers of unclosed managers collected with counts unwritten: written at exit.
_orphans: list[UsageBuffer] = []


def check_usable(record: KeyRecord, now: datetime | None = None) -> None:
    """Raise the matching error unless `record` may authenticate a request at `now`.

    Revoked wins over disabled, and disabled over expired, so the answer never depends on
    the time when a person has acted on the key.
    """
    state = record.state
    if state != ACTIVE:
        raise KeyRevoked() if state == REVOKED else KeyDisabled()
    if record.expires_at is not None and record.expires_at <= (now or utcnow()):
        raise KeyExpired()


class _Unset:
    """The default of `update`'s arguments for which None means something."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()


def _kind(store: KeyStore) -> str:
    """The store's kind, for metrics: memory, sqlite, postgresql, redis (or its class)."""
    engine = getattr(store, "engine", None)
    dialect = getattr(getattr(engine, "dialect", None), "name", None)
    if isinstance(dialect, str):
        return dialect
    return type(store).__name__.removesuffix("Store").lower()


def _channel(channel: Channel | None) -> Channel | None:
    """`channel` if it is the store's own kind (`native`); anything else is refused: notices
    apart from the store's own change log would leave a writer unheard."""
    if channel is None or (isinstance(channel, Channel) and channel.native):
        return channel
    raise ConfigurationError(
        "channel takes a Channel of the store's own (store.channel()); the store's own change "
        "log tells every process of every change (docs/consistency.md)"
    )


def _starting(deliverer: Deliverer) -> Callable[[], None]:
    """`deliverer.start`, doing nothing where no event loop runs. It refers to the
    deliverer alone: a manager dropped unclosed is collected at once, and warned about."""

    def start() -> None:
        with contextlib.suppress(RuntimeError):
            deliverer.start()

    return start


def _rate_limit(rate_limit: str | None, rate_limits: Mapping[str, str] | None) -> str | None:
    """The `rate_limit` text to store: given as text, or made from a `{name: limit}` map."""
    if rate_limits is not None:
        if rate_limit is not None:
            raise InvalidKeyParameters("pass rate_limit or rate_limits, not both")
        if not isinstance(rate_limits, Mapping):
            raise InvalidKeyParameters("rate_limits takes a mapping of policy names to limits")
        return format_policies(rate_limits)
    if rate_limit is not None:
        parse_policies(rate_limit)
    return rate_limit


def refusal(record: KeyRecord, action: str) -> str | None:
    """Why `action` (`roll`, `disable`, `enable`, `revoke`) may not be taken on `record`, or
    None when it may: the one table of a key's transitions that the manager, the command
    line and the settings page all read.

    - A revoked key takes no transition but `revoke` (which then changes nothing).
    - A disabled key is enabled before it is rolled: a roll never makes an active key out of
      a disabled one.
    - A rolled key (`replaced_by` set) is not rolled again, so a key never has two live
      successors; roll its successor instead. Nor is it disabled while active: it stops
      working when its grace period ends, and `revoke` stops it now.
    """
    if action == "revoke":
        return None
    if record.state == REVOKED:
        return "it is revoked"
    if action == "roll":
        if record.state == DISABLED:
            return "it is disabled: enable it first"
        if record.replaced_by is not None:
            return f"it was rolled already: roll the key that replaces it, {record.replaced_by}"
    if action == "disable" and record.replaced_by is not None and record.status == "active":
        return (
            "it was rolled: it stops working when its grace period ends (revoke it to stop it now)"
        )
    return None


# The fields of a key's balance: a rolled key has none of its own (see `roll`).
_BALANCE_FIELDS: Final = frozenset({"credits", "credit_refill", "credits_refilled_at"})


def _records_of(store: KeyStore) -> Callable[[str], Awaitable[KeyRecord | None]]:
    """A key's record by its id, from `store`: what the deliverer reads (a function of the
    store alone, so that the manager and its deliverer make no reference cycle, and an
    unclosed manager is still collected, and warned about, at once)."""

    async def record(key_id: str) -> KeyRecord | None:
        stored = await store.get(key_id)
        return None if stored is None else stored.record

    return record


class KeyManager:
    """Issues and checks API keys held in a `KeyStore`.

    ```python
    manager = KeyManager(store_from_url("sqlite:///apikeys.db"))
    created = await manager.create(name="Zapier", workspace="acme", scopes=["contacts:read"])
    created.key  # the full key: shown here, and never again
    record = await manager.verify(created.key)
    ```

    `store` is a `KeyStore` or a store URL; without one, the manager reads the variables the
    `apikeys` command line reads, so both find the same keys: the store URL in
    `APIKEYS_STORE_URL` (`memory://` when it is unset), and, through `Hasher()`,
    `APIKEYS_PEPPER` and `APIKEYS_OLD_PEPPERS`. `hasher` defaults to `Hasher()`
    (HMAC-SHA256 keyed with `APIKEYS_PEPPER`). Request counts are buffered and written every
    `usage_flush_interval` seconds; `aclose()` (or leaving `async with`) writes the rest.

    `limiter` is the `RateLimiter` the integrations (the Starlette backend, the FastAPI
    dependency) share by default: a `RateLimiter`, or its storage URL; without one,
    `APIKEYS_LIMITER_URL` (`memory://` when it is unset), made on first use with the default
    limit of `APIKEYS_RATE_LIMIT`. A limiter the manager made is closed by `aclose()`.

    Records are cached in process (`cache`, on by default for SQLite, PostgreSQL and Redis)
    and trusted only while the store's invalidation channel proves them fresh, so `verify`
    needs no store round trip while every change still holds for the very next request in
    every process (docs/consistency.md), whoever made it. `cache_lease` bounds how long a
    change waits for a process that does not answer (seconds); `cache_size` bounds the
    records kept. `cache=False` reads the store on every verification; such a manager still
    waits, after each change it makes, for the processes that do cache keys. `channel`
    replaces the store's own channel with another `Channel` of the same store (tests use
    it to route the channel through a proxy); anything else (a URL, a channel that is not
    the store's own kind) raises `ConfigurationError`.

    From its first use until it is closed, a manager also delivers the store's webhooks
    that are due (docs/webhooks.md); `webhooks=False` stops that, and a `DeliveryOptions`
    tunes it.

    Close a manager when done with it: `await manager.aclose()`, or use it as
    `async with KeyManager(...) as manager:`. One that has done work (issued, read, changed
    or verified a key) and is garbage-collected or reaches interpreter exit unclosed emits a
    `ResourceWarning`, once (Python shows it with `-W always::ResourceWarning` or `-X dev`);
    at exit, the usage counts it still buffers are written if the store answers within a
    few seconds, and a logged warning says how many were lost if not. A manager that has
    done nothing holds nothing, and is never warned about.
    """

    # Class defaults: `__del__` may run on an instance whose `__init__` raised.
    _in_use = False
    # False in a subclass that overrides `verify` but not `verify_now`: `verify_now` then
    # leaves every request to its `verify`.
    _verifies_now: ClassVar[bool] = True
    # True in a subclass that overrides `verify_now`: `verify` then asks it first.
    _own_verify_now: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._own_verify_now = cls.verify_now is not KeyManager.verify_now
        cls._verifies_now = cls.verify is KeyManager.verify or cls._own_verify_now

    _warned = False
    _deliverer: Deliverer | None = None
    # key id -> (the version of the key last held, its hash's prepared check or None, the
    # checksum of the one token whose secret that check matched, once a request brought it)
    _plain: dict[str, tuple[StoredKey, Callable[[str], bool] | None, str | None]]
    _decoy: str | None = None
    _import_secret: str | None = None
    _import_checked = float("-inf")

    async def _decoy_hash(self) -> str:
        """A hash of a random secret, made as keys' hashes are: checked against when the
        key id is unknown."""
        decoy = self._decoy
        if decoy is None:
            decoy = self._decoy = await self.hasher.ahash(generate_key().secret)
        return decoy

    def __init__(
        self,
        store: KeyStore | str | None = None,
        *,
        hasher: Hasher | None = None,
        prefix: str = DEFAULT_PREFIX,
        usage_flush_interval: float = 1.0,
        cache: bool = True,
        channel: Channel | None = None,
        cache_lease: float = DEFAULT_LEASE,
        cache_size: int = DEFAULT_CACHE_SIZE,
        metrics: Any = False,
        on_event: EventHook | None = None,
        limiter: RateLimiter | str | None = None,
        webhooks: bool | DeliveryOptions = True,
    ) -> None:
        chosen = _channel(channel)
        self._owns_limiter = not isinstance(limiter, RateLimiter)
        self._limiter_url = limiter if isinstance(limiter, str) else None
        # A URL is checked now (a RateLimiter opens no connection until it is used).
        self._limiter = RateLimiter(None, limiter) if isinstance(limiter, str) else limiter
        if store is None:
            store = os.environ.get(STORE_URL_ENV) or "memory://"
        self._url = store if isinstance(store, str) else None
        self.store = store_from_url(store) if isinstance(store, str) else store
        # How logs name the store: its URL without the password, else its repr (no secret).
        self._where = safe_url(store) if isinstance(store, str) else repr(store)
        self.hasher = hasher if hasher is not None else Hasher()
        self.prefix = validate_prefix(prefix)
        self._split = key_splitter(prefix)
        # Where a token of this prefix has its parts (`{prefix}_{id}_{secret}{checksum}`), for
        # `verify_now`'s split by position.
        self._head = f"{prefix}_"
        self._id_end = len(self._head) + ID_LENGTH
        self._secret_end = self._id_end + 1 + SECRET_LENGTH
        self._length = self._secret_end + CHECKSUM_LENGTH
        self._plain = {}
        self.telemetry = Telemetry(metrics=metrics, on_event=on_event, store=_kind(self.store))
        self.usage_buffer = UsageBuffer(self.store, usage_flush_interval)
        if self.telemetry.active:
            self.usage_buffer.on_flush_failure = self.telemetry.usage_flush_failed
        self.cache: KeyCache | None = None
        # Every manager announces its changes and waits for the processes that cache keys,
        # whether or not it caches keys itself: `cache=False` only stops it serving from one.
        self._changes: KeyCache | None = None
        if chosen is None:
            chosen = self.store.channel()
        if chosen is not None:
            self._changes = KeyCache(self.store, chosen, lease=cache_lease, max_entries=cache_size)
            if cache:
                self.cache = self._changes
        # Webhooks: this process delivers what is due, from its first use until `aclose`.
        self._deliverer: Deliverer | None = None
        hooks = self.store.webhooks() if webhooks is not False else None
        if hooks is not None:
            self._deliverer = Deliverer(
                hooks,
                webhooks if isinstance(webhooks, DeliveryOptions) else None,
                records=_records_of(self.store),
                hasher=self.hasher,
            )
            if self._limiter is not None:
                self.observe_limiter(self._limiter)
            # The request path awaits nothing for a key it holds (`verify_now`), so the
            # usage buffer's tick starts the deliverer on the loop requests come in on.
            self.usage_buffer.on_tick = _starting(self._deliverer)

    def __repr__(self) -> str:
        return f"KeyManager(store={self.store!r}, prefix={self.prefix!r})"

    async def __aenter__(self) -> Self:
        self._use()
        try:
            await self.setup()
        except BaseException:
            # It never started: let go of what setting up opened, and warn about nothing.
            with contextlib.suppress(Exception):
                await self.aclose()
            self._release()
            raise
        return self

    async def setup(self) -> None:
        """Prepare the store and check this process's pepper against it (`async with`
        does this).

        The store records the fingerprint of the pepper its keys are hashed with
        (`Hasher.pepper_fingerprint`, never the pepper). A process with another pepper, or
        none where the store's keys have one, raises `ConfigurationError` here rather than
        answering every key `invalid_api_key`. A process that lists the recorded pepper in
        its old peppers (a rotation) records its new one.
        """
        await self._setup_store()
        await self._check_pepper()

    async def _check_pepper(self) -> None:
        mine = self.hasher.pepper_fingerprint
        recorded = await self.store.claim_setting(
            "pepper", mine, replacing=self.hasher.old_pepper_fingerprints
        )
        if recorded is None or recorded == mine:
            return
        if recorded == UNPEPPERED:
            text = (
                f"the keys in {self._where} were hashed without a pepper, and this process "
                "has one (APIKEYS_PEPPER): to move them to it, pass "
                "Hasher(allow_unpeppered=True)"
            )
        else:
            problem = (
                "this process has none (APIKEYS_PEPPER is not set)"
                if mine == UNPEPPERED
                else f"this process has another pepper (fingerprint {mine})"
            )
            text = (
                f"the keys in {self._where} are hashed with a pepper of fingerprint "
                f"{recorded}, and {problem}. Give every process the same APIKEYS_PEPPER "
                "(and list a retired one in APIKEYS_OLD_PEPPERS while rotating)"
            )
        logger.error("apikeys: %s", text)
        raise ConfigurationError(text)

    async def _setup_store(self) -> None:
        """`store.setup()`, and when it fails, a log line naming the store and the cause."""
        try:
            await self.store.setup()
        except StoreUnavailable as exc:
            cause = exc.original if exc.original is not None else exc
            text = f"key store unavailable: {self._where}: {self._redact(failure_reason(cause))}"
            logger.error("apikeys: %s", text)
            raise StoreUnavailable(exc.original, operator_text=text) from exc
        except Exception as exc:
            text = f"key store error: {self._where}: {self._redact(failure_reason(exc))}"
            logger.error("apikeys: %s", text)
            raise

    def _redact(self, text: str) -> str:
        return redact(text, self._url) if self._url is not None else text

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Write buffered usage, stop the cache, close the store and the limiter it made."""
        self._release()
        try:
            if self._deliverer is not None:
                await self._deliverer.aclose()
            await self.usage_buffer.aclose()
        finally:
            try:
                if self._changes is not None:
                    await self._changes.aclose()
            finally:
                try:
                    await self.store.aclose()
                finally:
                    limiter, self._limiter = self._limiter, None
                    if limiter is not None and self._owns_limiter:
                        await limiter.aclose()

    @property
    def limiter(self) -> RateLimiter:
        """The rate limiter the integrations share by default (see the class doc)."""
        limiter = self._limiter
        if limiter is None:
            url = self._limiter_url or os.environ.get(LIMITER_URL_ENV) or "memory://"
            limiter = self._limiter = RateLimiter(None, url)
            self.observe_limiter(limiter)
        return limiter

    @property
    def deliverer(self) -> Deliverer | None:
        """The task that delivers the store's webhooks from this process (None when
        `webhooks=False`, or the store keeps none); `await manager.deliverer.run_once()`
        runs one round now."""
        return self._deliverer

    def observe_limiter(self, limiter: RateLimiter) -> None:
        """Send `key.usage_threshold` webhooks when `limiter` finds a key's window reaching
        80, 90 or 100 % of a limit (`RateLimiter.on_threshold`), while an endpoint wants
        that event. The manager's own `limiter` is observed, and so is one given to a `Gate`
        (the middleware's); a limiter with an observer of its own is left to it. Nothing
        when this manager delivers no webhooks."""
        if self._deliverer is not None:
            self._deliverer.thresholds.attach(limiter)

    async def flush(self) -> None:
        """Write buffered usage counts to the store now."""
        await self.usage_buffer.flush()

    # -- lifecycle -------------------------------------------------------------------------

    def _use(self) -> None:
        """Note that this manager has done work: from now on it holds what `aclose` releases
        (connections, a cache, buffered counts), and is warned about if never closed. Its
        deliverer runs on this loop, or goes on running on another (`Deliverer.start`)."""
        if not self._in_use:
            self._in_use = True
            _unclosed.add(self)
        if self._deliverer is not None:
            with contextlib.suppress(RuntimeError):  # no running loop: no deliveries
                self._deliverer.start()

    def _release(self) -> None:
        """Forget that this manager has done work, without closing anything: `aclose` does
        this first, and so does a helper manager sharing another's store, holding nothing
        of its own."""
        self._in_use = False
        _unclosed.discard(self)

    def _warn_unclosed(self, _warnings: Any = warnings) -> None:
        """The `ResourceWarning` of an unclosed manager, at most once."""
        if self._warned:
            return
        self._warned = True
        _warnings.warn(
            f"unclosed {self!r}: close it with `await manager.aclose()` when done with it, "
            "or use it as `async with KeyManager(...) as manager:`",
            ResourceWarning,
            source=self,
        )

    def __del__(self, _warnings: Any = warnings) -> None:
        if not self._in_use:
            return
        usage = self.__dict__.get("usage_buffer")
        if isinstance(usage, UsageBuffer) and usage.unwritten():
            # Counts nothing else would write once this manager is gone: written at exit.
            _orphans[:] = [buffer for buffer in _orphans if buffer.unwritten()]
            _orphans.append(usage)
        self._warn_unclosed(_warnings)

    # -- issuing ---------------------------------------------------------------------------

    async def create(
        self,
        *,
        name: str,
        workspace: str = "default",
        scopes: Iterable[str] = (),
        full_access: bool = False,
        rate_limit: str | None = None,
        rate_limits: Mapping[str, str] | None = None,
        expires_at: datetime | None = None,
        expires_in: timedelta | None = None,
        owner: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        allowed_ips: Iterable[str] | None = None,
        credits: int | None = None,
        credit_refill: str | None = None,
        actor: str | None = None,
    ) -> CreatedKey:
        """Create a key. The returned `CreatedKey.key` is the only time the key is shown.

        A key has `full_access` (every scope, including scopes added later) or the given
        `scopes`; a restricted key without scopes is refused. `rate_limit` overrides the
        middleware's default: one limit in `limits` notation (`100/minute`) or named
        policies (`burst=10/second, daily=10000/day`); `rate_limits={"burst": "10/second",
        …}` says the same as a mapping (stored as that text). Expiry is `expires_at` or
        `expires_in`.

        Policies (`apikeys.policies`): `owner` and `metadata` (a JSON object of at most
        4 KiB, never a secret) for the application; `allowed_ips`, CIDR ranges the key may
        be used from; `credits`, uses left, with `credit_refill` (`"1000/day"`,
        `"5000/month"`) setting them back each UTC period (a key with a refill and no
        `credits` starts full).

        A key the store made but its replicas did not confirm in time (Redis `wait_replicas`)
        is returned all the same, with `CreatedKey.confirmed` False and the reason in
        `CreatedKey.warning`: it works, and this is the only time it can be shown.
        """
        check_text(name, "name")
        check_text(workspace, "workspace")
        scope_tuple = validate_scopes(scopes)
        if full_access and scope_tuple:
            raise InvalidKeyParameters("a full-access key takes no scopes")
        if not full_access and not scope_tuple:
            raise InvalidKeyParameters(
                "a restricted key needs at least one scope (or pass full_access=True)"
            )
        rate_limit = _rate_limit(rate_limit, rate_limits)
        now = utcnow()
        expiry = self._expiry(now, expires_at, expires_in)
        policy = policy_fields(
            owner=owner,
            metadata=metadata,
            allowed_ips=allowed_ips,
            credits=credits,
            credit_refill=credit_refill,
        )
        refill = parse_refill(policy.get("credit_refill"))
        if refill is not None:
            policy.setdefault("credits", refill.amount)
            policy["credits_refilled_at"] = refill.period_start(now)
        return await self._issue(
            name=name,
            workspace=workspace,
            access="full" if full_access else "restricted",
            scopes=scope_tuple,
            rate_limit=rate_limit,
            created_at=now,
            expires_at=expiry,
            policy=policy,
            actor=actor,
        )

    @staticmethod
    def _expiry(
        now: datetime, expires_at: datetime | None, expires_in: timedelta | None
    ) -> datetime | None:
        if expires_at is not None and expires_in is not None:
            raise InvalidKeyParameters("pass expires_at or expires_in, not both")
        if expires_in is not None:
            if expires_in <= timedelta(0):
                raise InvalidKeyParameters("expires_in must be positive")
            return now + expires_in
        if expires_at is not None:
            if expires_at.tzinfo is None:
                raise InvalidKeyParameters("expires_at must be timezone-aware")
            if expires_at <= now:
                raise InvalidKeyParameters("expires_at must be in the future")
        return expires_at

    async def _issue(
        self,
        *,
        name: str,
        workspace: str,
        access: str,
        scopes: tuple[str, ...],
        rate_limit: str | None,
        created_at: datetime,
        expires_at: datetime | None,
        replaces: str | None = None,
        policy: Mapping[str, Any] | None = None,
        actor: str | None = None,
    ) -> CreatedKey:
        self._use()
        for _ in range(_INSERT_ATTEMPTS):
            parsed = generate_key(self.prefix)
            record = KeyRecord(
                id=parsed.id,
                name=name,
                workspace=workspace,
                prefix=parsed.masked,
                access="full" if access == "full" else "restricted",
                scopes=scopes,
                state=ACTIVE,
                rate_limit=rate_limit,
                created_at=created_at,
                expires_at=expires_at,
                replaces=replaces,
                **(policy or {}),
            )
            # What the key was made with: its grants and policies, never its secret.
            made = record.to_dict()
            for volatile in (
                "id",
                "prefix",
                "status",
                "last_used_at",
                "request_count",
                "workspace",
                "created_at",
                "rate_limits",  # derived from rate_limit
            ):
                made.pop(volatile)
            event = AuditEvent(
                time=created_at,
                key_id=record.id,
                workspace=workspace,
                action="created",
                actor=actor,
                changes={k: v for k, v in made.items() if v not in (None, [], {})},
            )
            warning = None
            try:
                secret_hash = await self.hasher.ahash(parsed.secret)
                await self.store.insert(StoredKey(record, secret_hash), event=event)
            except DuplicateKeyId:
                continue
            except ChangeNotConfirmed as exc:
                # Made on the primary, not confirmed by its replicas: the key works, and
                # this is the only time it can be shown. Return it, saying so.
                stored = await self.store.get(record.id)
                if stored is None or stored.secret_hash != secret_hash:
                    continue  # nothing of ours was stored: the id was taken
                warning = str(exc)
                logger.warning("apikeys: key %s created, not confirmed: %s", record.id, warning)
            self._announce(event)
            return CreatedKey(parsed.token, record, warning)
        raise DuplicateKeyId("could not find a free key id")  # pragma: no cover

    def _announce(self, event: AuditEvent) -> None:
        """Tell `on_event` about a change that was made (the store wrote `event` with it)."""
        if self.telemetry.active:
            self.telemetry.key_changed(event)

    async def _change(
        self, key_id: str, apply: Callable[[str | None], Awaitable[_T]], *, wait: bool = True
    ) -> _T:
        """Make a change to `key_id` that every process sees on its next request.

        `apply(notice)` changes the store, publishing `notice` in its transaction. With a
        cache, this returns once every process caching keys has dropped the key (or a lease
        has passed): see `KeyCache.change`.
        """
        self._use()
        if self._changes is None:
            return await apply(None)
        return await self._changes.change(key_id, apply, wait=wait)

    # -- reading ---------------------------------------------------------------------------

    async def get(self, key_id: str) -> KeyRecord:
        """The record of `key_id`, with this process's unflushed usage. Raises `KeyNotFound`."""
        self._use()
        stored = await self.store.get(key_id)
        if stored is None:
            raise KeyNotFound(key_id)
        return self.usage_buffer.apply(await self._shared_credits(stored.record, {}))

    async def list(
        self,
        workspace: str | None = None,
        *,
        owner: str | None = None,
        status: Status | None = None,
    ) -> list[KeyRecord]:
        """Every record of `workspace` (or of all workspaces), oldest first, in one read;
        `owner` and `status` keep only the keys with that owner and status.

        For many keys, read them a page at a time: `list_page`, or `iter_keys`.
        """
        self._use()
        where = KeyFilter(workspace, owner, status)
        now = utcnow()
        records = await self.store.list(workspace)
        by_id = {record.id: record for record in records}
        return [
            self.usage_buffer.apply(await self._shared_credits(record, by_id))
            for record in records
            if where.matches(record, now)
        ]

    async def list_page(
        self,
        workspace: str | None = None,
        *,
        owner: str | None = None,
        status: Status | None = None,
        limit: int = DEFAULT_PAGE_SIZE,
        cursor: str | None = None,
    ) -> KeyPage:
        """One page of the records that match, oldest first (by `created_at`, then id).

        `limit` is the page size, 1 to `MAX_PAGE_SIZE` (1000). The page's `next_cursor`,
        passed as `cursor`, gives the next page; it is None on the last one. A cursor is
        opaque (it names a position, never a secret); one that was not made here raises
        `InvalidKeyParameters`, as does a bad `limit` or `status`. What a walk through the
        pages guarantees while keys change is in `apikeys.listing`.
        """
        self._use()
        where = KeyFilter(workspace, owner, status)
        size = check_page_size(limit)
        start = None if cursor is None else decode_cursor(cursor)
        found = await self.store.list_page(where, start=start, limit=size + 1, now=utcnow())
        by_id = {record.id: record for record in found}
        records = [
            self.usage_buffer.apply(await self._shared_credits(record, by_id))
            for record in found[:size]
        ]
        more = len(found) > size
        return KeyPage(records, encode_cursor(position(records[-1])) if more else None)

    async def iter_keys(
        self,
        workspace: str | None = None,
        *,
        owner: str | None = None,
        status: Status | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[KeyRecord]:
        """Every record that matches, oldest first, read `page_size` at a time
        (`list_page` without the cursors)."""
        cursor: str | None = None
        while True:
            page = await self.list_page(
                workspace, owner=owner, status=status, limit=page_size, cursor=cursor
            )
            for record in page.records:
                yield record
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def _shared_credits(self, record: KeyRecord, known: Mapping[str, KeyRecord]) -> KeyRecord:
        """`record`, showing the balance it spends from: a rolled key's is its successor's
        (followed to the newest key; `known` holds records already read)."""
        holder = record
        for _ in range(MAX_ROLL_HOPS):
            if holder.replaced_by is None:
                break
            successor = known.get(holder.replaced_by)
            if successor is None:
                stored = await self.store.get(holder.replaced_by)
                if stored is None:
                    break
                successor = stored.record
            holder = successor
        if holder is record:
            return record
        return replace(
            record, credits=holder.credits, credits_refilled_at=holder.credits_refilled_at
        )

    # -- state changes ---------------------------------------------------------------------

    async def disable(
        self, key_id: str, *, actor: str | None = None, reason: str | None = None
    ) -> KeyRecord:
        """Stop a key from authenticating until `enable`. Refused for a revoked key.

        Every change takes an `actor` (who made it) for the audit trail; `reason` is noted
        in the event's changes (the leak responder says `"leaked"`).
        """
        return await self._transition(
            key_id, DISABLED, (ACTIVE,), "disable", "disabled", actor, reason
        )

    async def enable(self, key_id: str, *, actor: str | None = None) -> KeyRecord:
        """Let a disabled key authenticate again. Refused for a revoked key."""
        return await self._transition(key_id, ACTIVE, (DISABLED,), "enable", "enabled", actor)

    async def revoke(
        self, key_id: str, *, actor: str | None = None, leaked: bool = False
    ) -> KeyRecord:
        """Revoke a key for good: every later request with it gets 401 `key_revoked`.

        `leaked=True` records the revocation as `leak_revoked` in the audit trail.
        """
        action: AuditAction = "leak_revoked" if leaked else "revoked"
        return await self._transition(key_id, REVOKED, (ACTIVE, DISABLED), "revoke", action, actor)

    async def usage(self, key_id: str, days: int = 30) -> builtins.list[DailyUsage]:
        """The key's requests per UTC day over the last `days` days (today included),
        oldest first, one entry per day (zero on days without requests): admitted, and
        refused by code. Includes this process's counts not yet written."""
        if not 1 <= days <= 3660:
            raise InvalidKeyParameters("days must be from 1 to 3660")
        await self.get(key_id)  # KeyNotFound for an unknown id
        today = utcnow().date()
        first = today - timedelta(days=days - 1)
        counts: dict[tuple[str, str], int] = {}
        for day in await self.store.usage_history(key_id, first):
            counts[(day.day.isoformat(), ADMITTED)] = day.admitted
            counts[(day.day.isoformat(), LEGACY_SCHEME)] = day.legacy_scheme
            for code, count in day.refused.items():
                counts[(day.day.isoformat(), code)] = count
        for slot, count in self.usage_buffer.pending_daily(key_id).items():
            counts[slot] = counts.get(slot, 0) + count
        history = {day.day: day for day in days_of((d, o, n) for (d, o), n in counts.items())}
        return [
            history.get(first + timedelta(days=n), DailyUsage(first + timedelta(days=n)))
            for n in range(days)
        ]

    async def audit(
        self,
        *,
        workspace: str | None = None,
        key_id: str | None = None,
        since: datetime | None = None,
        limit: int = 1000,
    ) -> builtins.list[AuditEvent]:
        """The audit trail: the newest `limit` changes that match, oldest first."""
        return await self.store.audit(workspace=workspace, key_id=key_id, since=since, limit=limit)

    async def _event(
        self,
        action: AuditAction,
        key_id: str,
        actor: str | None,
        changes: Mapping[str, Any],
        workspace: str | None = None,
    ) -> AuditEvent:
        """The audit event of a change about to be made (the key's workspace read first)."""
        if workspace is None:
            stored = await self.store.get(key_id)
            if stored is None:
                raise KeyNotFound(key_id)
            workspace = stored.record.workspace
        return AuditEvent(
            time=utcnow(),
            key_id=key_id,
            workspace=workspace,
            action=action,
            actor=actor,
            changes=jsonable(changes),
        )

    async def _transition(
        self,
        key_id: str,
        target: StoredState,
        allowed_from: tuple[StoredState, ...],
        verb: str,
        action: AuditAction,
        actor: str | None,
        reason: str | None = None,
    ) -> KeyRecord:
        changes: dict[str, Any] = {"state": target}
        if reason is not None:
            changes["reason"] = reason
        before = await self.store.get(key_id)
        if before is None:
            raise KeyNotFound(key_id)
        why = refusal(before.record, verb)
        if why is not None and before.record.state != target:
            raise InvalidTransition(key_id, before.record.status, verb, why)
        event = await self._event(action, key_id, actor, changes, before.record.workspace)
        record = await self._change(
            key_id,
            lambda notice: self.store.set_state(
                key_id,
                target,
                allowed_from=allowed_from,
                at=event.time,
                notice=notice,
                event=event,
            ),
        )
        if record.state != target:
            raise InvalidTransition(key_id, record.status, verb)
        if before.record.state != target:
            self._announce(event)
        return self.usage_buffer.apply(record)

    async def update(
        self,
        key_id: str,
        *,
        name: str | None = None,
        scopes: Iterable[str] | None = None,
        full_access: bool | None = None,
        rate_limit: str | _Unset | None = UNSET,
        rate_limits: Mapping[str, str] | None = None,
        expires_at: datetime | _Unset | None = UNSET,
        expires_in: timedelta | None = None,
        owner: str | _Unset | None = UNSET,
        metadata: Mapping[str, Any] | _Unset | None = UNSET,
        allowed_ips: Iterable[str] | _Unset | None = UNSET,
        credits: int | _Unset | None = UNSET,
        credit_refill: str | _Unset | None = UNSET,
        actor: str | None = None,
    ) -> KeyRecord:
        """Edit a key: its name, access and scopes, rate limit or expiry, and its policies
        (None clears `owner`, `metadata`, `allowed_ips` and `credit_refill`, and makes
        `credits` unlimited). Refused when revoked.

        Only what is given changes. `scopes=[…]` makes the key restricted to those scopes;
        `full_access=True` gives it every scope; `rate_limit=None` returns it to the
        middleware's default (`rate_limits={name: limit}` sets named policies) and
        `expires_at=None` makes it never expire (`expires_in` sets an expiry from now). Like
        `revoke`, it returns once every process that caches keys has dropped the old
        record: a narrowed key is narrowed on its very next request.
        """
        changes: dict[str, object] = {}
        if name is not None:
            changes["name"] = check_text(name, "name")
        if full_access is not None or scopes is not None:
            scope_tuple = validate_scopes(scopes or ())
            if full_access and scope_tuple:
                raise InvalidKeyParameters("a full-access key takes no scopes")
            if full_access:
                changes.update(access="full", scopes=())
            elif scope_tuple:
                changes.update(access="restricted", scopes=scope_tuple)
            else:
                raise InvalidKeyParameters(
                    "a restricted key needs at least one scope (or pass full_access=True)"
                )
        if rate_limits is not None:
            if not isinstance(rate_limit, _Unset):
                raise InvalidKeyParameters("pass rate_limit or rate_limits, not both")
            changes["rate_limit"] = _rate_limit(None, rate_limits)
        elif not isinstance(rate_limit, _Unset):
            changes["rate_limit"] = _rate_limit(rate_limit, None)
        if expires_in is not None or not isinstance(expires_at, _Unset):
            given = None if isinstance(expires_at, _Unset) else expires_at
            if given is None and expires_in is None:
                changes["expires_at"] = None
            else:
                changes["expires_at"] = self._expiry(utcnow(), given, expires_in)
        changes.update(
            policy_fields(
                owner=None if isinstance(owner, _Unset) else owner,
                metadata=None if isinstance(metadata, _Unset) else metadata,
                allowed_ips=None if isinstance(allowed_ips, _Unset) else allowed_ips,
                credits=None if isinstance(credits, _Unset) else credits,
                credit_refill=None if isinstance(credit_refill, _Unset) else credit_refill,
            )
        )
        for field, value, cleared in (
            ("owner", owner, None),
            ("metadata", metadata, {}),
            ("allowed_ips", allowed_ips, ()),
            ("credits", credits, None),
            ("credit_refill", credit_refill, None),
        ):
            if value is None:
                changes[field] = cleared
        if _BALANCE_FIELDS & changes.keys():
            await self._check_own_balance(key_id, changes)
        if changes.get("credit_refill") is not None:
            refill = parse_refill(str(changes["credit_refill"]))
            if refill is not None:
                # The new refill starts now: full unless `credits` says otherwise.
                if changes.get("credits") is None:
                    changes["credits"] = refill.amount
                changes["credits_refilled_at"] = refill.period_start(utcnow())
        event = await self._event("updated", key_id, actor, changes)
        record = await self._change(
            key_id, lambda notice: self.store.update(key_id, changes, notice=notice, event=event)
        )
        if record.state == REVOKED:
            raise InvalidTransition(key_id, REVOKED, "update")
        if changes:
            self._announce(event)
        if _BALANCE_FIELDS & changes.keys() and record.replaces is not None:
            await self._share_with_predecessors(record, actor)
        # As `get` shows it: a rolled key with the balance it spends from, its successor's.
        return self.usage_buffer.apply(await self._shared_credits(record, {}))

    async def _share_with_predecessors(self, record: KeyRecord, actor: str | None) -> None:
        """Copy `record`'s credit settings to the keys it replaces, which spend its balance:
        whether a request is charged is read from the key's own record, and a refill follows
        the spending key's `credit_refill`."""
        changes = {"credits": record.credits, "credit_refill": record.credit_refill}
        successor = record
        for _ in range(MAX_ROLL_HOPS):
            if successor.replaces is None:
                return
            stored = await self.store.get(successor.replaces)
            if stored is None or stored.record.replaced_by != successor.id:
                return
            key_id = stored.record.id
            event = await self._event(
                "updated",
                key_id,
                actor,
                {**changes, "reason": f"the credits of {record.id}, which it spends"},
                stored.record.workspace,
            )
            successor = await self._change(
                key_id,
                lambda notice: self.store.update(key_id, changes, notice=notice, event=event),  # noqa: B023
            )
            if successor.state != REVOKED:
                self._announce(event)

    async def _check_own_balance(self, key_id: str, changes: dict[str, object]) -> None:
        """Refuse to change the credits of a rolled key: its balance is its successor's.

        Credit settings given as they are (a form sent back unchanged) are dropped from
        `changes` instead.
        """
        stored = await self.store.get(key_id)
        if stored is None:
            raise KeyNotFound(key_id)
        record = stored.record
        if record.replaced_by is None or record.state == REVOKED:
            return
        shown = await self._shared_credits(record, {})
        for field in _BALANCE_FIELDS & changes.keys():
            if changes[field] == getattr(shown, field):
                del changes[field]
        if _BALANCE_FIELDS & changes.keys():
            raise InvalidTransition(
                key_id,
                record.status,
                "update",
                "it was rolled: it spends the credits of the key that replaces it, "
                f"{record.replaced_by}; change them there",
            )

    async def roll(
        self,
        key_id: str,
        grace: timedelta = timedelta(hours=24),
        *,
        expires_in: timedelta | None = None,
        expires_at: datetime | None = None,
        actor: str | None = None,
    ) -> CreatedKey:
        """Replace a key with a new one of the same name, workspace, access, scopes and limit.

        The old key keeps working for `grace`, then expires (an earlier expiry stays). The
        new key keeps the old one's lifetime: it expires as long after now as the old one
        did after its creation (a key that never expired gives one that never does), unless
        `expires_in` or `expires_at` says otherwise. Refused for a revoked or disabled key,
        and for one rolled already (roll its successor): see `refusal`.

        The pair has one balance of credits: the new key takes over what the old one had
        left, and the old key spends from the new key's balance through its grace period.

        As with `create`, a roll its store's replicas did not confirm in time still returns
        the new key, with `CreatedKey.confirmed` False and the reason in `warning`.
        """
        if grace < timedelta(0):
            raise InvalidKeyParameters("grace must not be negative")
        self._use()
        stored = await self.store.get(key_id)
        if stored is None:
            raise KeyNotFound(key_id)
        old = stored.record
        why = refusal(old, "roll")
        if why is not None:
            raise InvalidTransition(key_id, old.status, "roll", why)
        now = utcnow()
        if expires_in is None and expires_at is None and old.expires_at is not None:
            # The same lifetime as the key it replaces, from now (at least a second).
            expires_in = max(old.expires_at - old.created_at, timedelta(seconds=1))
        created = await self._issue(
            name=old.name,
            workspace=old.workspace,
            access=old.access,
            scopes=old.scopes,
            rate_limit=old.rate_limit,
            created_at=now,
            expires_at=self._expiry(now, expires_at, expires_in),
            replaces=key_id,
            policy={
                "owner": old.owner,
                "metadata": old.metadata,
                "allowed_ips": old.allowed_ips,
                # One balance for the pair: the new key starts empty and is given the old
                # key's credits once the old key spends from it (below).
                "credits": None if old.credits is None else 0,
                "credit_refill": old.credit_refill,
                "credits_refilled_at": old.credits_refilled_at,
            },
            actor=actor,
        )
        # The new key exists before the old one is cut short: a failure here never leaves
        # the integration without a working key.
        new_id = created.record.id
        rolled = AuditEvent(
            time=now,
            key_id=key_id,
            workspace=old.workspace,
            action="rolled",
            actor=actor,
            changes=jsonable({"replaced_by": new_id, "grace_ends_at": now + grace}),
        )
        warnings = [created.warning] if created.warning else []
        old = await self._unconfirmed(
            key_id,
            self._change(
                key_id,
                lambda notice: self.store.shorten_expiry(
                    key_id, now + grace, replaced_by=new_id, notice=notice, event=rolled
                ),
            ),
            warnings,
        )
        if old.state == REVOKED or old.replaced_by != new_id:
            # Revoked elsewhere while the new key was being issued (revocation wins), or
            # rolled by another call at the same time (the first to link the key wins): the
            # new key never served and is revoked, so one key never has two live successors.
            reason = (
                "the key it replaces was revoked"
                if old.state == REVOKED
                else "the key it replaces was rolled by another call at the same time"
            )
            await self._change(
                new_id,
                lambda notice: self.store.set_state(
                    new_id,
                    REVOKED,
                    allowed_from=(ACTIVE, DISABLED),
                    at=utcnow(),
                    notice=notice,
                    event=AuditEvent(
                        time=utcnow(),
                        key_id=new_id,
                        workspace=old.workspace,
                        action="revoked",
                        actor=actor,
                        changes={"state": REVOKED, "reason": reason},
                    ),
                ),
            )
            if old.state == REVOKED:
                raise InvalidTransition(key_id, REVOKED, "roll")
            why = refusal(old, "roll")
            raise InvalidTransition(key_id, old.status, "roll", why or "it was rolled already")
        self._announce(rolled)
        record = created.record
        if old.credits is not None or record.credits is not None:
            record = await self._unconfirmed(
                new_id, self._move_balance(old, new_id, actor), warnings
            )
        return CreatedKey(created.key, record, warnings[0] if warnings else None)

    async def _unconfirmed(
        self, key_id: str, change: Awaitable[KeyRecord], warnings: builtins.list[str]
    ) -> KeyRecord:
        """`change`'s record. A change its replicas did not confirm (`ChangeNotConfirmed`)
        was made all the same: the key's record as the store has it, and why in `warnings`.
        For the steps of a roll after its new key exists, which must not lose that key."""
        try:
            return await change
        except ChangeNotConfirmed as exc:
            stored = await self.store.get(key_id)
            if stored is None:
                raise
            warnings.append(str(exc))
            return stored.record

    async def _move_balance(self, old: KeyRecord, new_id: str, actor: str | None) -> KeyRecord:
        """Give the new key of a roll the old key's credits, as they were when the old key
        began to spend from the new one's balance (`old`, as `shorten_expiry` returned it).

        Spends of the old key taken before the link are in `old.credits`; those after it are
        taken from the new key (which holds none until this: they are refused for that
        moment, never admitted twice). So the pair spends one balance, never a copy.
        """
        changes = {"credits": old.credits, "credits_refilled_at": old.credits_refilled_at}
        event = AuditEvent(
            time=utcnow(),
            key_id=new_id,
            workspace=old.workspace,
            action="updated",
            actor=actor,
            changes=jsonable({**changes, "reason": f"the credits of {old.id}, which it replaces"}),
        )
        record = await self._change(
            new_id,
            lambda notice: self.store.update(new_id, changes, notice=notice, event=event),
            wait=False,  # it only widens the key
        )
        if record.state != REVOKED:
            self._announce(event)
        return record

    async def spend_credits(self, record: KeyRecord, cost: int = 1) -> int | None:
        """Take `cost` of the key's credits, refilling them first when a new period began.

        Returns the credits left, or None when too few were left (nothing is taken). Exact
        across processes: the store takes them in one atomic step. A key without credits
        (unlimited) is not for this method. A rolled key spends its successor's balance,
        which the pair shares (see `roll`).
        """
        if not record.credit_refill:
            return await self.store.spend_credits(record.id, cost)
        refill = parse_refill(record.credit_refill)
        window = None if refill is None else (refill.amount, refill.period_start(utcnow()))
        return await self.store.spend_credits(record.id, cost, refill=window)

    # -- verification ----------------------------------------------------------------------

    async def verify(self, token: str, *, record_usage: bool = True) -> KeyRecord:
        """The record of the key `token` names, if it may be used now; else raise.

        Raises `MalformedAPIKey` (before any store access), `InvalidAPIKey`, `KeyDisabled`,
        `KeyRevoked`, `KeyExpired` or `StoreUnavailable`. Never returns an unusable key.
        Counts the request in the key's usage unless `record_usage` is false.
        """
        if not self.telemetry.active:
            # The token is split once, here, for both the held key's check and the store's.
            try:
                key_id, secret = self._split(token)
            except MalformedAPIKey:
                return await self._verify_foreign(token, record_usage)
            if record_usage:
                if self._own_verify_now:
                    record = self.verify_now(token)
                else:
                    record = self._verify_held(key_id, secret, True)
                if record is not None:
                    return record
            return await self._verify_key(key_id, secret, record_usage)
        started = time.perf_counter()
        try:
            record = await self._verify(token, record_usage)
        except AuthenticationError as exc:
            self.telemetry.verification(None, exc.code, time.perf_counter() - started)
            raise
        self.telemetry.verification(record.id, "ok", time.perf_counter() - started)
        return record

    async def verify_imported(self, token: str, *, record_usage: bool = True) -> KeyRecord:
        """`verify` for a key sent under a migration's legacy scheme (`Api-Key <key>`): only
        an imported key's old string is accepted. A key of this manager's format (or a
        damaged one) is refused with `MalformedAPIKey`, saying to send it as Bearer."""
        started = time.perf_counter()
        try:
            if not is_foreign_token(token, self.prefix):
                detail = _LEGACY_DETAIL if token.startswith(self.prefix + "_") else None
                raise MalformedAPIKey(detail)
            record = await self._verify_foreign(token, record_usage)
        except AuthenticationError as exc:
            if self.telemetry.active:
                self.telemetry.verification(None, exc.code, time.perf_counter() - started)
            raise
        if self.telemetry.active:
            self.telemetry.verification(record.id, "ok", time.perf_counter() - started)
        return record

    def verify_now(self, token: str, *, count: bool = True) -> KeyRecord | None:
        """`verify` when it need not wait: from the key cache, or an in-process store.

        Returns the record of the key `token` names, its request counted, when the key is
        there and its hash is a fast one; raises what `verify` raises for such a key (and
        `MalformedAPIKey` for a malformed token that cannot be an imported key's). Returns
        None when the store must be read, the key is not found (an unknown id is checked
        against the decoy there), its hash moves to another scheme, or telemetry is on:
        then `await verify(token)` decides. The request path calls this first, to spare
        the awaits of a cached key.
        `count=False` leaves the request uncounted: the caller counts it with
        `usage_buffer.record(record.id)` once it has decided to go on without `verify`.
        """
        if self.telemetry.active or not self._verifies_now:
            return None
        if (
            token.__class__ is str
            and len(token) == self._length
            and token[self._id_end] == "_"
            and token.startswith(self._head)
            and token.isascii()
        ):
            # Split by position. The token's alphabet and checksum are checked by the full
            # split (`_split`), unless its secret matches the held key's hash and its
            # checksum is the one of the token that matched before: then it is that token.
            end = self._id_end
            return self._verify_held(
                token[len(self._head) : end], token[end + 1 : self._secret_end], count, token
            )
        try:
            key_id, secret = self._split(token)
        except MalformedAPIKey:
            if is_foreign_token(token, self.prefix):
                return None  # perhaps an imported key's old string: `verify` looks it up
            raise
        return self._verify_held(key_id, secret, count)

    def _verify_held(
        self, key_id: str, secret: str, count: bool, unchecked: str | None = None
    ) -> KeyRecord | None:
        """`verify_now` of a token of this manager's prefix already split: its checksum
        checked, or the token itself given as `unchecked` (split by position only), which
        is checked in full before any answer but a match with a checksum seen before."""
        if not self._in_use:
            self._use()
        cache = self.cache
        if cache is not None:
            stored = cache.hit(key_id)
        else:
            found = self.store.get_for_verification_now(key_id)
            stored = None if found is False else found
        if stored is None:
            if unchecked is not None:
                self._well_formed(unchecked)  # a malformed token is refused as such
            return None
        # What this version of the key allows is worked out at its first request (see
        # `_plain`): then a request costs its hash and its expiry, nothing else.
        try:
            version, matches, checked = self._plain[key_id]
        except KeyError:
            version = None
        if version is not stored:
            matches, checked = self._plain_version(key_id, stored), None
        if matches is None:
            if unchecked is not None and not self._well_formed(unchecked):
                return None
            return self._verify_unusual(key_id, secret, stored, count)
        if not matches(secret):
            if unchecked is not None and not self._well_formed(unchecked):
                return None
            raise InvalidAPIKey()
        if unchecked is not None and unchecked[-CHECKSUM_LENGTH:] != checked:
            # The secret matched (so nothing here is a secret an answer's time could tell):
            # the first time for this version, the whole token's format and checksum.
            if not self._well_formed(unchecked):
                return None
            self._plain[key_id] = (stored, matches, unchecked[-CHECKSUM_LENGTH:])
        record = stored.record
        if record.expires_at is not None and record.expires_at <= utcnow():
            raise KeyExpired()
        if count:
            self.usage_buffer.record(key_id)
        return record

    def _well_formed(self, token: str) -> bool:
        """The full split's verdict on a token `verify_now` split by position: True when
        well formed; False when it is not but may be an imported key's old string (then
        `verify` looks it up); else `MalformedAPIKey`, as `verify_now` raises it."""
        try:
            self._split(token)
        except MalformedAPIKey:
            if is_foreign_token(token, self.prefix):
                return False
            raise
        return True

    def _plain_version(self, key_id: str, stored: StoredKey) -> Callable[[str], bool] | None:
        """The prepared check of `stored`'s hash, when nothing but the hash and the expiry is
        left to decide at each request: an active key of this manager's prefix (a token's
        prefix is the manager's, which its split checked) whose hash is the hasher's
        current one. None otherwise: `_verify_unusual` decides its every request.
        Remembered for the key's next requests, until the key (its `StoredKey`) changes."""
        record = stored.record
        matches = None
        if record.state == ACTIVE and record.prefix[:_PREFIX_END] == self.prefix:
            matches = self.hasher.matcher(stored.secret_hash)
        remember(self._plain, key_id, (stored, matches, None), _PLAIN_LIMIT)
        return matches

    def _verify_unusual(
        self, key_id: str, secret: str, stored: StoredKey, count: bool
    ) -> KeyRecord | None:
        """`_verify_held` of a key that is not active, not of this manager's prefix, or
        whose hash is another scheme's or another pepper's."""
        # The prefix is part of the key (see _verify_key): `prefix` is "{key_prefix}_{id}_…"
        # and an id is ID_LENGTH long, so the slice is KeyRecord.key_prefix.
        if stored.record.prefix[:_PREFIX_END] != self.prefix:
            return None
        verdict = self.hasher.verify_fast(secret, stored.secret_hash)
        if verdict is None:
            return None
        if not verdict.ok:
            raise InvalidAPIKey()
        record = stored.record
        check_usable(record)
        if verdict.new_hash is not None or verdict.stale:
            return None
        if count:
            self.usage_buffer.record(key_id)
        return record

    async def _verify(self, token: str, record_usage: bool) -> KeyRecord:
        try:
            key_id, secret = self._split(token)
        except MalformedAPIKey:
            return await self._verify_foreign(token, record_usage)
        return await self._verify_key(key_id, secret, record_usage)

    async def _verify_foreign(self, token: str, record_usage: bool) -> KeyRecord:
        """`verify` of a token not in this manager's key format: an imported key's old
        string, or else `MalformedAPIKey`.

        Keys of one old prefix (or digest) in several workspaces are all candidates: each
        is checked, the fast hashes (keys already re-hashed) first, so that the usual
        request of one workspace spends nothing on another's slow hash. A match whose key
        is usable wins; else the first refusal of a matching key (revoked, expired, …)."""
        imported = await self._find_imported(token)
        if imported is None:
            raise MalformedAPIKey()
        unknown_id, candidates = imported
        if not candidates:
            return await self._check(unknown_id, None, token, record_usage)
        fast = self.hasher.is_fast
        ordered = sorted(candidates, key=lambda found: not fast(found[1].secret_hash))
        refusal: KeyRevoked | KeyDisabled | KeyExpired | None = None
        for key_id, stored in ordered:
            try:
                return await self._check(key_id, stored, token, record_usage)
            except InvalidAPIKey:
                continue  # not this candidate's secret
            except (KeyRevoked, KeyDisabled, KeyExpired) as exc:  # its secret, not usable
                refusal = refusal or exc
        raise refusal or InvalidAPIKey()

    async def _verify_key(self, key_id: str, secret: str, record_usage: bool) -> KeyRecord:
        """`verify` of a token of this manager's prefix already split (and its checksum
        checked), from the store."""
        if not self._in_use:
            self._use()
        if self._deliverer is not None:
            self._deliverer.start()  # (again, when the manager moved to another loop)
        stored = await self._load(key_id)
        # The prefix is part of the key: a test key re-prefixed as live is another key.
        # (`prefix[:_PREFIX_END]` is KeyRecord.key_prefix, as in _verify_unusual.)
        if stored is not None and stored.record.prefix[:_PREFIX_END] != self.prefix:
            stored = None
        return await self._check(key_id, stored, secret, record_usage)

    async def _load(self, key_id: str) -> StoredKey | None:
        cache = self.cache
        if cache is None:
            return await self.store.get_for_verification(key_id)
        stored = cache.get(key_id)
        if self.telemetry.active:
            self.telemetry.cache_lookup(stored is not None)
        if stored is None and not cache.missing(key_id):
            stored = await cache.load(key_id)
        return stored

    async def _check(
        self,
        key_id: str,
        stored: StoredKey | None,
        secret: str,
        record_usage: bool,
    ) -> KeyRecord:
        hasher = self.hasher
        if stored is None:
            # Checked against a decoy: the same hash work as a wrong secret for a key that
            # exists, so that the time of a refusal does not tell whether an id exists. An
            # unknown old key string too: an imported key in use has a hash of this kind.
            secret_hash = self._decoy or await self._decoy_hash()
        else:
            secret_hash = stored.secret_hash
        verdict = hasher.verify_fast(secret, secret_hash)
        if verdict is None:
            verdict = await hasher.averify(secret, secret_hash)
        if stored is None or not verdict.ok:
            raise InvalidAPIKey()
        record = stored.record
        check_usable(record)
        if verdict.new_hash is not None or verdict.stale:
            new_hash = verdict.new_hash or await hasher.ahash(secret)
            await self._rehash(key_id, secret_hash, new_hash)
        if record_usage:
            self.usage_buffer.record(key_id)
        return record

    # -- imported keys (apikeys.importing) -------------------------------------------------

    async def _find_imported(
        self, token: str
    ) -> tuple[str, tuple[tuple[str, StoredKey], ...]] | None:
        """The keys an old system's key string may name (one per workspace holding a key of
        its old prefix or digest), with the id that stands for it when there are none, when
        this store holds imported keys and `token` could be one (None: it is simply
        malformed).

        Every id of every lookup handle the token could have is looked up, found or not,
        so the work done does not tell which old prefixes exist
        (`apikeys.importing.foreign`).
        """
        if not is_foreign_token(token, self.prefix):
            return None
        secret = await self._lookup_secret()
        if secret is None:
            return None
        if not self._in_use:
            self._use()
        unknown_id: str | None = None
        candidates: tuple[tuple[str, StoredKey], ...] = ()
        for handle in foreign_handles(token):
            for key_id in lookup_ids(secret, handle):
                stored = await self._load(key_id)
                if stored is not None:
                    candidates += ((key_id, stored),)
                elif unknown_id is None:
                    unknown_id = key_id
        return unknown_id or candidates[0][0], candidates

    async def _lookup_secret(self) -> str | None:
        """`import_lookup_secret(create=False)`, asked again at most once a second while
        the store has none, so that keys imported while the service runs work at once and
        garbage tokens cost the store almost nothing."""
        if self._import_secret is not None:
            return self._import_secret
        now = time.monotonic()
        if now - self._import_checked < _IMPORT_RECHECK:
            return None
        self._import_checked = now
        return await self.import_lookup_secret(create=False)

    async def import_lookup_secret(self, *, create: bool = True) -> str | None:
        """The store's secret for imported keys' ids (`apikeys.importing.foreign`), chosen
        now if it has none and `create` is true. None: the store holds no imported keys (or,
        with `create`, keeps no settings, so it cannot hold any)."""
        if create:
            recorded = await self.store.claim_setting(
                LOOKUP_SETTING, secrets.token_hex(32), replacing=("",)
            )
        else:
            # Claiming "" reads the setting without choosing a secret: importing replaces it.
            recorded = await self.store.claim_setting(LOOKUP_SETTING, "")
        if recorded:
            self._import_secret = recorded
        return recorded or None

    async def _rehash(self, key_id: str, old_hash: str, new_hash: str) -> None:
        try:
            # Announced, not waited for: either hash verifies the same secret.
            # The scheme's name only ("hmac-sha256", "argon2"): never the hash.
            parts = new_hash.split("$")
            scheme = parts[1] if new_hash.startswith("$") and len(parts) > 1 else parts[0]
            event = await self._event("rehashed", key_id, "apikeys", {"scheme": scheme})
            swapped = await self._change(
                key_id,
                lambda notice: self.store.replace_hash(
                    key_id, old_hash, new_hash, notice=notice, event=event
                ),
                wait=False,
            )
            if swapped:
                self._announce(event)
        except Exception as exc:
            # The request was verified; migration simply happens on a later one.
            logger.warning("apikeys: could not re-hash key %s: %s", key_id, type(exc).__name__)


@atexit.register
def _at_exit() -> None:
    """At interpreter exit: warn about each manager left unclosed, and write the usage
    counts still buffered (theirs, and those of unclosed managers already collected).

    Never raises: an exception here would print a traceback.
    """
    try:
        managers = [manager for manager in list(_unclosed) if manager._in_use]
        _unclosed.clear()
        for manager in managers:
            try:
                manager._warn_unclosed()
            except Exception as exc:  # ResourceWarning made an error (-W error)
                logger.warning("apikeys: %s", exc)
        buffers = {id(buffer): buffer for buffer in _orphans}
        buffers.update((id(manager.usage_buffer), manager.usage_buffer) for manager in managers)
        _orphans.clear()
        lost = write_at_exit(buffers.values(), _EXIT_TIMEOUT)
        if lost:
            logger.warning(
                "apikeys: %d request count(s) buffered by an unclosed KeyManager could not "
                "be written at exit (close managers with `await manager.aclose()`)",
                lost,
            )
    except Exception as exc:  # pragma: no cover - a last resort
        logger.warning("apikeys: cleaning up at exit failed: %r", exc)
