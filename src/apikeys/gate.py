"""The one request path: every entry point admits or refuses a request here.

`Gate.admit` reads the key (`Authorization: Bearer <key>`, or the bare key in one named
header), verifies it, checks the client address against the key's allowlist, charges its
rate limits, checks its scopes (against a `ScopeTable` of routes and the scopes an endpoint
asks for), then spends its credits (what a `CostTable` says the route costs). On admission
it sets `scope["apikey"]`, `scope["auth"]` and `scope["user"]` and answers the `RateLimit`
headers; on refusal it raises the `AuthenticationError` to answer with, after the
bookkeeping every entry point shares: a key's request refused after it was authenticated
is counted in the key's usage history under its code, and the limiter's refusals in the
telemetry. Anything unexpected is logged and refused as 503 `auth_unavailable`: fail
closed, never a 500 and never an open door.

`APIKeyMiddleware`, the Starlette backend, the FastAPI dependency and the Django classes
are adapters around one `Gate`: they differ in where the request comes from and how the
refusal is sent, never in what is checked or counted.

The path has two bodies, side by side in `Gate`: `admit_general`, which decides every
request, and `admit_now`, which decides the common one (a key the process holds with a
fast hash, limits counted in this process, no credits, telemetry off) without an await and
without the layers between the checks, and says None, having charged and counted nothing,
for anything else. `admit` is the one, else the other. The second body exists because it
runs on nearly every request and next to a hand-written check the layers were most of the
middleware's cost (docs/performance.md measures it). It makes the same checks in the same
order, with the same functions wherever one is called per request, and its refusals are
booked by the same `refused`; tests/test_gate_fast_path.py holds the two to the same answers.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Final, Literal, NamedTuple

from starlette.authentication import AuthCredentials, BaseUser

from apikeys.addresses import Allowlist, client_address
from apikeys.bounded import remember
from apikeys.credentials import (
    MAX_AUTHORIZATION_LENGTH,
    bearer_token,
    header_error,
    header_token,
    key_header,
)
from apikeys.errors import (
    AuthenticationError,
    AuthUnavailable,
    ConfigurationError,
    CreditsExhausted,
    InsufficientScope,
    IPNotAllowed,
    RateLimited,
)
from apikeys.keys import ID_LENGTH
from apikeys.manager import KeyManager
from apikeys.policies import Refill, parse_refill
from apikeys.problems import Headers
from apikeys.ratelimit import DEFAULT_POLICY, PolicyDecision, RateDecision, RateLimiter
from apikeys.routes import CostTable, ScopeTable
from apikeys.scopes import GrantedScopes, grants_for
from apikeys.types import KeyRecord, Scope, utcnow

__all__ = [
    "REFUSED_AFTER_AUTHENTICATION",
    "APIKeyAuth",
    "APIKeyUser",
    "Gate",
    "check_address",
    "check_rate_limits",
    "credit_headers",
    "rate_limit_headers",
    "route_path",
    "spend_credit",
]

logger = logging.getLogger("apikeys")


class APIKeyUser(BaseUser):
    """`scope["user"]` for a request authenticated by a key: the key is the principal."""

    __slots__ = ("record",)
    record: KeyRecord

    def __init__(self, record: KeyRecord) -> None:
        object.__setattr__(self, "record", record)

    def __setattr__(self, name: str, value: object) -> None:
        # One per key version, shared by its requests (see Gate.admit_now): read-only.
        raise AttributeError("an APIKeyUser cannot be changed")

    def __repr__(self) -> str:
        return f"APIKeyUser(id={self.record.id!r}, workspace={self.record.workspace!r})"

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return self.record.name

    @property
    def identity(self) -> str:
        return self.record.id

    @property
    def workspace(self) -> str:
        return self.record.workspace


class APIKeyAuth(AuthCredentials):
    """`scope["auth"]`: its `scopes` understand `resource:*` grants and full access."""

    def __init__(self, scopes: GrantedScopes) -> None:
        object.__setattr__(self, "scopes", scopes)

    def __setattr__(self, name: str, value: object) -> None:
        # One per key version, shared by its requests (see Gate.admit_now): read-only.
        raise AttributeError("an APIKeyAuth cannot be changed")


def _policy_name_text(name: str) -> str:
    """`name` as it can stand in a structured-field string: printable ASCII, no `"` or `\\`."""
    return "".join(char for char in name if " " <= char <= "~" and char not in '"\\')


@functools.lru_cache(maxsize=256)
def _policy_header(name: str, limit: int, window: int) -> tuple[bytes, bytes]:
    return b"ratelimit-policy", f'"{name}";q={limit};w={window}'.encode()


class _OnePolicy(NamedTuple):
    """How the headers show a key's one policy, built once per limit: its name, its
    RateLimit-Policy header and the start of its RateLimit value."""

    name: str
    policy_header: tuple[bytes, bytes]
    start: bytes  # b'"name";r='


class _PolicySet(NamedTuple):
    """How the headers show a key's several policies: their names and RateLimit-Policy."""

    names: tuple[str, ...]
    policy_header: tuple[bytes, bytes]


_NO_POLICY = _OnePolicy("", (b"", b""), b"")


@functools.lru_cache(maxsize=256)
def _policy_set(policies: tuple[tuple[str, int, int], ...]) -> _PolicySet:
    items = (f'"{name}";q={limit};w={window}' for name, limit, window in policies)
    return _PolicySet(
        tuple(name for name, _, _ in policies),
        (b"ratelimit-policy", ", ".join(items).encode()),
    )


def _single_headers(decision: RateDecision, policy_name: str) -> Headers:
    _, limit, window, remaining, reset_after = decision
    value = b'"%s";r=%d;t=%d' % (policy_name.encode(), remaining, reset_after)
    return [_policy_header(policy_name, limit, window), (b"ratelimit", value)]


def _policies_headers(decision: PolicyDecision, shown: _PolicySet) -> Headers:
    value = ", ".join(
        [
            f'"{name}";r={status[4]};t={status[5]}'
            for name, status in zip(shown.names, decision.policies, strict=True)
        ]
    )
    return [shown.policy_header, (b"ratelimit", value.encode())]


def rate_limit_headers(
    decision: RateDecision | PolicyDecision, policy_name: str = "default"
) -> Headers:
    """`RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-11).

    One list item per policy: `"burst";q=10;w=1, "daily";q=10000;w=86400` and
    `"burst";r=3;t=1, "daily";r=9120;t=40210`. The policy named `default` (a key's one
    unnamed limit) is shown as `policy_name`.
    """
    if isinstance(decision, PolicyDecision):
        return _policies_headers(decision, _shown(decision, policy_name))
    return _single_headers(decision, policy_name)


def _shown(decision: PolicyDecision, policy_name: str) -> _PolicySet:
    return _policy_set(
        tuple(
            (policy_name if status.name == DEFAULT_POLICY else status.name, *status[2:4])
            for status in decision.policies
        )
    )


# How `Gate.admit_now` takes a version of a key (`_Prepared.kind`).
_PLAIN = 0  # one limit, no address allowlist: the common case, decided in a straight line
_OTHER = 1  # several limits, or an address allowlist: decided here too, with their checks
_GENERAL = 2  # credits (spent by an await): left to `admit_general`


# (method, path) -> the scopes a key lacks for that route (None: it may take it)
_RouteAnswers = dict[tuple[str, str], tuple[str, ...] | None]
# Distinct grants whose `scope["auth"]` and route answers a gate shares between keys.
_SHARED_GRANTS: Final = 4096


class _Prepared(NamedTuple):
    """What `Gate.admit_now` needs of one version of a key, made at its first request:
    how it is taken (`kind`), the objects the request's scope gets, its grants, how its
    limits are shown, its one limit's counter, and its answers by route (the answers and
    `auth` shared by every key with the same grants)."""

    record: KeyRecord
    kind: int
    grants: GrantedScopes
    auth: APIKeyAuth
    user: APIKeyUser
    routes: _RouteAnswers
    counter: str
    amount: int
    window: int
    shape: _OnePolicy | _PolicySet
    one: _OnePolicy  # `shape` when it is one policy (else unused)


def check_address(scope: Scope, record: KeyRecord, trusted_proxies: int = 0) -> None:
    """Raise `IPNotAllowed` unless the request's client address is in the key's allowlist
    (a key without one allows every address). `trusted_proxies` as the middleware's."""
    allowlist = Allowlist.parse(record.allowed_ips)
    if allowlist is not None and not allowlist.allows(client_address(scope, trusted_proxies)):
        raise IPNotAllowed()


async def spend_credit(
    manager: KeyManager, limiter: RateLimiter, record: KeyRecord, headers: Headers, cost: int = 1
) -> Headers:
    """Spend `cost` of the key's credits and add them to the RateLimit `headers`; or refuse
    with `CreditsExhausted` after giving back what the rate limits charged the request, so a
    refused request is charged to nothing."""
    left = await manager.spend_credits(record, cost)
    refill = parse_refill(record.credit_refill) if record.credit_refill else None
    if left is None:
        await limiter.refund(record.id, record.rate_limit)
        retry = None
        if refill is not None:
            now = utcnow()
            retry = math.ceil((refill.next_start(now) - now).total_seconds())
        raise CreditsExhausted(retry)
    return credit_headers(headers, left, refill)


def credit_headers(
    headers: Headers, left: int, refill: Refill | None, now: datetime | None = None
) -> Headers:
    """`headers` with a `credits` item in `RateLimit` (the credits left, and `t`, the
    seconds to the next refill) and, for a key with a refill, in `RateLimit-Policy`."""
    item = f'"credits";r={left}'
    policy = None
    if refill is not None:
        now = now or utcnow()
        start, end = refill.period_start(now), refill.next_start(now)
        item += f";t={max(1, math.ceil((end - now).total_seconds()))}"
        policy = f'"credits";q={refill.amount};w={int((end - start).total_seconds())}'
    updated: Headers = []
    for name, value in headers:
        if name == b"ratelimit":
            value = value + b", " + item.encode()
        elif name == b"ratelimit-policy" and policy is not None:
            value = value + b", " + policy.encode()
        updated.append((name, value))
    return updated


async def check_rate_limits(
    limiter: RateLimiter, record: KeyRecord, policy_name: str = "default"
) -> tuple[Headers, RateLimited | None]:
    """Charge `record`'s request to its policies: the RateLimit headers, and the refusal.

    The refusal (None when admitted) is a `RateLimited` naming the violated policies, with
    `Retry-After` the longest of their `t`. What the integrations share with the middleware.
    """
    limit = record.rate_limit
    policies = limiter.policies(limit)
    if len(policies) == 1:
        name = policy_name if policies[0].name == DEFAULT_POLICY else policies[0].name
        decision = await limiter.hit(record.id, limit)
        refusal = None if decision.allowed else RateLimited(decision.reset_after, (name,))
        return _single_headers(decision, name), refusal
    decisions = await limiter.hit_policies(record.id, limit)
    shown = _shown(decisions, policy_name)
    headers = _policies_headers(decisions, shown)
    if decisions.allowed:
        return headers, None
    return headers, RateLimited(decisions.retry_after, _violated(decisions, shown))


def _violated(decision: PolicyDecision, shown: _PolicySet) -> tuple[str, ...]:
    return tuple(
        name
        for name, status in zip(shown.names, decision.policies, strict=True)
        if not status.allowed
    )


def route_path(scope: Scope) -> str:
    """The path the app routes on: `scope["path"]` without the root path that mounted apps
    and servers run with `--root-path` put in front of it (as Starlette's routing strips)."""
    path: str = scope["path"]
    root_path = scope.get("root_path")
    if root_path and path.startswith(root_path):
        rest = path[len(root_path) :]
        if not rest or rest[0] == "/":
            return rest or "/"
    return path


REFUSED_AFTER_AUTHENTICATION: frozenset[str] = frozenset(
    {"ip_not_allowed", "rate_limited", "insufficient_scope", "credits_exhausted"}
)
"""The refusals of a request whose key was verified: its usage history counts them."""
# What the limiter telemetry reports as refused (the other refusals are not the limiter's).
_LIMITER_CODES = frozenset({"rate_limited", "credits_exhausted"})


class Gate:
    """Admits or refuses a request with an API key: the request path of every entry point.

    - `manager`: the `KeyManager` that verifies keys and counts their use.
    - `limiter`: the `RateLimiter` that holds the keys' rate limits; None takes the
      manager's (`KeyManager.limiter`), which the integrations share. Either way the
      manager sends its thresholds as webhooks (`KeyManager.observe_limiter`).
    - `scopes`: a route table (`ScopeTable`, or its rules) of the scopes each route needs;
      None checks only the scopes `admit` is given.
    - `unmapped`: what a restricted key may do on a route no rule of `scopes` covers:
      `"deny"` (403 `insufficient_scope`) or `"allow"`. Full-access keys pass either way.
    - `costs`: what a request costs in credits by route (`CostTable`, or its rules); 1
      where no rule matches.
    - `header`: `"Authorization"` reads `Authorization: Bearer <key>`; another header name
      reads the bare key from that one header, and never Authorization.
    - `policy_name`: how the `RateLimit` headers name a key's one unnamed limit.
    - `trusted_proxies`: how many proxies append to `X-Forwarded-For` (see
      `APIKeyMiddleware`); 0 uses the connection's address.

    Everything that can be decided once is decided here; `admit` does only the request's
    work, in the order the contract gives: address, rate limits, scopes, credits.
    """

    def __init__(
        self,
        manager: KeyManager,
        *,
        limiter: RateLimiter | None = None,
        scopes: ScopeTable | Mapping[str, str | Sequence[str]] | None = None,
        unmapped: Literal["deny", "allow"] = "deny",
        costs: CostTable | Mapping[str, int] | None = None,
        header: str = "Authorization",
        policy_name: str = "default",
        trusted_proxies: int = 0,
    ) -> None:
        if unmapped not in ("deny", "allow"):
            raise ConfigurationError("unmapped takes 'deny' or 'allow'")
        if isinstance(trusted_proxies, bool) or not isinstance(trusted_proxies, int):
            raise ConfigurationError("trusted_proxies takes a whole number of proxies")
        if trusted_proxies < 0:
            raise ConfigurationError("trusted_proxies must not be negative")
        self.manager = manager
        self.limiter = limiter if limiter is not None else manager.limiter
        if limiter is not None:
            manager.observe_limiter(limiter)  # its thresholds become webhooks, as the manager's
        self.scopes = (
            scopes if scopes is None or isinstance(scopes, ScopeTable) else ScopeTable(scopes)
        )
        self.allow_unmapped = unmapped == "allow"
        self.costs = (
            costs
            if costs is None or isinstance(costs, CostTable)
            else CostTable(costs)
            if costs
            else None
        )
        self.header = header
        self.header_name = key_header(header)
        """The lower-case name of the header the key is read from."""
        self._bearer = self.header_name == b"authorization"
        self.policy_name = _policy_name_text(policy_name)
        self.trusted_proxies = trusted_proxies
        # a key's rate_limit -> the name its one policy is shown with, or those of its policies
        self._shapes: dict[str | None, _OnePolicy | _PolicySet] = {}
        # key id -> what admit_now needs of the key's latest version seen
        self._prepared: dict[str, _Prepared] = {}
        # a key's grants -> its `scope["auth"]` and its answers by route: they follow from
        # the grants alone, so keys with the same scopes share them (a key costs less memory)
        self._by_grants: dict[GrantedScopes, tuple[APIKeyAuth, _RouteAnswers]] = {}
        # (method, path) -> the scopes the route needs (None: no rule), for admit_now
        self._routes: dict[tuple[str, str], tuple[str, ...] | None] = {}
        self._counts_here = self.limiter.counts_here
        # Redis' limiter decides at once too while this process holds units of a window.
        self._decides_here = self._counts_here or self.limiter.leases_here
        # The ids of keys admit_now leaves to admit_general (bytes), and where a token of
        # the manager's prefix holds its id ("{prefix}_{id}_…"): so that their requests are
        # not verified twice, once by each body. (0, 0) when the manager reads any prefix.
        self._general: dict[bytes, None] = {}
        prefix = manager.prefix
        self._id_start = len(prefix) + 1 if prefix else 0
        self._id_end = self._id_start + ID_LENGTH if prefix else 0

    def admit_now(self, scope: Scope, path: str, required: Sequence[str] = ()) -> Headers | None:
        """`admit` for the common case, decided without an await; None for any other case,
        having charged and counted nothing: then `await admit_general(scope, path, required)`.

        The common case: the key's header holds one well-formed value; the manager holds
        the key in its key cache (or its memory store) with a fast hash (`verify_now`);
        the limiter counts in this process (`RateLimiter.counts_here`) or, on Redis, holds
        units of the key's window that it leased (`RateLimiter.spend_here`: a key with one
        limit and no allowlist); the key has no credits; telemetry is off. The checks are
        `admit_general`'s, in its order, without the layers between them: the key's format
        and checksum, its peppered hash (compared in constant time), its state and expiry
        (all in `verify_now`), its usage count, its address, its limits and the two
        RateLimit headers, its scopes. What can be made once per key version (its grants,
        `scope["auth"]` and `scope["user"]`, its limit's counter and headers, whether it
        has a route's scopes) is made at its first request.

        Why a second body: it is the request path of nearly every request, and each layer
        it skips (a coroutine, the header helpers, the limiter's decision object, two
        objects per request) is a measurable share of the middleware's cost next to a
        hand-written check (docs/performance.md). Everything it cannot decide at once, and
        every malformed header, goes to `admit_general`, which decides the same way; a
        refusal it makes (a wrong secret, a revoked key, an address, a limit, a scope) is
        booked by `refused` exactly as `admit_general` books it.
        """
        manager = self.manager
        if not self._decides_here or manager.telemetry.active:
            return None
        record: KeyRecord | None = None
        rate_headers: Headers | None = None
        try:
            # The key's header: exactly one, read as bearer_token / header_token read it.
            header_name = self.header_name
            value = None
            for name, found in scope["headers"]:
                if name == header_name:
                    if value is not None:
                        return None  # two: admit refuses
                    value = found
            if value is None:
                return None
            value = value.strip(b" \t")
            if len(value) > MAX_AUTHORIZATION_LENGTH or not value.isascii():
                return None
            if self._bearer:
                # The usual spelling first, sparing the two objects of the slice and lower().
                if not value.startswith(b"Bearer ") and value[:7].lower() != b"bearer ":
                    return None
                value = value[7:]
            if self._general and value[self._id_start : self._id_end] in self._general:
                return None  # a key with credits: admit_general, without verifying twice
            # Format, checksum, hash, state and expiry; the request is not counted yet.
            record = manager.verify_now(value.decode("ascii"), count=False)
            if record is None:
                return None
            key_id = record.id
            try:
                prepared = self._prepared[key_id]
            except KeyError:
                prepared = None
            if prepared is None or prepared.record is not record:
                prepared = self._prepare(record)
            kind = prepared.kind
            if kind == _PLAIN:
                if self._counts_here:
                    remaining, reset_after = self.limiter.count_here(
                        prepared.counter, prepared.amount, prepared.window
                    )
                else:
                    spent = self.limiter.spend_here(
                        prepared.counter, prepared.amount, prepared.window
                    )
                    if spent is None:
                        return None  # Redis must be asked: nothing is charged or counted
                    remaining, reset_after = spent
                manager.usage_buffer.record(key_id)
                one = prepared.one
                rate_headers = [
                    one.policy_header,
                    (
                        b"ratelimit",
                        b"%s%d;t=%d" % (one.start, remaining if remaining > 0 else 0, reset_after),
                    ),
                ]
                if remaining < 0:
                    raise RateLimited(reset_after, (one.name,))
            elif kind == _OTHER:
                if not self._counts_here:
                    return None  # several limits on Redis: one script leases them all
                manager.usage_buffer.record(key_id)
                if record.allowed_ips:
                    check_address(scope, record, self.trusted_proxies)  # before any charge
                rate_headers, refusal = self._count_other(record, prepared)
                if refusal is not None:
                    raise refusal
            else:
                if self._id_end:
                    remember(self._general, key_id.encode(), None, 10_000)
                return None
            # The scopes, as admit_general checks them, answered once per route and key
            # version.
            if self.scopes is not None:
                route = (scope.get("method", "GET"), path)
                try:
                    lacking = prepared.routes[route]
                except KeyError:
                    lacking = self._lacking(prepared, route)
                if lacking is not None:
                    raise InsufficientScope(lacking)
            if required and not prepared.grants.covers(required):
                raise InsufficientScope(required)
        except AuthenticationError as exc:
            raise self.refused(record, exc, rate_headers) from None
        except Exception:
            logger.exception("apikeys: unexpected error while authenticating; answering 503")
            raise AuthUnavailable() from None
        scope["apikey"] = record
        scope["auth"] = prepared.auth
        scope["user"] = prepared.user
        return rate_headers

    def _count_other(
        self, record: KeyRecord, prepared: _Prepared
    ) -> tuple[Headers, RateLimited | None]:
        """`admit_now`'s limits of a key with an allowlist or several limits: the RateLimit
        headers, and the refusal (None when admitted)."""
        shape = prepared.shape
        if isinstance(shape, _OnePolicy):
            remaining, reset_after = self.limiter.count_here(
                prepared.counter, prepared.amount, prepared.window
            )
            value = b"%s%d;t=%d" % (shape.start, remaining if remaining > 0 else 0, reset_after)
            headers = [shape.policy_header, (b"ratelimit", value)]
            if remaining < 0:
                return headers, RateLimited(reset_after, (shape.name,))
            return headers, None
        decisions = self.limiter.policies_here(record.id, record.rate_limit)
        headers = _policies_headers(decisions, shape)
        if not decisions.allowed:
            return headers, RateLimited(decisions.retry_after, _violated(decisions, shape))
        return headers, None

    def _lacking(self, prepared: _Prepared, route: tuple[str, str]) -> tuple[str, ...] | None:
        """The scopes the key of `prepared` lacks for `route` (method, path), as
        admit_general finds them (None: it may take the route), remembered for admit_now:
        what a route needs once per route, and the key's answer once per version."""
        assert self.scopes is not None
        try:
            needed = self._routes[route]
        except KeyError:
            needed = remember(self._routes, route, self.scopes.required(*route), 10_000)
        lacking: tuple[str, ...] | None = None
        if needed is None:
            # No rule covers the route: only full access, unless the app allows it.
            if not (prepared.grants.full_access or self.allow_unmapped):
                lacking = ()
        elif not prepared.grants.covers(needed):
            lacking = needed
        remember(prepared.routes, route, lacking, 256)  # a key on many paths (ids in them)
        return lacking

    def _prepare(self, record: KeyRecord) -> _Prepared:
        """What `admit_now` needs of this version of the key (see `_Prepared`)."""
        grants = grants_for(record.scopes, record.access == "full")
        shared = self._by_grants.get(grants)
        if shared is None:
            shared = remember(self._by_grants, grants, (APIKeyAuth(grants), {}), _SHARED_GRANTS)
        auth, routes = shared
        limit = record.rate_limit
        shape = self._shapes.get(limit) or self._shape(limit)
        counter, amount, window = "", 0, 0
        if isinstance(shape, _OnePolicy):
            counter, amount, window = self.limiter.plan(record.id, limit)
        if record.credits is not None:
            kind = _GENERAL
        elif record.allowed_ips or not isinstance(shape, _OnePolicy):
            kind = _OTHER
        else:
            kind = _PLAIN
        prepared = _Prepared(
            record,
            kind,
            grants,
            auth,
            APIKeyUser(record),
            routes,
            counter,
            amount,
            window,
            shape,
            shape if isinstance(shape, _OnePolicy) else _NO_POLICY,
        )
        return remember(self._prepared, record.id, prepared, 10_000)

    async def admit(self, scope: Scope, path: str, required: Sequence[str] = ()) -> Headers:
        """Admit the request `scope` to `path` (the path the app routes on), or refuse it:
        `admit_now`, and `admit_general` when that cannot decide.

        `required` are scopes the key needs besides what the route table says (what an
        endpoint declares, say). Admitted: `scope["apikey"]` is the `KeyRecord`,
        `scope["auth"]` an `APIKeyAuth` and `scope["user"]` an `APIKeyUser`, and the answer
        is the `RateLimit` headers for the response. Refused: raises the
        `AuthenticationError` to answer with (its `headers` carry the `RateLimit` headers
        when the key got that far), counted as `refused` says; never anything else.
        """
        decided = self.admit_now(scope, path, required)
        if decided is not None:
            return decided
        return await self.admit_general(scope, path, required)

    async def admit_general(self, scope: Scope, path: str, required: Sequence[str] = ()) -> Headers:
        """`admit` for every case, the common one included: what `admit` does when
        `admit_now` cannot decide (a caller that has just asked `admit_now` calls this)."""
        record: KeyRecord | None = None
        rate_headers: Headers | None = None
        try:
            header_name = self.header_name
            values = []
            for name, value in scope["headers"]:
                if name == header_name:
                    values.append(value)
            token = bearer_token(values) if self._bearer else header_token(values, self.header)
            # A cached key is decided without awaiting; verify() reads the store otherwise.
            manager = self.manager
            record = manager.verify_now(token) or await manager.verify(token)
            if self._general and record.credits is None:
                self._general.pop(record.id.encode(), None)  # its credits were taken away
            if record.allowed_ips:
                check_address(scope, record, self.trusted_proxies)  # before any charge
            limit = record.rate_limit
            shape = self._shapes.get(limit) or self._shape(limit)
            if isinstance(shape, _OnePolicy):
                # One policy: the fast path, decided without awaiting while it can be.
                limiter = self.limiter
                decision = limiter.hit_now(record.id, limit) or await limiter.hit(record.id, limit)
                rate_headers = [
                    shape.policy_header,
                    (
                        b"ratelimit",
                        b"%s%d;t=%d" % (shape.start, decision.remaining, decision.reset_after),
                    ),
                ]
                if not decision.allowed:
                    raise RateLimited(decision.reset_after, (shape.name,))
            else:
                decisions = await self.limiter.hit_policies(record.id, limit)
                rate_headers = _policies_headers(decisions, shape)
                if not decisions.allowed:
                    raise RateLimited(decisions.retry_after, _violated(decisions, shape))
            grants = grants_for(record.scopes, record.access == "full")
            table = self.scopes
            if table is not None:
                needed = table.required(scope.get("method", "GET"), path)
                if needed is None:
                    # No rule covers the route: only full access, unless the app allows it.
                    if not (grants.full_access or self.allow_unmapped):
                        raise InsufficientScope(())
                elif not grants.covers(needed):
                    raise InsufficientScope(needed)
            if required and not grants.covers(required):
                raise InsufficientScope(required)
            if record.credits is not None:
                cost = 1 if self.costs is None else self.costs.cost(scope.get("method", ""), path)
                rate_headers = await spend_credit(
                    self.manager, self.limiter, record, rate_headers, cost
                )
        except AuthenticationError as exc:
            raise self.refused(record, exc, rate_headers) from None
        except Exception:
            # A bug or an unforeseen store error: log it (no request data) and fail closed.
            logger.exception("apikeys: unexpected error while authenticating; answering 503")
            raise AuthUnavailable() from None
        if self.manager.telemetry.active:
            self.manager.telemetry.limiter(record.id, "allowed")
        scope["apikey"] = record
        scope["auth"] = APIKeyAuth(grants)
        scope["user"] = APIKeyUser(record)
        return rate_headers

    def refused(
        self,
        record: KeyRecord | None,
        exc: AuthenticationError,
        rate_headers: Headers | None = None,
    ) -> AuthenticationError:
        """Book the refusal `exc` of a request (of `record`, when its key was verified) and
        answer the error to send.

        A refusal of `REFUSED_AFTER_AUTHENTICATION` is counted in the key's usage history
        under its code (the key's request was counted when it was verified), and a rate
        limit or credits refusal in the limiter telemetry; other refusals (a bad key, 503)
        are the key's to nobody. The error's detail names the key's header, and its
        `headers` gain `rate_headers`.
        """
        if record is not None and exc.code in REFUSED_AFTER_AUTHENTICATION:
            self.manager.usage_buffer.refused(record.id, exc.code)
            if self.manager.telemetry.active and exc.code in _LIMITER_CODES:
                self.manager.telemetry.limiter(record.id, exc.code)
        if not self._bearer:
            exc = header_error(exc, self.header)
        if rate_headers:
            exc.headers = (*exc.headers, *rate_headers)
        return exc

    def _shape(self, limit: str | None) -> _OnePolicy | _PolicySet:
        shown = tuple(
            (
                self.policy_name if policy.name == DEFAULT_POLICY else policy.name,
                policy.item.amount,
                policy.item.get_expiry(),
            )
            for policy in self.limiter.policies(limit)
        )
        shape: _OnePolicy | _PolicySet
        if len(shown) == 1:
            name = shown[0][0]
            shape = _OnePolicy(name, _policy_header(*shown[0]), b'"%s";r=' % name.encode())
        else:
            shape = _policy_set(shown)
        return remember(self._shapes, limit, shape, 10_000)
