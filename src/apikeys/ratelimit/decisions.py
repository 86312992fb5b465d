"""What the limiter answers: a request's decision over a key's policies, and the thresholds
a window reaches."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

__all__ = [
    "Charge",
    "Crossed",
    "Observer",
    "Plan",
    "PolicyDecision",
    "PolicyPlan",
    "PolicyStatus",
    "RateDecision",
    "ThresholdCrossing",
    "charge_of",
    "decision",
    "seconds",
    "verdict",
]


class RateDecision(NamedTuple):
    """The limiter's answer for one request."""

    allowed: bool
    limit: int
    window: int
    remaining: int
    reset_after: int
    """Whole seconds until the window resets (at least 1)."""


class PolicyStatus(NamedTuple):
    """One policy's part of a `PolicyDecision`."""

    name: str
    allowed: bool
    """False when this policy refused the request (it is among the violated ones)."""
    limit: int
    window: int
    remaining: int
    """Requests left in the window (after this one, when it was admitted)."""
    reset_after: int
    """Whole seconds until the window resets (at least 1)."""


class PolicyDecision(NamedTuple):
    """The limiter's answer for one request over all of a key's policies (and its
    identity's, named `identity.<name>`, after the key's).

    `allowed` only if every policy admitted it; a refused request is charged to none.
    `violated` names the policies that refused it, and `retry_after` is the longest of
    their `reset_after` (0 when admitted).
    """

    allowed: bool
    policies: tuple[PolicyStatus, ...]
    violated: tuple[str, ...]
    retry_after: int


class ThresholdCrossing(NamedTuple):
    """A key's (or an identity's) window of one policy reaching a percentage of its limit:
    what `RateLimiter.on_threshold` is told, once per key (or identity), policy, threshold
    and window."""

    key_id: str
    """The key whose policy it is; empty for an identity's policy (see `identity`)."""
    policy: str
    """The policy's name (`default` for a key's one unnamed limit)."""
    threshold: int
    """The percentage of `THRESHOLDS` reached."""
    used: int
    """The window's count when it was reached (on Redis, the units leased so far)."""
    limit: int
    window: int
    """The window's length in seconds."""
    window_end: float
    """When the window ends, in seconds since 1970 (UTC)."""
    at: float
    """When the threshold was reached, in seconds since 1970 (UTC)."""
    identity: str | None = None
    """The identity whose policy it is (then `key_id` is empty, and `policy` is the
    identity's own name for it, without `identity.`); None for a key's own policy."""


Observer = Callable[[ThresholdCrossing], None]


PolicyPlan = tuple[str, int, int, str]
"""One policy of a key as the limiter counts it: (counter key, amount, window seconds, name)."""
Plan = tuple[PolicyPlan, ...]
"""Every policy of a key as the limiter counts them (`RateLimiter.plan`): what a charge takes."""


def verdict(statuses: tuple[PolicyStatus, ...]) -> PolicyDecision:
    violated = tuple(status.name for status in statuses if not status.allowed)
    if not violated:
        return PolicyDecision(True, statuses, (), 0)
    retry_after = max(status.reset_after for status in statuses if not status.allowed)
    return PolicyDecision(False, statuses, violated, max(1, retry_after))


Charge = tuple[int, ...]
"""What `RateLimiter.charge` answers when it decides: for each policy of the plan in turn,
the units it has left and the whole seconds until its window resets (at least 1), flat:
`(remaining, reset_after, remaining, reset_after, …)`. A policy that refused the request
has its remaining written `~remaining` (`-1 - remaining`, below 0). The request was
admitted, and charged to every policy, if no remaining is below 0; else to none. One
tuple, made per request on the request path (a `PolicyDecision` is five objects)."""


def seconds(left: float) -> int:
    """`left` seconds as a whole `reset_after`: rounded up, at least 1."""
    whole = math.ceil(left)
    return whole if whole > 1 else 1


def decision(plan: Plan, charged: Charge) -> PolicyDecision:
    """The `PolicyDecision` that the `Charge` `charged` of `plan` says."""
    statuses = []
    for index, (_, amount, window, name) in enumerate(plan):
        remaining, reset_after = charged[2 * index], charged[2 * index + 1]
        allowed = remaining >= 0
        shown = remaining if allowed else ~remaining
        statuses.append(PolicyStatus(name, allowed, amount, window, shown, reset_after))
    return verdict(tuple(statuses))


def charge_of(decision: PolicyDecision) -> Charge:
    """The `Charge` that `decision` says (each policy's remaining and reset, flat)."""
    flat: list[int] = []
    for status in decision.policies:
        flat += (status.remaining if status.allowed else ~status.remaining, status.reset_after)
    return tuple(flat)


Crossed = Callable[[str, int, int, int, int, float, float], None]
"""Told that a counter went from `before` to `after` units used: (counter, before, after,
amount, window, window end, now); it tells `on_threshold` of each mark passed."""
