"""`KeyCache`: key records kept in process, trusted only while provably fresh.

This module is the whole coherence protocol; docs/consistency.md states it with its proofs and
its failure table. In short, with `lease` L (1 s by default):

- **Readers.** A process serves a record from its cache only while it holds a *proof* younger
  than L: the start time of the last probe round that completed. A round (1) keeps the process
  in the channel's registry of readers for 3 L, (2) notes the time t0, (3) probes the channel:
  the probe returns only after every notice published before it has been applied. So every
  change published before t0 has been applied, and the proof is valid until t0 + L. Rounds run
  every L/4 (or the channel's poll interval). Any failure forgets the proof at once: the next
  request reads the store, as if there were no cache.
- **Notices.** Every change to a key publishes a notice naming it (in the change's own
  transaction when the channel is the store's own). A reader that receives one drops the
  entry, bumps its epoch and acknowledges the notice to its writer.
- **Writers.** A change returns only when every reader registered after the notice was
  published has acknowledged it, or when L (plus a margin for clock rates) has passed since
  publication, whichever comes first. A reader that did not acknowledge may still serve from
  its cache only on a proof older than the publication, and that proof runs out before the
  writer returns.
- **Fills.** A record read from the store is cached only if no notice (nor a reconnection, nor
  a lapse of the proof) arrived while it was read: the epoch is compared around the read;
  and only if the store will not change it unannounced (`KeyStore.get_to_cache`).
- **Reconnections.** A connection delivers every notice in order for as long as it lasts, so
  a proof that merely ran out (a slow probe) needs only a new probe; when the channel
  reconnects, notices may have been missed, and the whole cache is dropped.

Entries are `StoredKey`s (a record and the stored hash, never a secret), bounded by
`max_entries` in least-recently-used order. Identities (`apikeys.identities`) are entries of
the same cache under the name `i:<id>` (no key id holds `:`): the stores' notices of an
identity's change name it so, and the same fill rule holds for them (`hit_identity`,
`load_identity`). Expiry, grace periods and every other per-request
decision are made from the record at each request, as without a cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final, TypeVar

from apikeys.bounded import remember_recent
from apikeys.errors import ChangeNotConfirmed
from apikeys.stores.contract import STORE_WRITER, Channel, KeyStore, parse_notice
from apikeys.tasks import started
from apikeys.types import StoredKey, identity_subject

if TYPE_CHECKING:
    from apikeys.identities import IdentityRecord

__all__ = ["DEFAULT_CACHE_SIZE", "DEFAULT_LEASE", "KeyCache", "clock"]

logger = logging.getLogger("apikeys")

_T = TypeVar("_T")

DEFAULT_LEASE: Final = 1.0
"""Seconds a proof of freshness is trusted; a change waits at most about this long."""
DEFAULT_CACHE_SIZE: Final = 100_000
"""Records a process keeps at most (least recently used go first)."""

# Clocks may run at slightly different rates: a writer waits this much longer than a lease.
CLOCK_RATE_MARGIN: Final = 0.05
_WAIT_EXTRA: Final = 0.01
_RECONNECT_DELAY: Final = 0.5
# A connection whose probes time out this many times in a row is taken for dead.
_SLOW_PROBES_BEFORE_RECONNECT: Final = 3
_NEVER: Final = float("-inf")
_MAX_MISSING: Final = 10_000


def _clock_function() -> Callable[[], float]:
    # CLOCK_BOOTTIME keeps counting while the machine sleeps, unlike CLOCK_MONOTONIC: a
    # suspended host must not come back believing its proof is still young.
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is None:  # pragma: no cover - not Linux
        return time.monotonic

    def boot_clock() -> float:
        return time.clock_gettime(boottime)

    return boot_clock


clock: Final = _clock_function()


"""The protocol's clock, in seconds: monotonic, and counting while the machine sleeps."""


class KeyCache:
    """A coherent cache of one store's key records for one process (see the module doc).

    `KeyManager` makes one for every store that has an invalidation channel; use it through
    the manager. `autostart=False` leaves probing to the caller (`await refresh()`), which the
    protocol's tests use to play every interleaving with a clock of their own.
    """

    def __init__(
        self,
        store: KeyStore,
        channel: Channel,
        *,
        lease: float = DEFAULT_LEASE,
        max_entries: int = DEFAULT_CACHE_SIZE,
        clock: Callable[[], float] = clock,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        autostart: bool = True,
    ) -> None:
        if lease <= 0:
            raise ValueError("lease must be positive")
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.store = store
        self.channel = channel
        self.lease = lease
        self.max_entries = max_entries
        self.ident = secrets.token_hex(8)
        channel.ident = self.ident
        self._clock = clock
        self._sleep = sleep
        self._autostart = autostart
        # Key ids -> `StoredKey`; `i:<identity id>` -> `IdentityRecord`.
        self._entries: OrderedDict[str, StoredKey | IdentityRecord] = OrderedDict()
        # Ids the store did not have: a request with an unknown id costs no store read
        # either. Kept apart (and smaller), so unknown ids never push out real records.
        self._missing: OrderedDict[str, None] = OrderedDict()
        self.max_missing = min(max_entries, _MAX_MISSING)
        self._epoch = 0
        self._proof_at = _NEVER
        self._registered_until = _NEVER
        self._serving = False  # a reader (registers) once `get` has been asked
        self._connected = False
        self._sequence = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._task_loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self._closed = False
        self.hits = 0
        self.misses = 0

    def __repr__(self) -> str:
        return (
            f"KeyCache(channel={type(self.channel).__name__}, entries={len(self._entries)}, "
            f"fresh={self.fresh})"
        )

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def fresh(self) -> bool:
        """True while the cache may answer (its proof of freshness is younger than a lease)."""
        return self._clock() - self._proof_at < self.lease

    # -- the hot path --------------------------------------------------------------------

    def get(self, key_id: str) -> StoredKey | None:
        """The cached record of `key_id` if the cache is provably fresh, else None."""
        if self._clock() - self._proof_at >= self.lease:
            # Not proven fresh: (re)start probing, e.g. on a new event loop, and read the store.
            self._serving = True
            self._start()
            self.misses += 1
            return None
        entries = self._entries
        stored = entries.get(key_id)
        if stored is None:
            self.misses += 1
            return None
        entries.move_to_end(key_id)
        self.hits += 1
        return stored  # type: ignore[return-value]  # a key id names a StoredKey

    def hit(self, key_id: str) -> StoredKey | None:
        """`get` that counts and starts nothing on a miss: the cached record of `key_id` if
        the cache is provably fresh, else None (and then `get` is asked, as usual)."""
        if self._clock() - self._proof_at >= self.lease:
            return None
        entries = self._entries
        stored = entries.get(key_id)
        if stored is not None:
            entries.move_to_end(key_id)
            self.hits += 1
        return stored  # type: ignore[return-value]  # a key id names a StoredKey

    def missing(self, key_id: str) -> bool:
        """True if the store provably has no key `key_id` (a fresh proof covers its absence).

        A key made since is logged by the store like any change, so its creation drops the
        id from here as a change drops a record.
        """
        return key_id in self._missing and self._clock() - self._proof_at < self.lease

    async def load(self, key_id: str) -> StoredKey | None:
        """Read `key_id` from the store and keep it (or that it is missing), unless a notice
        raced with the read, or the store says it will change the key unannounced (a Redis
        hash with a TTL: its expiry is announced only once Redis gets round to deleting it)."""
        epoch = self._epoch
        stored, keep = await self.store.get_to_cache(key_id)
        if keep and epoch == self._epoch and not self._closed:
            if stored is not None:
                remember_recent(self._entries, key_id, stored, self.max_entries)
            else:
                remember_recent(self._missing, key_id, None, self.max_missing)
        return stored

    # -- identities (entries named `i:<id>`) ------------------------------------------------

    def hit_identity(self, identity_id: str) -> IdentityRecord | None:
        """The cached identity `identity_id` if the cache is provably fresh, else None (as
        `hit`: nothing counted or started on a miss)."""
        if self._clock() - self._proof_at >= self.lease:
            return None
        subject = "i:" + identity_id  # identity_subject, written out: on the request path
        entries = self._entries
        found = entries.get(subject)
        if found is not None:
            entries.move_to_end(subject)
        return found  # type: ignore[return-value]  # `i:<id>` names an IdentityRecord

    def missing_identity(self, identity_id: str) -> bool:
        """True if the store provably has no identity `identity_id` (as `missing`)."""
        return self.missing(identity_subject(identity_id))

    async def load_identity(self, identity_id: str) -> IdentityRecord | None:
        """Read identity `identity_id` from the store (`IdentityStore.get_to_cache`) and
        keep it, or that it is missing, under the fill rule of `load`. Starts probing when
        the cache is not proven fresh (as `get`). None: there is no such identity."""
        if self._clock() - self._proof_at >= self.lease:
            self._serving = True
            self._start()
        identities = self.store.identities()
        if identities is None:
            return None
        subject = identity_subject(identity_id)
        epoch = self._epoch
        found, keep = await identities.get_to_cache(identity_id)
        if keep and epoch == self._epoch and not self._closed:
            if found is not None:
                remember_recent(self._entries, subject, found, self.max_entries)
            else:
                remember_recent(self._missing, subject, None, self.max_missing)
        return found

    # -- changes -------------------------------------------------------------------------

    async def change(
        self, key_id: str, apply: Callable[[str | None], Awaitable[_T]], *, wait: bool = True
    ) -> _T:
        """Run `apply(notice)` (the store's change), announce it, and wait until it holds.

        A native channel's notice is published by the store inside `apply`'s transaction;
        otherwise it is published once `apply` has returned. With `wait`, this returns once
        every registered reader has acknowledged the notice, or a lease after publication.
        """
        channel = self.channel
        notice = f"{self.ident}:{next(self._sequence)}:{key_id}"
        if wait:
            await self._await_connection()
            channel.expect(notice)
        unconfirmed: ChangeNotConfirmed | None = None
        try:
            try:
                result = await apply(notice if channel.native else None)
            except ChangeNotConfirmed as exc:
                # Committed all the same (only its replication is unconfirmed): announce it and
                # wait as for any change, then say so.
                unconfirmed = exc
            if not channel.native:
                await channel.publish(notice)
            published = self._clock()
            self._drop(key_id)
            if wait:
                await self._await_delivery(notice, published)
        finally:
            channel.forget(notice)
        if unconfirmed is not None:
            raise unconfirmed
        return result

    async def _await_delivery(self, notice: str, published: float) -> None:
        deadline = published + self.lease * (1 + CLOCK_RATE_MARGIN) + _WAIT_EXTRA
        # Without every acknowledgement (or without a channel), the deadline: every proof
        # that predates the notice has run out by then.
        timer = asyncio.ensure_future(self._sleep(max(0.0, deadline - self._clock())))
        if not self._connected:
            await timer
            return
        # Left behind by the timer, it may yet fail (the notice forgotten meanwhile).
        acknowledged = started(self.channel.delivered(notice))
        try:
            await asyncio.wait({timer, acknowledged}, return_when=asyncio.FIRST_COMPLETED)
            if acknowledged.done() and acknowledged.exception() is None:
                return
            await timer
        finally:
            for waiter in (timer, acknowledged):
                waiter.cancel()

    async def _await_connection(self) -> None:
        if not self._autostart:
            return
        self._start()
        ready = self._ready
        if ready is not None and not ready.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.lease):
                    await ready.wait()

    # -- notices and rounds --------------------------------------------------------------

    def _drop(self, key_id: str) -> None:
        self._epoch += 1
        self._entries.pop(key_id, None)
        self._missing.pop(key_id, None)

    def _clear(self) -> None:
        self._epoch += 1
        self._entries.clear()
        self._missing.clear()

    def on_notice(self, notice: str) -> None:
        """Apply a notice from the channel: drop the key (or all), then acknowledge it."""
        writer, key_id = parse_notice(notice)
        if key_id == "*":
            self._clear()
        else:
            self._drop(key_id)
        if writer != self.ident and writer != STORE_WRITER:
            task = asyncio.get_running_loop().create_task(self._ack(notice))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _ack(self, notice: str) -> None:
        try:
            await self.channel.ack(notice)
        except Exception as exc:
            # The writer then waits out a lease instead: slower, never unsafe.
            logger.debug("apikeys: could not acknowledge a notice: %s", type(exc).__name__)

    async def connect(self) -> None:
        """Open the channel and start afresh: whatever was cached may have missed notices."""
        self.channel.bind()
        await self.channel.connect(self.ident, self.on_notice)
        self._clear()
        self._connected = True

    def lost(self) -> None:
        """The channel broke: stop trusting the cache at once."""
        self._proof_at = _NEVER
        self._registered_until = _NEVER
        self._connected = False

    async def refresh(self) -> None:
        """One probe round: renew the registration if due, probe, and take the proof."""
        now = self._clock()
        if self._serving and self._registered_until - now < 2 * self.lease:
            await self.channel.register(3 * self.lease)
            self._registered_until = now + 3 * self.lease
        started = self._clock()
        await self.channel.probe()
        if started + self.lease <= self._registered_until and started > self._proof_at:
            self._proof_at = started

    # -- the background task -------------------------------------------------------------

    def _start(self) -> None:
        if not self._autostart or self._closed:
            return
        loop = asyncio.get_running_loop()
        task = self._task
        if task is not None and not task.done() and self._task_loop is loop:
            return
        self.lost()
        self._ready = asyncio.Event()
        self._task_loop = loop
        self._task = loop.create_task(self._run(), name="apikeys-key-cache")

    async def _run(self) -> None:
        interval = self.channel.poll_interval or self.lease / 4
        failures = 0
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation
        # that arrives as its work completes, and this task must stop when cancelled.
        while not self._closed:
            try:
                async with asyncio.timeout(self.lease):
                    await self.connect()
                if self._ready is not None:
                    self._ready.set()
                slow = 0
                # `_closed` is checked as well as the cancellation `aclose` sends: a client
                # library may swallow a cancellation (redis-py can, in a command answered as
                # it is cancelled), and `aclose` waits for this task to end.
                while not self._closed:
                    if not self._serving:
                        # A writer that serves nothing (`cache=False`) needs the connection
                        # for acknowledgements only: no registration, and a probe now and
                        # then, only to find out that the connection died.
                        await asyncio.sleep(self.lease)
                        async with asyncio.timeout(self.lease):
                            await self.channel.probe()
                        continue
                    try:
                        async with asyncio.timeout(self.lease / 2):
                            await self.refresh()
                        slow = 0
                    except TimeoutError:
                        # Slow is not broken (a loaded server, a busy event loop): stop
                        # trusting the cache at once, keep the connection, probe again.
                        self._proof_at = _NEVER
                        slow += 1
                        if slow >= _SLOW_PROBES_BEFORE_RECONNECT:
                            raise
                    failures = 0
                    await asyncio.sleep(interval)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.lost()
                failures += 1
                log = logger.warning if failures == 1 else logger.debug
                log(
                    "apikeys: the key cache's channel failed (%s); reading the store until it "
                    "is back",
                    type(exc).__name__,
                )
            finally:
                self.lost()
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2.0):
                        await self.channel.disconnect()
            if self._ready is not None:
                self._ready.set()  # writers stop waiting for a connection: they wait a lease
            await asyncio.sleep(min(_RECONNECT_DELAY * failures, 5.0))

    async def aclose(self) -> None:
        """Stop probing, leave the registry and drop every entry."""
        self._closed = True
        self.lost()
        self._clear()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            if self._task_loop is asyncio.get_running_loop():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        for pending in list(self._pending):
            pending.cancel()
