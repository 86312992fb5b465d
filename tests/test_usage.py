"""`UsageBuffer` on its own: batches with ids, kept as they are until the store confirms them.

A `ScriptedStore` (a memory store, so batch ids are idempotent as in every store) fails or
holds `add_usage` calls on demand: refused before applying, or applied with the answer lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Literal

import pytest

from apikeys.errors import StoreUnavailable
from apikeys.stores.memory.store import MemoryStore
from apikeys.types import KeyRecord, StoredKey, UsageDelta
from apikeys.usage import UsageBuffer

T0 = datetime(2026, 1, 31, 12, 0, 0, tzinfo=UTC)
WAIT = 5.0  # seconds before a test that should not block gives up

Outcome = Literal["ok", "refused", "lost"]


class ScriptedStore(MemoryStore):
    """A memory store whose `add_usage` calls follow `outcomes`, one per call ("ok" after).

    - "refused": raises `StoreUnavailable` and applies nothing;
    - "lost": applies the batch, then raises `StoreUnavailable` (the answer never came).

    While `gate` is set to an unset event, every call waits on it after applying (the answer
    is on its way). `calls` records each call's batch id and counts.
    """

    def __init__(self, *outcomes: Outcome) -> None:
        super().__init__()
        self.outcomes: list[Outcome] = list(outcomes)
        self.calls: list[tuple[str, dict[str, int]]] = []
        self.gate: asyncio.Event | None = None
        self.applied = asyncio.Event()
        self.cancelled = 0

    async def add_usage(self, usage: Mapping[str, UsageDelta], *, batch_id: str) -> None:
        self.calls.append((batch_id, {key_id: delta.count for key_id, delta in usage.items()}))
        outcome = self.outcomes.pop(0) if self.outcomes else "ok"
        if outcome == "refused":
            raise StoreUnavailable(ConnectionRefusedError("refused"))
        await super().add_usage(usage, batch_id=batch_id)
        self.applied.set()
        if self.gate is not None:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if outcome == "lost":
            raise StoreUnavailable(ConnectionResetError("reply lost"))

    def count(self, key_id: str) -> int:
        stored = self._keys[key_id]
        return stored.record.request_count

    def batch_ids(self) -> list[str]:
        return [batch_id for batch_id, _ in self.calls]


def record(key_id: str) -> KeyRecord:
    return KeyRecord(
        id=key_id,
        name=key_id,
        workspace="w",
        prefix=f"ak_{key_id}_…",
        access="full",
        scopes=(),
        state="active",
        rate_limit=None,
        created_at=T0,
    )


async def scripted(*outcomes: Outcome, keys: tuple[str, ...] = ("k1", "k2")) -> ScriptedStore:
    store = ScriptedStore(*outcomes)
    for key_id in keys:
        await store.insert(StoredKey(record=record(key_id), secret_hash="h"))
    return store


@pytest.fixture
async def closing() -> AsyncIterator[list[UsageBuffer]]:
    """Buffers a test made, closed after it (so no background task outlives the test)."""
    buffers: list[UsageBuffer] = []
    yield buffers
    for buffer in buffers:
        buffer.interval = 0
        store = buffer.store
        if isinstance(store, ScriptedStore):
            store.outcomes.clear()
            if store.gate is not None:
                store.gate.set()
        await asyncio.wait_for(buffer.aclose(), WAIT)


def buffer_on(store: ScriptedStore, closing: list[UsageBuffer], interval: float) -> UsageBuffer:
    buffer = UsageBuffer(store, interval)
    closing.append(buffer)
    return buffer


def hit(buffer: UsageBuffer, key_id: str, times: int = 1) -> None:
    for _ in range(times):
        buffer.record(key_id)


async def test_each_flush_sends_its_counts_as_one_batch_with_a_fresh_random_id(
    closing: list[UsageBuffer],
) -> None:
    store = await scripted()
    buffer = buffer_on(store, closing, interval=3600)
    hit(buffer, "k1", 2)
    hit(buffer, "k2")
    await buffer.flush()
    hit(buffer, "k1")
    await buffer.flush()
    await buffer.flush()  # nothing left: no call

    assert [counts for _, counts in store.calls] == [{"k1": 2, "k2": 1}, {"k1": 1}]
    first, second = store.batch_ids()
    assert first != second
    assert len(first) == 32
    int(first, 16)  # a uuid4 hex
    assert (store.count("k1"), store.count("k2")) == (3, 1)


async def test_if_a_write_fails_then_the_batch_keeps_its_id_and_counts_and_goes_first(
    closing: list[UsageBuffer],
) -> None:
    store = await scripted("refused")
    buffer = buffer_on(store, closing, interval=3600)
    hit(buffer, "k1", 2)
    with pytest.raises(StoreUnavailable):
        await buffer.flush()
    hit(buffer, "k1")
    hit(buffer, "k2")

    await buffer.flush()

    (failed, failed_counts), (retried, retried_counts), (newer, newer_counts) = store.calls
    assert (retried, retried_counts) == (failed, failed_counts) == (failed, {"k1": 2})
    assert newer != failed
    assert newer_counts == {"k1": 1, "k2": 1}  # not merged into the retried batch
    assert (store.count("k1"), store.count("k2")) == (3, 1)
    assert buffer.pending("k1") == (0, None)


async def test_if_the_retry_fails_too_then_other_keys_counts_go_and_its_own_wait(
    closing: list[UsageBuffer],
) -> None:
    store = await scripted("refused", "refused")
    buffer = buffer_on(store, closing, interval=3600)
    hit(buffer, "k1")
    with pytest.raises(StoreUnavailable):
        await buffer.flush()
    hit(buffer, "k1")
    hit(buffer, "k2")
    with pytest.raises(StoreUnavailable):
        await buffer.flush()

    # The old batch failed again, and held nothing else: k2's count went in a batch of
    # its own; k1's newer count waits for k1's batch, so k1 is in one kept batch at most.
    assert [counts for _, counts in store.calls] == [{"k1": 1}, {"k1": 1}, {"k2": 1}]
    first, retried, other = store.batch_ids()
    assert retried == first != other
    assert (store.count("k1"), store.count("k2")) == (0, 1)
    await buffer.flush()
    assert [counts for _, counts in store.calls[3:]] == [{"k1": 1}, {"k1": 1}]
    assert store.batch_ids()[3] == first
    assert (store.count("k1"), store.count("k2")) == (2, 1)
    assert buffer.unwritten() == 0


async def test_if_the_store_applied_a_batch_but_the_answer_was_lost_then_the_retry_is_skipped(
    closing: list[UsageBuffer],
) -> None:
    store = await scripted("lost")
    buffer = buffer_on(store, closing, interval=3600)
    hit(buffer, "k1", 5)
    with pytest.raises(StoreUnavailable):
        await buffer.flush()
    assert store.count("k1") == 5  # applied, though the buffer could not know

    await buffer.flush()

    first, again = store.batch_ids()
    assert again == first
    assert store.count("k1") == 5
    assert buffer.pending("k1") == (0, None)


async def test_pending_views_include_batches_waiting_for_a_retry(
    closing: list[UsageBuffer],
) -> None:
    store = await scripted("refused")
    buffer = buffer_on(store, closing, interval=3600)
    hit(buffer, "k1", 2)
    before_failure = time.time()
    with pytest.raises(StoreUnavailable):
        await buffer.flush()
    count, last = buffer.pending("k1")
    assert count == 2
    assert last is not None
    assert last.timestamp() <= before_failure

    hit(buffer, "k1", 3)
    hit(buffer, "k2")

    count, newest = buffer.pending("k1")
    assert count == 5
    assert newest is not None
    assert newest >= last
    assert buffer.pending("k2")[0] == 1
    assert buffer.pending("nobody") == (0, None)
    applied = buffer.apply(record("k1"))
    assert (applied.request_count, applied.last_used_at) == (5, newest)


async def test_pending_views_include_a_batch_whose_write_is_in_flight(
    closing: list[UsageBuffer],
) -> None:
    store = await scripted()
    store.gate = asyncio.Event()
    buffer = buffer_on(store, closing, interval=3600)
    hit(buffer, "k1", 2)
    flush = asyncio.create_task(buffer.flush())
    await asyncio.wait_for(store.applied.wait(), WAIT)
    hit(buffer, "k1")

    assert buffer.pending("k1")[0] == 3  # no request is missing from this process's view

    store.gate.set()
    await asyncio.wait_for(flush, WAIT)
    assert buffer.pending("k1")[0] == 1


async def test_if_a_flush_is_cancelled_mid_write_then_the_write_goes_on_and_is_not_repeated(
    closing: list[UsageBuffer],
) -> None:
    store = await scripted()
    store.gate = asyncio.Event()
    buffer = buffer_on(store, closing, interval=3600)
    hit(buffer, "k1", 4)
    flush = asyncio.create_task(buffer.flush())
    await asyncio.wait_for(store.applied.wait(), WAIT)

    flush.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flush
    assert store.cancelled == 0  # the store call itself was shielded
    assert buffer.pending("k1")[0] == 4  # kept, with its id, until its outcome is known

    store.gate.set()
    await asyncio.wait_for(buffer.flush(), WAIT)  # waits for that write: it succeeded

    assert len(store.calls) == 1
    assert store.count("k1") == 4
    assert buffer.pending("k1") == (0, None)


async def test_if_a_cancelled_flush_write_then_fails_the_retry_sends_the_same_batch(
    closing: list[UsageBuffer],
) -> None:
    store = await scripted("lost")
    store.gate = asyncio.Event()
    buffer = buffer_on(store, closing, interval=3600)
    hit(buffer, "k1", 4)
    flush = asyncio.create_task(buffer.flush())
    await asyncio.wait_for(store.applied.wait(), WAIT)
    flush.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flush
    store.gate.set()

    await asyncio.wait_for(buffer.flush(), WAIT)

    first, again = store.batch_ids()
    assert again == first
    assert store.count("k1") == 4


async def test_if_closed_while_the_background_flush_is_in_flight_then_written_exactly_once(
    closing: list[UsageBuffer],
) -> None:
    store = await scripted()
    store.gate = asyncio.Event()
    buffer = buffer_on(store, closing, interval=0.05)
    hit(buffer, "k1", 5)
    await asyncio.wait_for(store.applied.wait(), WAIT)  # the background flush is in flight
    hit(buffer, "k2", 2)  # counted while it is

    close = asyncio.create_task(buffer.aclose())
    await asyncio.sleep(0.1)
    assert not close.done()  # waiting for the write in flight, not cancelling it
    store.gate.set()
    await asyncio.wait_for(close, WAIT)

    assert store.cancelled == 0
    assert [counts for _, counts in store.calls] == [{"k1": 5}, {"k2": 2}]
    assert len(set(store.batch_ids())) == 2
    assert (store.count("k1"), store.count("k2")) == (5, 2)
    assert buffer.pending("k1") == buffer.pending("k2") == (0, None)


async def test_if_closed_while_the_background_task_sleeps_then_it_writes_at_once(
    closing: list[UsageBuffer],
) -> None:
    store = await scripted()
    buffer = buffer_on(store, closing, interval=3600)
    hit(buffer, "k1", 3)
    await asyncio.sleep(0)  # the background task starts its sleep

    await asyncio.wait_for(buffer.aclose(), 1)

    assert [counts for _, counts in store.calls] == [{"k1": 3}]
    assert store.count("k1") == 3


async def test_if_closed_after_a_failed_write_then_the_same_batch_is_written(
    closing: list[UsageBuffer], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="apikeys")
    store = await scripted("lost")
    buffer = buffer_on(store, closing, interval=0.05)
    hit(buffer, "k1", 2)
    deadline = time.monotonic() + WAIT
    while "usage flush failed" not in caplog.text:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    buffer.interval = 3600  # no background retry: closing does it

    await asyncio.wait_for(buffer.aclose(), WAIT)

    assert len(set(store.batch_ids())) == 1
    assert store.count("k1") == 2


async def test_if_the_background_flush_fails_then_it_retries_the_same_batch_on_its_own(
    closing: list[UsageBuffer],
) -> None:
    store = await scripted("refused", "lost")
    buffer = buffer_on(store, closing, interval=0.05)
    hit(buffer, "k1", 3)

    deadline = time.monotonic() + WAIT
    while len(store.calls) < 3 or buffer.pending("k1")[0]:
        assert time.monotonic() < deadline, store.calls
        await asyncio.sleep(0.01)

    assert len(set(store.batch_ids()[:3])) == 1
    assert store.count("k1") == 3


async def test_background_flush_makes_counts_visible_without_a_flush_or_close(
    closing: list[UsageBuffer],
) -> None:
    store = await scripted()
    buffer = buffer_on(store, closing, interval=1.0)
    started = time.monotonic()
    hit(buffer, "k1", 7)

    # A bound on waiting forever, not a timing: the interval is 1 s, and nothing but the
    # background task writes here.
    while store.count("k1") < 7:
        assert time.monotonic() - started < 60, "never written by the background flush"
        await asyncio.sleep(0.02)

    assert store.count("k1") == 7
    stored = await store.get("k1")
    assert stored is not None
    assert stored.record.last_used_at is not None
    assert datetime.now(UTC) - stored.record.last_used_at < timedelta(seconds=5)


async def test_a_buffer_keeps_working_after_aclose(closing: list[UsageBuffer]) -> None:
    store = await scripted()
    buffer = buffer_on(store, closing, interval=0.05)
    hit(buffer, "k1")
    await buffer.aclose()

    hit(buffer, "k1", 2)
    deadline = time.monotonic() + WAIT
    while store.count("k1") < 3:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert len(set(store.batch_ids())) == 2


def test_if_the_buffer_is_used_on_a_new_loop_then_a_key_counted_before_is_written_there() -> None:
    """Its first loop closed with counts open (`asyncio.run` cancels the flushing task): the
    next counts of the same key, on another loop, start a task there within an interval."""
    store = asyncio.run(scripted())
    buffer = UsageBuffer(store, 0.05)
    ticks: list[asyncio.AbstractEventLoop] = []
    buffer.on_tick = lambda: ticks.append(asyncio.get_running_loop())

    async def first() -> None:
        hit(buffer, "k1")

    async def second() -> asyncio.AbstractEventLoop:
        async with asyncio.timeout(WAIT):
            while store.count("k1") < 3:
                hit(buffer, "k1")
                await asyncio.sleep(0.02)
        await buffer.aclose()
        return asyncio.get_running_loop()

    asyncio.run(first())
    assert store.count("k1") == 0  # the loop closed before the first flush
    loop = asyncio.run(second())
    assert store.count("k1") >= 3
    assert loop in ticks  # the manager's hook ran on the new loop
