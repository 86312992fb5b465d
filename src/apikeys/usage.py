"""Usage accounting off the hot path: count in memory, flush increments in batches.

A request costs one dict update. A background task hands the counts to the store every
`interval` seconds as atomic increments (`KeyStore.add_usage`), so several processes
sharing a store never lose one another's counts. A batch the store refuses goes back into
the buffer and is retried with the next one; `flush()` on shutdown writes what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime

from apikeys.stores.base import KeyStore
from apikeys.types import KeyRecord, UsageDelta

__all__ = ["UsageBuffer"]

logger = logging.getLogger("apikeys")


class UsageBuffer:
    """Per-process buffer of request counts, flushed to a `KeyStore` in the background."""

    def __init__(self, store: KeyStore, interval: float = 1.0) -> None:
        self.store = store
        self.interval = interval
        # key id -> [count, last use as a Unix time]
        self._pending: dict[str, list[float]] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock: asyncio.Lock | None = None

    def record(self, key_id: str) -> None:
        """Count one request of `key_id`, now. Never awaits, never fails."""
        entry = self._pending.get(key_id)
        if entry is None:
            self._pending[key_id] = [1, time.time()]
            self._ensure_task()
        else:
            entry[0] += 1
            entry[1] = time.time()

    def _ensure_task(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no running loop: the next flush() writes it
            return
        task = self._task
        if task is None or task.done() or task.get_loop() is not loop:
            self._task = loop.create_task(self._run())

    async def _run(self) -> None:
        while self._pending:
            await asyncio.sleep(self.interval)
            try:
                await self.flush()
            except Exception as exc:
                # The counts stay buffered and go out with the next batch.
                logger.warning("apikeys: usage flush failed, will retry: %s", type(exc).__name__)

    def pending(self, key_id: str) -> tuple[int, datetime | None]:
        """Requests of `key_id` counted here but not yet written to the store."""
        entry = self._pending.get(key_id)
        if entry is None:
            return 0, None
        return int(entry[0]), datetime.fromtimestamp(entry[1], UTC)

    def apply(self, record: KeyRecord) -> KeyRecord:
        """`record` with this process's unflushed usage added."""
        count, last_used = self.pending(record.id)
        return record.with_usage(count, last_used)

    async def flush(self) -> None:
        """Write the buffered counts now. On failure they stay buffered and this raises."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            batch, self._pending = self._pending, {}
            if not batch:
                return
            try:
                await self.store.add_usage(
                    {
                        key_id: UsageDelta(int(count), datetime.fromtimestamp(last, UTC))
                        for key_id, (count, last) in batch.items()
                    }
                )
            except BaseException:
                for key_id, (count, last) in batch.items():
                    entry = self._pending.setdefault(key_id, [0, last])
                    entry[0] += count
                    entry[1] = max(entry[1], last)
                raise

    async def aclose(self) -> None:
        """Stop the background task and write what is left."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.flush()
