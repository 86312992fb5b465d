"""Usage accounting off the hot path: count in memory, flush increments in batches.

A request costs one dict update. A background task hands the counts to the store every
`interval` seconds as atomic increments (`KeyStore.add_usage`), so several processes
sharing a store never lose one another's counts.

Delivery is exactly once. Each flush seals the counts gathered so far into a batch with a
random id (a uuid4 hex) and sends it. A batch whose write failed, or whose outcome is
unknown (a timeout, a connection lost before the answer, a cancelled flush), is kept as it
is, with the same id and the same counts, never merged with newer ones, and sent again at
the next flush. The store skips a batch id it has applied before (for
`USAGE_BATCH_RETENTION`, 24 hours), so a retry after a lost answer is not counted twice.
Newer requests go on being counted in the open accumulator meanwhile.

A failed batch holds no other: each flush sends every kept batch on its own, then seals
the counts of the keys that no kept batch holds (a key's newer counts wait in the
accumulator until its kept batch is written, so each key is in one kept batch at most).
Where the store applies each key's share of a batch on its own (`KeyStore.usage_per_key`:
a Redis Cluster, where one key's slot may fail while the others answer), a failed batch
is kept split by key, under its id: one key that cannot be written holds no other key's
counts. What is still not written when the buffer is closed is logged, with its counts.

Nothing cancels a write in flight: the store call runs shielded, so a cancelled `flush()`
leaves its batch queued (with its id) while the write goes on, and `aclose()` waits for the
background task to finish the flush it is in, then writes what is left.

At interpreter exit, the counts of managers that were never closed are written by
`write_at_exit`, on an event loop of its own, within a time limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, ParamSpec, TypeVar

from apikeys.stores.contract import KeyStore
from apikeys.stores.shared import ADMITTED
from apikeys.types import KeyRecord, UsageDelta

__all__ = ["UsageBuffer", "write_at_exit"]

logger = logging.getLogger("apikeys")

_P = ParamSpec("_P")
_T = TypeVar("_T")


class _Batch:
    """Counts sealed under one id: sent, and if need be sent again, exactly as they are."""

    __slots__ = ("attempt", "id", "usage")

    def __init__(self, usage: dict[str, UsageDelta], batch_id: str | None = None) -> None:
        self.id = batch_id or uuid.uuid4().hex
        self.usage = usage
        # The latest store call for this batch: a retry waits for one still running.
        self.attempt: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"_Batch(id={self.id!r}, keys={len(self.usage)})"


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark an attempt's outcome as seen (the batch stays queued until one succeeds)."""
    if not task.cancelled():
        task.exception()


class UsageBuffer:
    """Per-process buffer of request counts, flushed to a `KeyStore` in the background.

    `pending` and `apply` count every request this process has not yet seen confirmed by
    the store: the open accumulator, and batches waiting to be sent again or in flight. A
    batch the store has applied but whose answer has not arrived yet (or was lost, until
    its retry) is therefore added twice for that moment; no request is ever left out.
    """

    def __init__(self, store: KeyStore, interval: float = 1.0) -> None:
        self.store = store
        self.interval = interval
        # Counted since the last batch was sealed: key id -> [count, last use as Unix time,
        # {(UTC day, outcome): count}].
        self._open: dict[str, list[Any]] = {}
        self._day = ""
        self._day_ends = 0.0  # Unix time at which `_day` ends
        self._next_tick = 0.0  # Unix time of `record`'s next `_tick`
        self._admitted = ("", ADMITTED)  # (`_day`, ADMITTED): the slot of today's requests
        # Sealed batches not yet confirmed written, oldest first. A key's counts in the
        # open accumulator are sealed only once no batch here holds the key.
        self._queue: deque[_Batch] = deque()
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        # Serialises flushes; one per event loop (a manager may outlive the loop it ran on).
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._closing = False
        # Told of each background flush that failed (its batch is retried): for metrics.
        self.on_flush_failure: Callable[[BaseException], None] | None = None
        # Called by `record` once per `interval` while requests are counted, on the loop
        # they are counted on: the manager starts its webhook deliverer there again, when
        # it was used on another loop before (`_tick`).
        self.on_tick: Callable[[], None] | None = None

    def _today(self, now: float) -> str:
        """The UTC day of `now`, "YYYY-MM-DD": worked out once a day, not per request."""
        if now >= self._day_ends:
            day = datetime.fromtimestamp(now, UTC).date()
            self._day = day.isoformat()
            self._admitted = (self._day, ADMITTED)
            self._day_ends = datetime.combine(
                day + timedelta(days=1), datetime.min.time(), UTC
            ).timestamp()
        return self._day

    def record(self, key_id: str) -> None:
        """Count one request of `key_id`, now, as admitted. Never awaits, never fails."""
        now = time.time()
        slot = self._admitted if now < self._next_tick else self._tick(now)
        entry = self._open.get(key_id)
        if entry is None:
            self._open[key_id] = [1, now, {slot: 1}]
            self._ensure_task()
        else:
            entry[0] += 1
            entry[1] = now
            daily = entry[2]
            daily[slot] = daily.get(slot, 0) + 1

    def _tick(self, now: float) -> tuple[str, str]:
        """`record`'s work once per `interval`, and when a UTC day starts: today's slot,
        and the background task on this loop. A manager may be used on a loop after its
        first one closed (a key issued under `asyncio.run`, then a server; a test client
        per test): a key counted there before has its entry already, so the first count
        on the new loop would otherwise start no task, and nothing would be written.

        Folded into the day's end (one comparison per request, as before)."""
        self._today(now)
        self._next_tick = min(self._day_ends, now + self.interval)
        self._ensure_task()
        if self.on_tick is not None:
            self.on_tick()
        return self._admitted

    def refused(self, key_id: str, code: str) -> None:
        """Count the request of `key_id` just recorded as refused with `code` (its scope, a
        rate limit, its credits, its address) in the daily history, not as admitted."""
        day = self._today(time.time())
        entry = self._open.get(key_id)
        if entry is None:  # sealed into a batch meanwhile: correct it in the next one
            entry = self._open[key_id] = [0, time.time(), {}]
            self._ensure_task()
        daily = entry[2]
        daily[(day, ADMITTED)] = daily.get((day, ADMITTED), 0) - 1
        daily[(day, code)] = daily.get((day, code), 0) + 1

    def count(self, key_id: str, outcome: str) -> None:
        """Count `outcome` for `key_id` today, besides the request's own outcome: how many
        of its requests were of a kind (`LEGACY_SCHEME`). Leaves the request count alone."""
        day = self._today(time.time())
        entry = self._open.get(key_id)
        if entry is None:
            entry = self._open[key_id] = [0, time.time(), {}]
            self._ensure_task()
        daily = entry[2]
        daily[(day, outcome)] = daily.get((day, outcome), 0) + 1

    def pending_daily(self, key_id: str) -> dict[tuple[str, str], int]:
        """`key_id`'s daily counts not yet confirmed written, by (day, outcome)."""
        found: dict[tuple[str, str], int] = {}
        entry = self._open.get(key_id)
        parts = [entry[2]] if entry is not None else []
        parts += [batch.usage[key_id].daily for batch in self._queue if key_id in batch.usage]
        for daily in parts:
            for slot, count in daily.items():
                found[slot] = found.get(slot, 0) + count
        return found

    def _has_pending(self) -> bool:
        return bool(self._open or self._queue)

    def unwritten(self) -> int:
        """How many requests were counted here and are not yet confirmed written."""
        count = sum(int(entry[0]) for entry in self._open.values())
        return count + sum(delta.count for batch in self._queue for delta in batch.usage.values())

    def describe_unwritten(self) -> str:
        """What is not yet confirmed written, for a log line: `N request(s) of K key(s)`."""
        keys = set(self._open).union(*(batch.usage for batch in self._queue))
        return f"{self.unwritten()} request(s) of {len(keys)} key(s)"

    def _busy_elsewhere(self) -> bool:
        """True while the background task lives on an event loop that is running (in
        another thread): its counts are that loop's to write."""
        task = self._task
        return task is not None and not task.done() and task.get_loop().is_running()

    def _ensure_task(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no running loop: the next flush() writes it
            return
        task = self._task
        if task is None or task.done() or task.get_loop() is not loop:
            self._wake = wake = asyncio.Event()
            self._task = loop.create_task(self._run(wake))

    async def _run(self, wake: asyncio.Event) -> None:
        while self._has_pending() and not self._closing:
            # Sleep `interval`, or less if `aclose()` wakes us: it writes what is left.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), self.interval)
            if wake.is_set():  # closing
                return
            try:
                await self.flush()
            except Exception as exc:
                # The batch stays queued, with its id, and goes out first next time.
                logger.warning("apikeys: usage flush failed, will retry: %s", type(exc).__name__)
                if self.on_flush_failure is not None:
                    self.on_flush_failure(exc)

    def pending(self, key_id: str) -> tuple[int, datetime | None]:
        """Requests of `key_id` counted here but not yet confirmed written to the store."""
        count = 0
        last: float | None = None
        entry = self._open.get(key_id)
        if entry is not None:
            count, last = int(entry[0]), entry[1]
        for batch in self._queue:
            delta = batch.usage.get(key_id)
            if delta is not None:
                count += delta.count
                moment = delta.last_used_at.timestamp()
                last = moment if last is None else max(last, moment)
        if not count or last is None:
            return 0, None
        return count, datetime.fromtimestamp(last, UTC)

    def apply(self, record: KeyRecord) -> KeyRecord:
        """`record` with this process's unconfirmed usage added."""
        count, last_used = self.pending(record.id)
        return record.with_usage(count, last_used)

    async def flush(self) -> None:
        """Write the buffered counts now: each batch left by a failed write, on its own,
        then the counts gathered since of the keys those batches do not hold. A batch that
        fails stays queued as it is, with its id (split by key, where the store allows it),
        without holding the others; then this raises the first failure."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[0] is not loop:
            self._lock = (loop, asyncio.Lock())
        async with self._lock[1]:
            failures = [
                failure for batch in list(self._queue) if (failure := await self._try(batch))
            ]
            held = {key_id for batch in self._queue for key_id in batch.usage}
            sealed = {key_id: entry for key_id, entry in self._open.items() if key_id not in held}
            if sealed:
                for key_id in sealed:
                    del self._open[key_id]
                batch = _Batch(
                    {
                        key_id: UsageDelta(
                            int(count),
                            datetime.fromtimestamp(last, UTC),
                            {slot: n for slot, n in daily.items() if n},
                        )
                        for key_id, (count, last, daily) in sealed.items()
                    }
                )
                self._queue.append(batch)
                failure = await self._try(batch)
                if failure is not None:
                    failures.append(failure)
            if failures:
                raise failures[0]

    async def _try(self, batch: _Batch) -> Exception | None:
        """Send `batch`; forget it once applied, else keep it (split by key where the store
        applies keys on their own) and return the failure."""
        try:
            await self._send(batch)
        except Exception as exc:
            if self.store.usage_per_key and len(batch.usage) > 1:
                at = self._queue.index(batch)
                self._queue.remove(batch)
                for key_id, delta in reversed(batch.usage.items()):
                    self._queue.insert(at, _Batch({key_id: delta}, batch.id))
            return exc
        self._queue.remove(batch)
        return None

    async def _send(self, batch: _Batch) -> None:
        """Have the store apply `batch`; return once it has, raise if that is not known.

        The store call runs in a task of its own, shielded: cancelling the caller never
        interrupts a write half-way, and the batch stays queued. A later send waits for an
        attempt still running on this loop and, if it succeeded, sends nothing more;
        otherwise it sends the batch again under the same id, which the store skips if an
        earlier attempt was applied after all.
        """
        loop = asyncio.get_running_loop()
        attempt = batch.attempt
        if attempt is not None and attempt.get_loop() is loop:
            if not attempt.done():
                await asyncio.wait([attempt])  # never cancels it, even if we are cancelled
            if not attempt.cancelled() and attempt.exception() is None:
                return
        attempt = batch.attempt = loop.create_task(
            self.store.add_usage(batch.usage, batch_id=batch.id)
        )
        attempt.add_done_callback(_retrieve)
        await asyncio.shield(attempt)

    async def aclose(self) -> None:
        """Stop the background task, letting it finish a flush in flight, then write what
        is left (this logs how many requests could not be written, and raises, if the store
        refuses; the counts stay buffered)."""
        self._closing = True
        try:
            task, self._task = self._task, None
            if task is not None and not task.done():
                if task.get_loop() is asyncio.get_running_loop():
                    if self._wake is not None:
                        self._wake.set()
                    # Not cancelled: a write the store may have applied must get its answer.
                    await asyncio.shield(task)
                else:
                    # A task left on another loop, which is not running: it cannot be waited
                    # for from here. Cancelling it loses nothing: a batch it was writing stays
                    # queued under its id, and the store skips it if it had been applied.
                    with contextlib.suppress(RuntimeError):  # that loop is closed
                        task.cancel()
            self._wake = None
            try:
                await self.flush()
            except Exception as exc:
                logger.warning(
                    "apikeys: usage counts not written at close (%s): %s, kept in this "
                    "process and retried",
                    type(exc).__name__,
                    self.describe_unwritten(),
                )
                raise
        finally:
            self._closing = False
            if self._has_pending():
                self._ensure_task()  # counts recorded while closing, or a failed write


class _InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """An executor that runs each call at once, in the calling thread.

    At interpreter exit no executor takes work any more (and Python 3.12 starts no thread),
    yet asyncio resolves host names through the loop's executor: the exit loop resolves
    them inline instead. Nothing else runs then, so blocking the loop costs nothing.
    """

    def submit(
        self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs
    ) -> concurrent.futures.Future[_T]:
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


async def _write_and_close(buffers: list[UsageBuffer]) -> None:
    async def write(buffer: UsageBuffer) -> None:
        try:
            await buffer.flush()
        except Exception as exc:
            logger.debug("apikeys: usage flush at exit failed: %s", type(exc).__name__)

    # The writes, all at once, then the stores' connections are closed.
    stores = list({id(buffer.store): buffer.store for buffer in buffers}.values())
    await asyncio.gather(*(write(buffer) for buffer in buffers))
    await asyncio.gather(*(store.aclose() for store in stores), return_exceptions=True)


def write_at_exit(buffers: Iterable[UsageBuffer], timeout: float) -> int:
    """Write what `buffers` hold, on a new event loop, within `timeout` seconds, then close
    their stores; return how many counted requests could not be written.

    For interpreter exit, when the loops the buffers ran on are gone: the stores reconnect
    on this one. A buffer whose background task still lives on a running loop (in another
    thread) is left to it, and its counts are reported as not written. Never raises.
    """
    pending = [buffer for buffer in buffers if buffer.unwritten()]
    mine = [buffer for buffer in pending if not buffer._busy_elsewhere()]
    if mine:
        try:
            loop = asyncio.new_event_loop()
        except Exception as exc:  # pragma: no cover - no event loop at all
            logger.debug("apikeys: no event loop at exit: %s", type(exc).__name__)
        else:
            try:
                loop.set_default_executor(_InlineExecutor())
                with contextlib.suppress(TimeoutError):
                    loop.run_until_complete(asyncio.wait_for(_write_and_close(mine), timeout))
                # Whatever outlived the time limit is cancelled, not left pending.
                leftover = asyncio.all_tasks(loop)
                for task in leftover:
                    task.cancel()
                if leftover:
                    loop.run_until_complete(asyncio.wait(leftover, timeout=1.0))
                loop.run_until_complete(loop.shutdown_asyncgens())
            except Exception as exc:
                logger.debug("apikeys: usage flush at exit failed: %s", type(exc).__name__)
            finally:
                loop.close()
    return sum(buffer.unwritten() for buffer in pending)
