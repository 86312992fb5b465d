"""How a charge is shown: the `RateLimit` and `RateLimit-Policy` headers
(draft-ietf-httpapi-ratelimit-headers-11) of a key's policies, its identity's and its
credits, and the refusals of a charge the limits or the credits refused.

A key's policies are shown the same way at every request of one of its versions, so their
shape (`OnePolicy`, `PolicySet`) is made once and only the values are written per request.
"""

from __future__ import annotations

import functools
import math
from datetime import datetime
from typing import NamedTuple

from apikeys.errors import CreditsExhausted, RateLimited
from apikeys.policies import Refill
from apikeys.problems import Headers
from apikeys.ratelimit.decisions import Charge, PolicyDecision, RateDecision, charge_of
from apikeys.ratelimit.limiter import IDENTITY_POLICY_PREFIX, RateLimiter
from apikeys.ratelimit.notation import DEFAULT_POLICY, parse_policies
from apikeys.types import utcnow

__all__ = [
    "OnePolicy",
    "PolicySet",
    "credit_headers",
    "credits_exhausted",
    "policies_headers",
    "policy_name_text",
    "rate_limit_headers",
    "rate_limited",
    "shape_for",
    "single_headers",
]


def policy_name_text(name: str) -> str:
    """`name` as it can stand in a structured-field string: printable ASCII, no `"` or `\\`."""
    return "".join(char for char in name if " " <= char <= "~" and char not in '"\\')


@functools.lru_cache(maxsize=256)
def _policy_header(name: str, limit: int, window: int) -> tuple[bytes, bytes]:
    return b"ratelimit-policy", f'"{name}";q={limit};w={window}'.encode()


class OnePolicy(NamedTuple):
    """How the headers show a key's one policy, built once per limit: its name, its
    RateLimit-Policy header and the start of its RateLimit value."""

    name: str
    policy_header: tuple[bytes, bytes]
    start: bytes  # b'"name";r='


class PolicySet(NamedTuple):
    """How the headers show a key's several policies: their names, RateLimit-Policy, and
    the RateLimit value with a `%d` for each policy's remaining and reset, in turn."""

    names: tuple[str, ...]
    policy_header: tuple[bytes, bytes]
    template: bytes  # b'"burst";r=%d;t=%d, "daily";r=%d;t=%d'


@functools.lru_cache(maxsize=256)
def _policy_set(policies: tuple[tuple[str, int, int], ...]) -> PolicySet:
    items = (f'"{name}";q={limit};w={window}' for name, limit, window in policies)
    values = (f'"{name.replace("%", "%%")}";r=%d;t=%d' for name, _, _ in policies)
    return PolicySet(
        tuple(name for name, _, _ in policies),
        (b"ratelimit-policy", ", ".join(items).encode()),
        ", ".join(values).encode(),
    )


def single_headers(decision: RateDecision, policy_name: str) -> Headers:
    _, limit, window, remaining, reset_after = decision
    value = b'"%s";r=%d;t=%d' % (policy_name.encode(), remaining, reset_after)
    return [_policy_header(policy_name, limit, window), (b"ratelimit", value)]


def policies_headers(charged: Charge, shown: PolicySet) -> Headers:
    """The headers of a charge of several policies: `charged` (each policy's remaining and
    reset in turn, a refused policy's remaining written `~left`) shown as `shown` says."""
    if min(charged) < 0:  # a policy refused: its remaining is `~left` (resets are >= 1)
        charged = tuple([value if value >= 0 else ~value for value in charged])
    return [shown.policy_header, (b"ratelimit", shown.template % charged)]


def rate_limit_headers(
    decision: RateDecision | PolicyDecision, policy_name: str = "default"
) -> Headers:
    """`RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-11).

    One list item per policy: `"burst";q=10;w=1, "daily";q=10000;w=86400` and
    `"burst";r=3;t=1, "daily";r=9120;t=40210`. The policy named `default` (a key's one
    unnamed limit) is shown as `policy_name`.
    """
    if isinstance(decision, PolicyDecision):
        return policies_headers(charge_of(decision), _shown(decision, policy_name))
    return single_headers(decision, policy_name)


def _shown(decision: PolicyDecision, policy_name: str) -> PolicySet:
    return _policy_set(
        tuple(
            (policy_name if status.name == DEFAULT_POLICY else status.name, *status[2:4])
            for status in decision.policies
        )
    )


def credit_headers(
    headers: Headers,
    left: int,
    refill: Refill | None,
    now: datetime | None = None,
    *,
    name: str = "credits",
) -> Headers:
    """`headers` with a `credits` item in `RateLimit` (the credits left, and `t`, the
    seconds to the next refill) and, for a key with a refill, in `RateLimit-Policy`.
    `name` names the item: `identity.credits` for the credits of the key's identity."""
    item = f'"{name}";r={left}'
    policy = None
    if refill is not None:
        now = now or utcnow()
        start, end = refill.period_start(now), refill.next_start(now)
        item += f";t={max(1, math.ceil((end - now).total_seconds()))}"
        policy = f'"{name}";q={refill.amount};w={int((end - start).total_seconds())}'
    updated: Headers = []
    for field, value in headers:
        if field == b"ratelimit":
            value = value + b", " + item.encode()
        elif field == b"ratelimit-policy" and policy is not None:
            value = value + b", " + policy.encode()
        updated.append((field, value))
    return updated


def rate_limited(charged: Charge, shape: OnePolicy | PolicySet) -> RateLimited:
    """The refusal of a charge the limits refused: the policies it violated, and
    `Retry-After` the longest of their resets."""
    names = (shape.name,) if isinstance(shape, OnePolicy) else shape.names
    violated = [index for index in range(len(names)) if charged[2 * index] < 0]
    retry_after = max(charged[2 * index + 1] for index in violated)
    return RateLimited(retry_after, tuple(names[index] for index in violated))


def credits_exhausted(refill: Refill | None) -> CreditsExhausted:
    """The refusal of a key without credits left; `Retry-After` the next refill, if any."""
    retry = None
    if refill is not None:
        now = utcnow()
        retry = math.ceil((refill.next_start(now) - now).total_seconds())
    return CreditsExhausted(retry)


def shape_for(
    limiter: RateLimiter,
    limit: str | None,
    policy_name: str,
    identity_limit: str | None = None,
) -> OnePolicy | PolicySet:
    """How the headers show the policies of `limit`, the default one named `policy_name`,
    in the order `RateLimiter.plan` charges them; then those of the key's identity's
    `identity_limit` (None: none), each named `identity.<name>` as the limiter's decisions
    name them."""
    shown = tuple(
        (
            policy_name if policy.name == DEFAULT_POLICY else policy.name,
            policy.item.amount,
            policy.item.get_expiry(),
        )
        for policy in limiter.policies(limit)
    )
    if identity_limit:
        shown += tuple(
            (IDENTITY_POLICY_PREFIX + policy.name, policy.item.amount, policy.item.get_expiry())
            for policy in parse_policies(identity_limit)
        )
    if len(shown) == 1:
        name = shown[0][0]
        return OnePolicy(name, _policy_header(*shown[0]), b'"%s";r=' % name.encode())
    return _policy_set(shown)
