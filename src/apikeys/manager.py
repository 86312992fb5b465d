"""`KeyManager`: create, verify, disable, enable, revoke and roll keys.

The manager is the one place that decides whether a key may be used (`check_usable`) and
the one place that turns a token into a record (`verify`). Stores only keep state.
"""

from __future__ import annotations

import atexit
import logging
import re
import warnings
import weakref
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Final, Self, TypeVar

from apikeys.cache import DEFAULT_CACHE_SIZE, DEFAULT_LEASE, KeyCache
from apikeys.channels.base import Channel
from apikeys.errors import (
    ConfigurationError,
    DuplicateKeyId,
    InvalidAPIKey,
    InvalidKeyParameters,
    InvalidTransition,
    KeyDisabled,
    KeyExpired,
    KeyNotFound,
    KeyRevoked,
)
from apikeys.hashing import Hasher
from apikeys.keys import DEFAULT_PREFIX, generate_key, split_key, validate_prefix
from apikeys.ratelimit import parse_rate_limit
from apikeys.scopes import validate_scopes
from apikeys.stores.base import KeyStore, store_from_url
from apikeys.types import (
    ACTIVE,
    DISABLED,
    REVOKED,
    CreatedKey,
    KeyRecord,
    StoredKey,
    StoredState,
    utcnow,
)
from apikeys.usage import UsageBuffer, write_at_exit

__all__ = ["KeyManager", "check_usable"]

logger = logging.getLogger("apikeys")

_MAX_TEXT = 200
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_INSERT_ATTEMPTS = 5
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


def _channel(channel: Channel | str) -> Channel:
    if isinstance(channel, Channel):
        return channel
    if channel.split("://", 1)[0].lower() in ("redis", "rediss", "unix"):
        try:
            from apikeys.channels.redis import RedisChannel
        except ImportError as exc:
            raise ConfigurationError(
                "the Redis channel needs redis-py. Install it with: pip install 'apikeys[redis]'"
            ) from exc
        return RedisChannel(channel, native=False)
    raise ConfigurationError("channel takes a Channel or a redis:// URL")


def _text(value: str, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidKeyParameters(f"{field} must be a non-empty string")
    if len(value) > _MAX_TEXT or _CONTROL.search(value):
        raise InvalidKeyParameters(
            f"{field} must be at most {_MAX_TEXT} characters, without control characters"
        )
    return value


class KeyManager:
    """Issues and checks API keys held in a `KeyStore`.

    ```python
    manager = KeyManager(store_from_url("sqlite:///apikeys.db"))
    created = await manager.create(name="Zapier", workspace="acme", scopes=["contacts:read"])
    created.key  # the full key: shown here, and never again
    record = await manager.verify(created.key)
    ```

    `store` is a `KeyStore` or a store URL. `hasher` defaults to `Hasher()` (HMAC-SHA256
    keyed with `APIKEYS_PEPPER`). Request counts are buffered and written every
    `usage_flush_interval` seconds; `aclose()` (or leaving `async with`) writes the rest.

    Records are cached in process (`cache`, on by default for SQLite, PostgreSQL and Redis)
    and trusted only while the store's invalidation channel proves them fresh, so `verify`
    needs no store round trip while every change still holds for the very next request in
    every process (docs/consistency.md). `channel` picks another channel: a `Channel`, or a
    `redis://` URL for Redis pub/sub in front of any store. `cache_lease` bounds how long a
    change waits for a process that does not answer (seconds); `cache_size` bounds the
    records kept. `cache=False` reads the store on every verification.

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
    _warned = False

    def __init__(
        self,
        store: KeyStore | str = "memory://",
        *,
        hasher: Hasher | None = None,
        prefix: str = DEFAULT_PREFIX,
        usage_flush_interval: float = 1.0,
        cache: bool = True,
        channel: Channel | str | None = None,
        cache_lease: float = DEFAULT_LEASE,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self.store = store_from_url(store) if isinstance(store, str) else store
        self.hasher = hasher if hasher is not None else Hasher()
        self.prefix = validate_prefix(prefix)
        self.usage = UsageBuffer(self.store, usage_flush_interval)
        self.cache: KeyCache | None = None
        if cache:
            chosen = _channel(channel) if channel is not None else self.store.channel()
            if chosen is not None:
                self.cache = KeyCache(self.store, chosen, lease=cache_lease, max_entries=cache_size)

    def __repr__(self) -> str:
        return f"KeyManager(store={self.store!r}, prefix={self.prefix!r})"

    async def __aenter__(self) -> Self:
        self._use()
        await self.store.setup()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Write buffered usage, stop the cache and close the store."""
        self._release()
        try:
            await self.usage.aclose()
        finally:
            try:
                if self.cache is not None:
                    await self.cache.aclose()
            finally:
                await self.store.aclose()

    async def flush(self) -> None:
        """Write buffered usage counts to the store now."""
        await self.usage.flush()

    # -- lifecycle -------------------------------------------------------------------------

    def _use(self) -> None:
        """Note that this manager has done work: from now on it holds what `aclose` releases
        (connections, a cache, buffered counts), and is warned about if never closed."""
        if not self._in_use:
            self._in_use = True
            _unclosed.add(self)

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
        usage = self.__dict__.get("usage")
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
        expires_at: datetime | None = None,
        expires_in: timedelta | None = None,
    ) -> CreatedKey:
        """Create a key. The returned `CreatedKey.key` is the only time the key is shown.

        A key has `full_access` (every scope, including scopes added later) or the given
        `scopes`; a restricted key without scopes is refused. `rate_limit` overrides the
        middleware's default (`limits` notation). Expiry is `expires_at` or `expires_in`.
        """
        _text(name, "name")
        _text(workspace, "workspace")
        scope_tuple = validate_scopes(scopes)
        if full_access and scope_tuple:
            raise InvalidKeyParameters("a full-access key takes no scopes")
        if not full_access and not scope_tuple:
            raise InvalidKeyParameters(
                "a restricted key needs at least one scope (or pass full_access=True)"
            )
        if rate_limit is not None:
            parse_rate_limit(rate_limit)
        now = utcnow()
        expiry = self._expiry(now, expires_at, expires_in)
        return await self._issue(
            name=name,
            workspace=workspace,
            access="full" if full_access else "restricted",
            scopes=scope_tuple,
            rate_limit=rate_limit,
            created_at=now,
            expires_at=expiry,
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
            )
            try:
                secret_hash = await self.hasher.ahash(parsed.secret)
                await self.store.insert(StoredKey(record, secret_hash))
            except DuplicateKeyId:
                continue
            return CreatedKey(parsed.token, record)
        raise DuplicateKeyId("could not find a free key id")  # pragma: no cover

    async def _change(
        self, key_id: str, apply: Callable[[str | None], Awaitable[_T]], *, wait: bool = True
    ) -> _T:
        """Make a change to `key_id` that every process sees on its next request.

        `apply(notice)` changes the store, publishing `notice` in its transaction. With a
        cache, this returns once every process caching keys has dropped the key (or a lease
        has passed): see `KeyCache.change`.
        """
        self._use()
        if self.cache is None:
            return await apply(None)
        return await self.cache.change(key_id, apply, wait=wait)

    # -- reading ---------------------------------------------------------------------------

    async def get(self, key_id: str) -> KeyRecord:
        """The record of `key_id`, with this process's unflushed usage. Raises `KeyNotFound`."""
        self._use()
        stored = await self.store.get(key_id)
        if stored is None:
            raise KeyNotFound(key_id)
        return self.usage.apply(stored.record)

    async def list(self, workspace: str | None = None) -> list[KeyRecord]:
        """The records of `workspace` (or of all workspaces), oldest first."""
        self._use()
        return [self.usage.apply(record) for record in await self.store.list(workspace)]

    # -- state changes ---------------------------------------------------------------------

    async def disable(self, key_id: str) -> KeyRecord:
        """Stop a key from authenticating until `enable`. Refused for a revoked key."""
        return await self._transition(key_id, DISABLED, (ACTIVE,), "disable")

    async def enable(self, key_id: str) -> KeyRecord:
        """Let a disabled key authenticate again. Refused for a revoked key."""
        return await self._transition(key_id, ACTIVE, (DISABLED,), "enable")

    async def revoke(self, key_id: str) -> KeyRecord:
        """Revoke a key for good: every later request with it gets 401 `key_revoked`."""
        return await self._transition(key_id, REVOKED, (ACTIVE, DISABLED), "revoke")

    async def _transition(
        self,
        key_id: str,
        target: StoredState,
        allowed_from: tuple[StoredState, ...],
        action: str,
    ) -> KeyRecord:
        record = await self._change(
            key_id,
            lambda notice: self.store.set_state(
                key_id, target, allowed_from=allowed_from, at=utcnow(), notice=notice
            ),
        )
        if record.state != target:
            raise InvalidTransition(key_id, record.status, action)
        return self.usage.apply(record)

    async def update(
        self,
        key_id: str,
        *,
        name: str | None = None,
        scopes: Iterable[str] | None = None,
        full_access: bool | None = None,
        rate_limit: str | _Unset | None = UNSET,
        expires_at: datetime | _Unset | None = UNSET,
        expires_in: timedelta | None = None,
    ) -> KeyRecord:
        """Edit a key: its name, access and scopes, rate limit or expiry. Refused when revoked.

        Only what is given changes. `scopes=[…]` makes the key restricted to those scopes;
        `full_access=True` gives it every scope; `rate_limit=None` returns it to the
        middleware's default and `expires_at=None` makes it never expire (`expires_in` sets
        an expiry from now). Like `revoke`, it returns once every process that caches keys
        has dropped the old record: a narrowed key is narrowed on its very next request.
        """
        changes: dict[str, object] = {}
        if name is not None:
            changes["name"] = _text(name, "name")
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
        if not isinstance(rate_limit, _Unset):
            if rate_limit is not None:
                parse_rate_limit(rate_limit)
            changes["rate_limit"] = rate_limit
        if expires_in is not None or not isinstance(expires_at, _Unset):
            given = None if isinstance(expires_at, _Unset) else expires_at
            if given is None and expires_in is None:
                changes["expires_at"] = None
            else:
                changes["expires_at"] = self._expiry(utcnow(), given, expires_in)
        record = await self._change(
            key_id, lambda notice: self.store.update(key_id, changes, notice=notice)
        )
        if record.state == REVOKED:
            raise InvalidTransition(key_id, REVOKED, "update")
        return self.usage.apply(record)

    async def roll(
        self,
        key_id: str,
        grace: timedelta = timedelta(hours=24),
        *,
        expires_in: timedelta | None = None,
    ) -> CreatedKey:
        """Replace a key with a new one of the same name, workspace, access, scopes and limit.

        The old key keeps working for `grace`, then expires (an earlier expiry stays). The
        new key keeps the old one's lifetime: it expires as long after now as the old one
        did after its creation (a key that never expired gives one that never does), unless
        `expires_in` says otherwise. Refused for a revoked key.
        """
        if grace < timedelta(0):
            raise InvalidKeyParameters("grace must not be negative")
        self._use()
        stored = await self.store.get(key_id)
        if stored is None:
            raise KeyNotFound(key_id)
        old = stored.record
        if old.state == REVOKED:
            raise InvalidTransition(key_id, REVOKED, "roll")
        now = utcnow()
        if expires_in is None and old.expires_at is not None:
            # The same lifetime as the key it replaces, from now (at least a second).
            expires_in = max(old.expires_at - old.created_at, timedelta(seconds=1))
        created = await self._issue(
            name=old.name,
            workspace=old.workspace,
            access=old.access,
            scopes=old.scopes,
            rate_limit=old.rate_limit,
            created_at=now,
            expires_at=self._expiry(now, None, expires_in),
            replaces=key_id,
        )
        # The new key exists before the old one is cut short: a failure here never leaves
        # the integration without a working key.
        new_id = created.record.id
        old = await self._change(
            key_id,
            lambda notice: self.store.shorten_expiry(
                key_id, now + grace, replaced_by=new_id, notice=notice
            ),
        )
        if old.state == REVOKED:
            # Revoked elsewhere while the new key was being issued: revocation wins.
            await self._change(
                new_id,
                lambda notice: self.store.set_state(
                    new_id, REVOKED, allowed_from=(ACTIVE, DISABLED), at=utcnow(), notice=notice
                ),
            )
            raise InvalidTransition(key_id, REVOKED, "roll")
        return created

    # -- verification ----------------------------------------------------------------------

    async def verify(self, token: str, *, record_usage: bool = True) -> KeyRecord:
        """The record of the key `token` names, if it may be used now; else raise.

        Raises `MalformedAPIKey` (before any store access), `InvalidAPIKey`, `KeyDisabled`,
        `KeyRevoked`, `KeyExpired` or `StoreUnavailable`. Never returns an unusable key.
        Counts the request in the key's usage unless `record_usage` is false.
        """
        prefix, key_id, secret = split_key(token, self.prefix)
        if not self._in_use:
            self._use()
        cache = self.cache
        if cache is None:
            stored = await self.store.get(key_id)
        else:
            stored = cache.get(key_id) or await cache.load(key_id)
        # The prefix is part of the key: a test key re-prefixed as live is another key.
        if stored is None or stored.record.key_prefix != prefix:
            raise InvalidAPIKey()
        secret_hash = stored.secret_hash
        hasher = self.hasher
        if hasher.is_fast(secret_hash):
            verdict = hasher.verify(secret, secret_hash)
        else:
            verdict = await hasher.averify(secret, secret_hash)
        if not verdict.ok:
            raise InvalidAPIKey()
        record = stored.record
        check_usable(record)
        if verdict.new_hash is not None or verdict.stale:
            new_hash = verdict.new_hash or await hasher.ahash(secret)
            await self._rehash(key_id, secret_hash, new_hash)
        if record_usage:
            self.usage.record(key_id)
        return record

    async def _rehash(self, key_id: str, old_hash: str, new_hash: str) -> None:
        try:
            # Announced, not waited for: either hash verifies the same secret.
            await self._change(
                key_id,
                lambda notice: self.store.replace_hash(key_id, old_hash, new_hash, notice=notice),
                wait=False,
            )
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
        buffers.update((id(manager.usage), manager.usage) for manager in managers)
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
