"""Rate limit thresholds: what the limiters tell, queued for the deliverer.

A `RateLimiter` knows exactly and atomically when a key's window reaches 80, 90 or 100 % of
its limit (`RateLimiter.on_threshold`), on the request path. `ThresholdWatch` is the
observer a `KeyManager` gives its limiters: it only appends the crossing to a bounded
queue, and the deliverer's next round turns each into `key.usage_threshold` deliveries.
The watch is on only while an endpoint wants that event (the deliverer looks each round):
until then the limiters have no observer, and a request pays one comparison.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque

from apikeys.ratelimit import RateLimiter, ThresholdCrossing

__all__ = ["DEFAULT_QUEUE_SIZE", "ThresholdWatch"]

logger = logging.getLogger("apikeys.webhooks")

DEFAULT_QUEUE_SIZE = 10_000
"""Crossings kept between two delivery rounds; more are dropped (and logged)."""


class ThresholdWatch:
    """The limiters' crossings of a process, queued until the deliverer takes them.

    `attach` a limiter to have it observed while the watch is on (`switch`); `observe` is
    its observer, `take` empties the queue. Nothing here awaits or raises on the request
    path: a full queue drops the crossing, and the next round logs how many were dropped.
    """

    def __init__(self, size: int = DEFAULT_QUEUE_SIZE) -> None:
        self.size = size
        self.on = False
        self.dropped = 0
        self._queue: deque[ThresholdCrossing] = deque()
        # Weak: a limiter closed and let go of is no longer observed, nor kept alive.
        self._limiters: weakref.WeakSet[RateLimiter] = weakref.WeakSet()

    def attach(self, limiter: RateLimiter) -> None:
        """Observe `limiter` while the watch is on, unless it has an observer of its own."""
        if limiter.on_threshold is not None and limiter.on_threshold != self.observe:
            return
        self._limiters.add(limiter)
        limiter.on_threshold = self.observe if self.on else None

    def switch(self, on: bool) -> None:
        """Observe the attached limiters (`on`), or stop (they then cost a request nothing
        but one comparison); what is queued stays for `take`."""
        if on == self.on:
            return
        self.on = on
        for limiter in list(self._limiters):
            # Only this watch's: a limiter given an observer of its own since keeps it.
            if limiter.on_threshold is None or limiter.on_threshold == self.observe:
                limiter.on_threshold = self.observe if on else None

    def observe(self, crossing: ThresholdCrossing) -> None:
        """Queue `crossing` (a limiter's `on_threshold`); dropped when the queue is full."""
        if len(self._queue) < self.size:
            self._queue.append(crossing)
        else:
            self.dropped += 1

    def take(self) -> list[ThresholdCrossing]:
        """Every crossing queued, oldest first, and an empty queue."""
        if self.dropped:
            logger.warning(
                "webhooks: %d rate limit thresholds were dropped: more than %d between "
                "two delivery rounds",
                self.dropped,
                self.size,
            )
            self.dropped = 0
        queue, taken = self._queue, []
        while queue:  # popleft, not a copy then clear: an append meanwhile stays queued
            taken.append(queue.popleft())
        return taken

    def give_back(self, crossings: list[ThresholdCrossing]) -> None:
        """Queue `crossings` again, first in line (a round that could not store them)."""
        room = max(0, self.size - len(self._queue))
        kept = crossings[:room]
        self.dropped += len(crossings) - len(kept)
        self._queue.extendleft(reversed(kept))
