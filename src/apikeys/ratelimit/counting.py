"""Counting in this process (`memory://`): fixed windows in limits' in-process storage,
charged without a task or an await per request."""

from __future__ import annotations

import math
import time

from limits.aio.storage import MemoryStorage

from apikeys.ratelimit.decisions import Charge, Crossed, Plan, seconds

__all__ = ["FixedWindowMemoryStorage", "count_many", "refund_here"]


class FixedWindowMemoryStorage(MemoryStorage):
    """limits' in-process storage, counting fixed windows without a task per request.

    `limits.aio.storage.MemoryStorage.incr` schedules a task that walks every counter on
    nearly every call, which costs microseconds per request and grows with the number of
    keys. This `incr` is the same atomic count (nothing in it awaits, so it cannot
    interleave), and expired counters are swept at most once per `sweep_interval`.
    """

    def __init__(self, sweep_interval: float = 30.0) -> None:
        super().__init__()
        self._sweep_interval = sweep_interval
        self._next_sweep = time.time() + sweep_interval

    async def incr(self, key: str, expiry: float, amount: int = 1) -> int:
        return self.count(key, expiry, amount)

    def count(self, key: str, expiry: float, amount: int = 1) -> int:
        """`incr` without the coroutine: the limiter's hot path calls this directly."""
        now = time.time()
        counts = self.storage
        if self.expirations.get(key, 0.0) > now:
            value = counts[key] + amount
        else:
            value = amount
            self.expirations[key] = now + expiry
            if now >= self._next_sweep:
                self._sweep(now)
        counts[key] = value
        return value

    def sweep_due(self, now: float) -> None:
        """Sweep expired counters if `sweep_interval` has passed (a window starts at `now`)."""
        if now >= self._next_sweep:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + self._sweep_interval
        expired = [key for key, end in self.expirations.items() if end <= now]
        for key in expired:
            self.storage.pop(key, None)
            self.expirations.pop(key, None)
            self.locks.pop(key, None)


def count_many(
    local: FixedWindowMemoryStorage, plan: Plan, cost: int, crossed: Crossed | None
) -> Charge:
    """Charge `cost` units to every policy of `plan` in this process's windows, or to none
    if one of them has fewer left: check every policy, then charge every one, with nothing
    awaited in between. `crossed` is told of each window that reached 80 % or more."""
    now = time.time()
    counts, ends = local.storage, local.expirations
    for counter, amount, _, _ in plan:
        used = counts[counter] if ends.get(counter, 0.0) > now else 0
        if used + cost > amount:
            return _refused(local, plan, cost, now)
    charged: list[int] = []
    for counter, amount, window, _ in plan:
        end = ends.get(counter, 0.0)
        if end > now:
            count = counts[counter] = counts[counter] + cost
        else:
            count = counts[counter] = cost
            end = ends[counter] = now + window
            local.sweep_due(now)
        charged += (amount - count, math.ceil(end - now) or 1)
    if crossed is not None:
        for counter, amount, window, _ in plan:
            count = counts[counter]
            if count * 5 >= amount * 4:
                crossed(counter, count - cost, count, amount, window, ends[counter], now)
    return tuple(charged)


def _refused(local: FixedWindowMemoryStorage, plan: Plan, cost: int, now: float) -> Charge:
    counts, ends = local.storage, local.expirations
    charged: list[int] = []
    for counter, amount, window, _ in plan:
        end = ends.get(counter, 0.0)
        count = counts[counter] if end > now else 0
        left = amount - count if count < amount else 0
        charged += (
            left if count + cost <= amount else ~left,
            seconds(end - now if count else window),
        )
    return tuple(charged)


def refund_here(local: FixedWindowMemoryStorage, plan: Plan, cost: int) -> None:
    """Give back `cost` units of each policy of `plan` to its window, while it lasts."""
    now = time.time()
    counts, ends = local.storage, local.expirations
    for counter, *_ in plan:
        if ends.get(counter, 0.0) > now and counts[counter] > 0:
            counts[counter] = max(0, counts[counter] - cost)
