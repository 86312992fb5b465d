"""How a `KeyManager` is built and closed: from the environment, the pepper check, setup, and
the tracking of managers left unclosed; and the steps every change shares (`_change`).

`ManagerBase` holds this; `apikeys.manager.KeyManager` adds reading, changing and verifying
keys to it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import warnings
import weakref
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, Final, Self, TypeVar

from apikeys.cache import DEFAULT_CACHE_SIZE, DEFAULT_LEASE, KeyCache
from apikeys.errors import (
    ConfigurationError,
    KeyNotFound,
    StoreUnavailable,
)
from apikeys.hashing import UNPEPPERED, Hasher
from apikeys.identities import IdentityRecord
from apikeys.keys import (
    CHECKSUM_LENGTH,
    DEFAULT_PREFIX,
    ID_LENGTH,
    SECRET_LENGTH,
    environments_of,
    prefixes_splitter,
    validate_prefix,
)
from apikeys.ratelimit import RateLimiter
from apikeys.redaction import failure_reason, redact, safe_url
from apikeys.stores.contract import Channel, IdentityStore, KeyStore
from apikeys.stores.registry import store_from_url
from apikeys.telemetry import EventHook, Telemetry
from apikeys.types import (
    AuditAction,
    AuditEvent,
    KeyRecord,
    StoredKey,
    identity_subject,
    jsonable,
    utcnow,
)
from apikeys.usage import UsageBuffer, write_at_exit
from apikeys.webhooks.delivery import Deliverer, DeliveryOptions

__all__ = ["LIMITER_URL_ENV", "STORE_URL_ENV", "ManagerBase"]

logger = logging.getLogger("apikeys")

STORE_URL_ENV: Final = "APIKEYS_STORE_URL"
LIMITER_URL_ENV: Final = "APIKEYS_LIMITER_URL"
"""The variable naming the key store, read by `KeyManager()` without a store and by the CLI."""

_T = TypeVar("_T")

# How long interpreter exit may spend writing the counts of managers left unclosed.
_EXIT_TIMEOUT: Final = 5.0
# Managers that have done work and have not been closed (see `ManagerBase._use`).
_unclosed: weakref.WeakSet[ManagerBase] = weakref.WeakSet()
# The usage buffers of unclosed managers collected with counts unwritten: written at exit.
_orphans: list[UsageBuffer] = []


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


def _records_of(store: KeyStore) -> Callable[[str], Awaitable[KeyRecord | IdentityRecord | None]]:
    """A key's record by its id, or an identity's by `i:<id>`, from `store`: what the
    deliverer reads (a function of the store alone, so that the manager and its deliverer
    make no reference cycle, and an unclosed manager is still collected, and warned about,
    at once)."""
    identity_prefix = identity_subject("")

    async def record(key_id: str) -> KeyRecord | IdentityRecord | None:
        if key_id.startswith(identity_prefix):
            identities = store.identities()
            if identities is None:
                return None
            return await identities.get(key_id[len(identity_prefix) :])
        stored = await store.get(key_id)
        return None if stored is None else stored.record

    return record


class ManagerBase:
    """What every part of a `KeyManager` stands on: its store, hasher, cache, usage buffer,
    telemetry and deliverer, built once, and closed by `aclose`."""

    # Class defaults: `__del__` may run on an instance whose `__init__` raised.
    _in_use = False
    _warned = False
    _deliverer: Deliverer | None = None
    # key id -> (the version of the key last held, its hash's prepared check or None, the
    # checksum of the one token whose secret that check matched, once a request brought it,
    # and the prefix a token of the key has)
    _plain: dict[str, tuple[StoredKey, Callable[[str], bool] | None, str | None, str]]
    _decoy: str | None = None
    _identity_store: IdentityStore | None = None
    _import_secret: str | None = None
    _import_checked = float("-inf")
    _pepper_checked = False

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
        # The prefixes of the tokens it reads, `ak_live`, `ak_test` and the bare `ak` of
        # keys made before environments, each with the environment it names.
        self._environments = environments_of(prefix)
        self._split = prefixes_splitter(self._environments)
        # Where a token has its parts, counted from its end (`{prefix}_{id}_{secret}…`,
        # whatever its prefix), for `verify_now`'s split by position: the `_` after the
        # prefix, the id, the `_` after it, the secret.
        self._secret_at = -(SECRET_LENGTH + CHECKSUM_LENGTH)
        self._id_end = self._secret_at - 1
        self._id_at = self._id_end - ID_LENGTH
        self._prefix_end = self._id_at - 1
        self._plain = {}
        self.telemetry = Telemetry(metrics=metrics, on_event=on_event, store=_kind(self.store))
        self.usage_buffer = UsageBuffer(self.store, usage_flush_interval)
        if self.telemetry.active:
            self.usage_buffer.on_flush_failure = self.telemetry.usage_flush_failed
        # Where the store keeps identities (None: it keeps none), asked once: the request
        # path reads a key's identity from it when there is no key cache.
        self._identity_store = self.store.identities()
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
        self._pepper_checked = True

    async def _check_pepper_once(self) -> None:
        """The pepper check of `setup`, for a manager used without it (a middleware without
        a lifespan): before its first read of the store. A pepper that does not match raises
        `ConfigurationError` (the request path answers 503 and logs why) at every request
        until it does, rather than `invalid_api_key` for every key."""
        await self._check_pepper()
        self._pepper_checked = True

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
