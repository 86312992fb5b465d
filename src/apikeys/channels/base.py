"""What `KeyCache` needs from an invalidation channel: the transport, not the protocol.

A channel carries *notices* (short strings naming a changed key) from the process that changed
a key to every process that may hold it in its cache, and carries acknowledgements back. The
protocol that makes this safe (leases, proofs of freshness, waiting for acknowledgements) lives
in `apikeys.cache`; docs/consistency.md explains it. A channel promises:

- *Probes read the store.* `probe()` returns only after every change committed to the store
  before `probe()` was called, by any writer, has reached `on_notice`: it reads a log the store
  keeps itself (the SQL store's triggers) or the server's own invalidations (Redis client-side
  caching), not merely the notices apikeys writers published. That is what turns a probe into
  a proof of freshness; notices only make a change known sooner.
- *A registry of readers.* `register(ttl)` keeps this process in the list of readers for `ttl`
  seconds of the server's clock; `delivered()` asks for the acknowledgement of every reader
  registered at the time it is called, after the notice was published.
- *Failures are loud.* Any broken connection or timeout raises; the cache then stops trusting
  itself and reads the store.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable

__all__ = ["ALL_KEYS_NOTICE", "STORE_WRITER", "Channel", "ChannelError", "parse_notice"]

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
        """Return once every notice published before this call has reached `on_notice`."""

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
