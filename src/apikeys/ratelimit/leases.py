"""Counting on Redis by leases: this process leases a slice of a key's window with one atomic
script (grant at most what is left, return the window's end in milliseconds) and spends it
here, so a busy key costs a round trip per slice, not per request. Slices shrink as the
window fills and are a single unit when little is left, so small limits are exactly as
strict as one increment per request. A key's several policies (and its identity's, whose
counters share the key's slot on a Cluster: `RateLimiter.plan`) are leased by one script that
grants nothing unless each of them has what the request lacks, and spent all at once or not
at all: a refused request leases nothing, so no other process is refused for its sake."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from apikeys.errors import LimiterUnavailable
from apikeys.ratelimit.decisions import Charge, Crossed, Plan, seconds

__all__ = [
    "LEASE_FRACTION",
    "LEASE_MAX",
    "LEASE_SCRIPT",
    "LEASE_THRESHOLD",
    "LeasedWindows",
    "Slice",
    "lease_size",
]

# Leasing on Redis: a slice is 1/LEASE_FRACTION of what is left of the window, at most
# LEASE_MAX units, and a single unit once fewer than LEASE_THRESHOLD are left.
LEASE_FRACTION = 16
LEASE_MAX = 1000
LEASE_THRESHOLD = 64

# All or nothing: grants units only if every counter has what the request lacks there (the
# units needed: a request's cost less what this process holds). Asking 0 units reads.
# ARGV per counter: amount, window in ms, units asked, units needed.
# Returns {granted, count after, PTTL in ms} for each counter, flattened.
LEASE_SCRIPT = """
local counts, ttls = {}, {}
local open = true
for i = 1, #KEYS do
  local count = tonumber(redis.call('GET', KEYS[i]) or '0')
  local ttl = redis.call('PTTL', KEYS[i])
  if ttl < 0 then
    count = 0
    ttl = tonumber(ARGV[4 * i - 2])
  end
  counts[i] = count
  ttls[i] = ttl
  if count + tonumber(ARGV[4 * i]) > tonumber(ARGV[4 * i - 3]) then
    open = false
  end
end
local result = {}
for i = 1, #KEYS do
  local granted = 0
  if open then
    granted = math.min(tonumber(ARGV[4 * i - 1]), tonumber(ARGV[4 * i - 3]) - counts[i])
  end
  if granted > 0 then
    if counts[i] == 0 then
      redis.call('SET', KEYS[i], granted, 'PX', ttls[i])
    else
      redis.call('INCRBY', KEYS[i], granted)
    end
  end
  result[3 * i - 2] = granted
  result[3 * i - 1] = counts[i] + granted
  result[3 * i] = ttls[i]
end
return result
"""


class Slice:
    """The units of one window this process has leased and not spent yet."""

    __slots__ = ("left", "pending", "reset_at", "seen", "spend_until")

    def __init__(self) -> None:
        self.left = 0
        self.seen = 0  # the window's count in Redis after this process's last lease
        self.spend_until = 0.0  # monotonic: the window surely lasts until then
        self.reset_at = 0.0  # monotonic: the window has surely ended by then
        self.pending: asyncio.Future[None] | None = None


def lease_size(amount: int, previous: Slice | None, now: float, cost: int = 1) -> int:
    """The units to ask for: a slice of what is left of the window everywhere, and at least
    what a request of `cost` lacks."""
    left_everywhere = amount
    in_hand = 0
    if previous is not None and now < previous.spend_until:
        left_everywhere = amount - previous.seen
        in_hand = previous.left
    size = (
        min(LEASE_MAX, left_everywhere // LEASE_FRACTION)
        if left_everywhere >= LEASE_THRESHOLD
        else 1
    )
    return max(size, cost - in_hand)


# What a policy's slice lets a charge do (`LeasedWindows.needs`).
_SPEND = 0  # enough units in hand
_UNKNOWN = 1  # no slice, or past the time its window surely lasts: Redis must be read
_SHORT = 2  # units left in Redis, too few in hand: lease more
_EXHAUSTED = 3  # too few units left anywhere, as far as Redis said


class LeasedWindows:
    """This process's slices of Redis windows: leased by `script` (`LEASE_SCRIPT`, its keys
    named by `prefixed`), spent here. `ready`, for a Redis Cluster's client, is awaited
    before each lease: the client's `initialize` (see `RateLimiter`)."""

    def __init__(
        self,
        script: Any,
        prefixed: Callable[[str], str],
        ready: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self.script = script
        self.prefixed = prefixed
        self.ready = ready
        self.slices: dict[str, Slice] = {}

    def _state(self, lease: Slice | None, amount: int, cost: int, now: float) -> int:
        if lease is None or now >= lease.spend_until:
            return _UNKNOWN
        if lease.seen > amount:
            lease.left = 0  # leased under a wider limit: the narrowed one decides
        if lease.left >= cost:
            return _SPEND
        return _SHORT if lease.left + amount - lease.seen >= cost else _EXHAUSTED

    def spend(self, plan: Plan, cost: int) -> Charge | None:
        """Charge `cost` units to every policy of `plan` from the units in hand, or refuse
        when a window has too few left everywhere as far as Redis said (its end came from
        the same call: Retry-After holds). None, having charged nothing, when only Redis
        can tell (no slice, one in flight, one past its window, or too few in hand)."""
        now = time.monotonic()
        slices = self.slices
        worst = _SPEND
        for counter, amount, _, _ in plan:
            lease = slices.get(counter)
            if lease is not None and lease.pending is not None:
                return None  # one lease in flight per counter
            state = self._state(lease, amount, cost, now)
            if state == _UNKNOWN:
                return None
            if state > worst:
                worst = state
        if worst == _EXHAUSTED:
            return self._refusal(plan, cost, now)
        if worst == _SHORT:
            return None
        # Spent without a round trip: nothing awaits between check and spend.
        charged: list[int] = []
        for counter, amount, _, _ in plan:
            lease = slices[counter]
            lease.left -= cost
            remaining = amount - lease.seen if amount > lease.seen else 0
            charged += (remaining + lease.left, seconds(lease.reset_at - now))
        return tuple(charged)

    def _refusal(self, plan: Plan, cost: int, now: float) -> Charge:
        charged: list[int] = []
        for counter, amount, _, _ in plan:
            lease = self.slices[counter]
            remaining = max(0, amount - lease.seen) + lease.left
            allowed = lease.left + amount - lease.seen >= cost
            charged += (remaining if allowed else ~remaining, seconds(lease.reset_at - now))
        return tuple(charged)

    async def charge(self, plan: Plan, cost: int, crossed: Crossed) -> Charge:
        """`spend`, leasing what it lacks first: one script for every policy that needs
        more, all or none; a window used up reads only the windows nobody knows here."""
        while True:
            decided = self.spend(plan, cost)
            if decided is not None:
                return decided
            now = time.monotonic()
            leases = [self.slices.get(counter) for counter, *_ in plan]
            pending = next((lease.pending for lease in leases if lease and lease.pending), None)
            if pending is not None:
                await asyncio.shield(pending)  # one lease in flight per counter
                continue
            states = [
                self._state(lease, policy[1], cost, now)
                for lease, policy in zip(leases, plan, strict=True)
            ]
            unknown = [index for index, state in enumerate(states) if state == _UNKNOWN]
            if _EXHAUSTED in states:
                # Refused whatever the others say: only read the windows nobody knows here.
                await self.lease(plan, unknown, cost, crossed, read_only=True)
            else:
                short = [index for index, state in enumerate(states) if state == _SHORT]
                await self.lease(plan, unknown + short, cost, crossed, read_only=False)

    async def lease(
        self, plan: Plan, indexes: list[int], cost: int, crossed: Crossed, *, read_only: bool
    ) -> None:
        """Lease more of the policies of `plan` at `indexes` in one script (or only read
        their windows)."""
        now = time.monotonic()
        loop_future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        leases: list[tuple[Slice, bool]] = []
        keys: list[str] = []
        args: list[int] = []
        for index in indexes:
            counter, amount, window, _ = plan[index]
            previous = self.slices.get(counter)
            current = previous is not None and now < previous.spend_until
            lease = previous if current and previous is not None else Slice()
            lease.pending = loop_future
            leases.append((lease, current))
            self.slices[counter] = lease
            keys.append(self.prefixed(counter))
            if read_only:
                ask = need = 0
            else:
                ask = lease_size(amount, previous, now, cost)
                need = max(0, cost - lease.left) if current else cost
            args += (amount, window * 1000, ask, need)
        if len(self.slices) > 100_000:
            # Full: keep only this script's leases (clearing before one of them could drop
            # another already set, with the units it holds).
            self.slices = {
                plan[index][0]: lease for index, (lease, _) in zip(indexes, leases, strict=True)
            }
        sent = time.monotonic()
        try:
            if self.ready is not None:
                await self.ready()
            answer = await self.script(keys=keys, args=args)
        except Exception as exc:
            # Redis unreachable, timed out, or answering oddly: fail closed (503).
            raise LimiterUnavailable(exc) from exc
        finally:
            for lease, _ in leases:
                lease.pending = None
            loop_future.set_result(None)
        received = time.monotonic()
        at = time.time()
        for position, (lease, current) in enumerate(leases):
            granted, seen, pttl = (int(value) for value in answer[3 * position : 3 * position + 3])
            seconds = pttl / 1000
            if not current or lease.spend_until <= sent:
                lease.left = 0
            # Spent only while the window surely lasts; promised until it surely ended.
            lease.spend_until = sent + seconds
            lease.reset_at = received + seconds
            lease.seen = seen
            lease.left += granted
            if granted:
                # The script granted these units to this process alone: a mark they reach
                # is told here, and nowhere else.
                counter, amount, window, _ = plan[indexes[position]]
                crossed(counter, seen - granted, seen, amount, window, at + seconds, at)

    def refund(self, plan: Plan, cost: int) -> None:
        """Give `cost` units of each policy of `plan` back to this process's slice of its
        window (no round trip), while the window lasts."""
        now = time.monotonic()
        for counter, *_ in plan:
            lease = self.slices.get(counter)
            if lease is not None and now < lease.spend_until:
                lease.left += cost
