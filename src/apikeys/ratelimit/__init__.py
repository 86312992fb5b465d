"""Per-key rate limiting on `limits`' asyncio API.

- `notation`: a key's limits as written (`100/minute`, `burst=10/second, daily=10000/day`).
- `decisions`: what the limiter answers (`PolicyDecision`, `RateDecision`) and tells
  (`ThresholdCrossing`).
- `counting`: fixed windows counted in this process (`memory://`).
- `leases`: Redis' windows, leased by slices and spent in this process.
- `limiter`: `RateLimiter`, whose `charge` is the one way a request is charged (over a
  key's policies and, for a key of an identity, the identity's too).
"""

from __future__ import annotations

from apikeys.ratelimit.counting import FixedWindowMemoryStorage
from apikeys.ratelimit.decisions import (
    Charge,
    Plan,
    PolicyDecision,
    PolicyStatus,
    RateDecision,
    ThresholdCrossing,
)
from apikeys.ratelimit.leases import LEASE_FRACTION, LEASE_MAX, LEASE_THRESHOLD
from apikeys.ratelimit.limiter import IDENTITY_POLICY_PREFIX, RateLimiter
from apikeys.ratelimit.notation import (
    DEFAULT_POLICY,
    DEFAULT_RATE_LIMIT,
    MAX_AMOUNT,
    MAX_LIMIT_LENGTH,
    MAX_POLICIES,
    MAX_POLICIES_LENGTH,
    MAX_WINDOW_SECONDS,
    RATE_LIMIT_ENV,
    THRESHOLDS,
    Policy,
    format_policies,
    parse_policies,
    parse_rate_limit,
)

__all__ = [
    "DEFAULT_POLICY",
    "DEFAULT_RATE_LIMIT",
    "IDENTITY_POLICY_PREFIX",
    "LEASE_FRACTION",
    "LEASE_MAX",
    "LEASE_THRESHOLD",
    "MAX_AMOUNT",
    "MAX_LIMIT_LENGTH",
    "MAX_POLICIES",
    "MAX_POLICIES_LENGTH",
    "MAX_WINDOW_SECONDS",
    "RATE_LIMIT_ENV",
    "THRESHOLDS",
    "Charge",
    "FixedWindowMemoryStorage",
    "Plan",
    "Policy",
    "PolicyDecision",
    "PolicyStatus",
    "RateDecision",
    "RateLimiter",
    "ThresholdCrossing",
    "format_policies",
    "parse_policies",
    "parse_rate_limit",
]
